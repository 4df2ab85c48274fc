"""VLLMPolicy keeps TorchRL's wrapper contract where it means the same thing (issue 19):
scoring keeps its text / history, ``return_log_probs``, ``return_*`` attributes, a batch of
one reads back as a list, a wrong input type is a ``TypeError``. Fake service, real tokenizer."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict, lazy_stack, set_list_to_stack

from torchrl_vllm_ext.errors import ConfigurationError, InvalidRequestError
from torchrl_vllm_ext.wrappers import VLLMPolicy

from ..helpers import FakeService as _FakeService


def fake_service():  # the tiny tokenizer's vocabulary (512 ids)
    return _FakeService(max_token_id=511)


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def text_td(texts, key="prompt"):
    from torchrl.modules.llm.policies import Text

    return TensorDict({"text": Text(**{key: texts}, batch_size=[len(texts)])}, [len(texts)])


def history_td(chats, key="prompt"):
    from torchrl.data.llm import History
    from torchrl.modules.llm.policies import ChatHistory

    with set_list_to_stack(True):
        rows = [
            TensorDict({"history": ChatHistory(**{key: History.from_chats([c])[0]})}) for c in chats
        ]
        return lazy_stack(rows)


CHATS = [[{"role": "user", "content": "hello"}], [{"role": "user", "content": "one two"}]]


@pytest.mark.parametrize("pad_output", [False, True])
def test_scoring_text_keeps_the_text(tokenizer, pad_output):
    texts = ["the cat sat", "one two"]
    policy = VLLMPolicy(
        fake_service(),
        input_mode="text",
        generate=False,
        tokenizer=tokenizer,
        pad_output=pad_output,
    )
    out = policy(text_td(texts, key="full"))
    assert out.get(("text", "full")).tolist() == texts
    assert "text" in policy.out_keys


@pytest.mark.parametrize("pad_output", [False, True])
def test_scoring_history_keeps_the_history_and_its_rendered_text(tokenizer, pad_output):
    policy = VLLMPolicy(
        fake_service(),
        input_mode="history",
        generate=False,
        tokenizer=tokenizer,
        pad_output=pad_output,
    )
    out = policy(history_td(CHATS, key="full"))
    rendered = out.get(("text", "full")).tolist()
    assert len(rendered) == 2 and "hello" in rendered[0] and "one two" in rendered[1]
    histories = [out[i]["history"].full for i in range(2)]
    assert [h.content[-1] for h in histories] == ["hello", "one two"]


@pytest.mark.parametrize("pad_output", [False, True])
def test_return_log_probs_false_drops_them(pad_output):
    td = TensorDict({("tokens", "prompt"): torch.tensor([[5, 6, 7]])}, batch_size=[1])
    service = fake_service()
    policy = VLLMPolicy(
        service, input_mode="tokens", return_log_probs=False, pad_output=pad_output, pad_token_id=0
    )
    out = policy(td)
    assert "log_probs" not in out.keys() and "log_probs" not in policy.out_keys
    assert service.log_probs_asked is False, "vLLM is not asked to compute them"
    assert out.get(("tokens", "response"), as_list=True)[0].numel() > 0
    assert VLLMPolicy(fake_service(), input_mode="tokens", return_log_probs=True).return_log_probs
    with pytest.raises(ConfigurationError, match="return_log_probs"):
        VLLMPolicy(fake_service(), input_mode="tokens", return_log_probs=False, generate=False)


def test_return_attributes_follow_the_mode(tokenizer):
    tokens = VLLMPolicy(fake_service(), input_mode="tokens")
    history = VLLMPolicy(fake_service(), input_mode="history", tokenizer=tokenizer)
    assert (tokens.return_text, tokens.return_history, tokens.return_tokens) == (False, False, True)
    assert (history.return_text, history.return_history, history.return_masks) == (True,) * 3


def test_a_batch_of_one_padded_reads_back_as_a_list(tokenizer):
    policy = VLLMPolicy(
        fake_service(),
        input_mode="text",
        tokenizer=tokenizer,
        pad_output=True,
        sampling_params={"max_tokens": 2},
    )
    out = policy(text_td(["just one"]))
    for field in ("prompt", "response", "full"):
        value = out.get(("text", field)).tolist()
        assert isinstance(value, list) and len(value) == 1, (field, value)


def test_a_wrong_history_type_is_a_type_error(tokenizer):
    from torchrl.modules.llm.policies import ChatHistory

    td = lazy_stack([TensorDict({"history": ChatHistory(prompt="not a history")})])
    policy = VLLMPolicy(fake_service(), input_mode="history", tokenizer=tokenizer)
    with pytest.raises(TypeError, match="History") as info:
        policy(td)
    assert isinstance(info.value, InvalidRequestError)  # and still our typed error


def test_get_new_version_takes_retrieve_kl_one_tuple_keys():
    policy = VLLMPolicy(fake_service(), input_mode="tokens", num_samples=2)
    scorer = policy.get_new_version(
        generate=False, return_log_probs=True, log_probs_key=("ref_log_probs",)
    )
    assert scorer.log_probs_key == "ref_log_probs" and scorer.num_samples is None
    assert not scorer.generate


def test_generate_kwargs_take_torchrls_names():
    policy = VLLMPolicy(
        fake_service(),
        input_mode="tokens",
        generate_kwargs={"max_new_tokens": 7, "num_return_sequences": 3, "temperature": 0.5},
    )
    sp = policy.sampling_params
    assert (sp.max_tokens, sp.n, sp.temperature) == (7, 3, 0.5)
    assert policy.num_samples == 3
    out = policy(TensorDict({("tokens", "prompt"): torch.tensor([[5, 6]])}, batch_size=[1]))
    assert out.batch_size == (1, 3)
    assert (
        VLLMPolicy(fake_service(), input_mode="tokens", generate_kwargs={"n": 2}).num_samples == 2
    )
    greedy = VLLMPolicy(fake_service(), input_mode="tokens", generate_kwargs={"do_sample": False})
    assert greedy.sampling_params.temperature == 0.0


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"generate_kwargs": {"temperature": -0.1}}, "temperature"),
        ({"sampling_params": {"top_p": 2.0}}, "top_p"),
        ({"generate_kwargs": {"max_tokens": 3, "max_new_tokens": 4}}, "both"),
        ({"generate_kwargs": {"do_sample": False, "temperature": 0.7}}, "greedy"),
        ({"generate_kwargs": {"n": 2}, "num_samples": 3}, "differs"),
        ({"generate_kwargs": {"max_tokens": 3}, "sampling_params": {"max_tokens": 4}}, "both"),
        ({"generate_kwargs": {"no_such_field": 1}}, "no_such_field"),
    ],
)
def test_bad_sampling_values_fail_at_construction(options, match):
    with pytest.raises(ConfigurationError, match=match):
        VLLMPolicy(fake_service(), input_mode="tokens", **options)


def test_flat_input_keys(tokenizer):
    from torchrl.data.llm import History

    ids = TensorDict({"input_ids": torch.tensor([[5, 6, 7]])}, batch_size=[1])
    out = VLLMPolicy(
        fake_service(),
        input_mode="tokens",
        input_key="input_ids",
        sampling_params={"max_tokens": 2},
    )(ids)
    assert out.get(("tokens", "prompt"), as_list=True)[0].tolist() == [5, 6, 7]

    texts = TensorDict({"text": ["the cat", "one"]}, batch_size=[2])
    policy = VLLMPolicy(fake_service(), input_mode="text", input_key="text", tokenizer=tokenizer)
    out = policy(texts)
    assert policy.in_keys == ["text"] and out.get(("text", "prompt")).tolist() == ["the cat", "one"]

    with set_list_to_stack(True):
        chats = lazy_stack([TensorDict({"history": History.from_chats([c])[0]}) for c in CHATS])
    out = VLLMPolicy(
        fake_service(), input_mode="history", input_key="history", tokenizer=tokenizer
    )(chats)
    assert [out[i]["history"].prompt.content[-1] for i in range(2)] == ["hello", "one two"]

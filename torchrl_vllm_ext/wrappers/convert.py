"""Generated samples (a :class:`~torchrl_vllm_ext.batches.RequestBatch`) -> TorchRL's LLM layout.

The output follows ``torchrl.modules.llm.policies``: ``Tokens``, ``LogProbs`` and ``Masks``
tensorclasses (plus ``Text`` / ``ChatHistory`` where they apply) under the top-level keys
``tokens``, ``log_probs``, ``masks``, ``text`` and ``history``.

- Unpadded (``pad_output=False``): one 0-dim TensorDict per sample whose leaves are 1-D
  tensors of that sample's own length; the caller lazily stacks them (TorchRL's layout).
- Padded (``pad_output=True``): dense ``(N, T)`` tensors; prompts are left-padded,
  responses right-padded, ``full = cat(prompt, response)``: ``[lpad | prompt | response | rpad]``.

The batch's flat arrays go straight in: every field is one gather plus index arithmetic
(segment starts repeated over segment lengths), then a single ``split`` or scatter; the
only Python loops run once per *sample*, to wrap its views. Scoring output is built in
:mod:`.scoring`, text and chat-history fields in :mod:`.text`.

Log-prob conventions (TorchRL's): ``log_probs.prompt`` is always written (TorchRL's keys);
entry ``t`` of ``log_probs.full`` is
``log p(full[t] | full[:t])``; the first token of a sequence has no score and is 0.0, as in
TorchRL's wrappers; prompt positions that were *not* scored are NaN ("no score", which
GRPOLoss masks out), never 0.0; padding is 0.0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from tensordict import MetaData, TensorDict

from torchrl_vllm_ext.batches import RequestBatch
from torchrl_vllm_ext.wrappers.layout import (
    CACHED_TOKENS,
    DEFAULT_KEYS,
    END_FROM,
    END_VERSION,
    FINISH_REASON,
    NO_TOKEN_VERSION,
    TOKEN_VERSION,
    VERSION,
    OutputKeys,
    SharedStrings,
    row_tc,
    row_td,
    split_rows,
    strings,
    tensorclasses,
)
from torchrl_vllm_ext.wrappers.padding import pad_flat, positions, starts_of


@dataclass
class Samples:
    """The samples of a batch as flat per-sample arrays (prompt-major rows)."""

    prompt_lengths: np.ndarray
    """Prompt length of each sample's request (S,)."""
    prompts: np.ndarray
    """Each sample's prompt ids, concatenated (a request's prompt repeated per sample)."""
    prompt_logprobs: np.ndarray | None
    """Prompt log-probs concatenated like ``prompts`` (first token NaN), or None."""
    response_lengths: np.ndarray
    """Generated tokens of each sample (S,)."""
    responses: np.ndarray
    """Generated ids, concatenated."""
    response_logprobs: np.ndarray
    """Sampled-token log-probs, concatenated (NaN where not computed)."""
    weight_versions: list[str]
    """Engine weight version each sample's request was admitted at."""
    weight_versions_end: list[str]
    """Engine weight version when it finished (differs across a ``keep`` sync)."""
    finish_reasons: list
    """vLLM's finish reason of each sample."""
    end_version_from: np.ndarray
    """Index of each sample's first token generated with its end version (S,)."""
    token_versions: np.ndarray
    """The version that made each generated token, concatenated like ``responses``."""
    cached_tokens: np.ndarray
    """Prompt tokens of each sample's request served from vLLM's prefix cache (S,)."""


def samples_of(batch: RequestBatch, with_prompt_logprobs: bool = True) -> Samples:
    """Per-sample views of ``batch``: each request's prompt repeated for its samples."""
    req = batch.request_of_sample
    P = batch.prompt_lengths[req]
    idx = np.repeat(starts_of(batch.prompt_lengths)[req], P) + positions(P)
    prompt_lp = None
    if with_prompt_logprobs and batch.has_prompt_logprobs.all():
        prompt_lp = batch.prompt_logprobs[idx]
    starts, ends = batch.versions_start, batch.versions_end
    # NOTE: arrays Ray deserialised are read-only views of its buffer; the output's
    # tensors share memory with these, and callers may write into them.
    return Samples(
        prompt_lengths=P,
        prompts=batch.prompt_token_ids[idx],
        prompt_logprobs=prompt_lp,
        response_lengths=_writable(batch.sample_lengths),
        responses=_writable(batch.token_ids),
        response_logprobs=_writable(batch.logprobs),
        weight_versions=[starts[r] for r in req.tolist()],
        weight_versions_end=[ends[r] for r in req.tolist()],
        finish_reasons=list(batch.finish_reasons),
        end_version_from=batch.end_version_from,
        token_versions=batch.token_versions(NO_TOKEN_VERSION),
        cached_tokens=batch.cached_tokens[req],
    )


def _writable(a: np.ndarray) -> np.ndarray:
    """``a``, or a copy of it if it is read-only."""
    return a if a.flags.writeable else a.copy()


def first_token_zero(lp: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Set the score of each sequence's first token (vLLM's NaN) to TorchRL's 0.0, in place."""
    lp[starts_of(lengths)[lengths > 0]] = 0.0
    return lp


# ---------------------------------------------------------------------------- generation
def generated_rows(
    batch: RequestBatch, keys: OutputKeys = DEFAULT_KEYS, with_prompt_logprobs: bool = True
) -> list[TensorDict]:
    """One 0-dim TensorDict per sample in TorchRL's unpadded layout (``pad_output=False``).

    ``with_prompt_logprobs=False`` ignores prompt scores even when present.
    """
    s = samples_of(batch, with_prompt_logprobs)
    P, R = s.prompt_lengths, s.response_lengths
    L = P + R
    starts = starts_of(L)
    p_pos = np.repeat(starts, P) + positions(P)
    r_pos = np.repeat(starts + P, R) + positions(R)

    full = np.empty(int(L.sum()), dtype=np.int64)
    full[p_pos] = s.prompts
    full[r_pos] = s.responses
    assistant = np.zeros(full.shape, dtype=bool)
    assistant[r_pos] = True
    full_lp = np.full(full.shape, np.nan, dtype=np.float32)
    full_lp[r_pos] = s.response_logprobs
    prompt_lp = None
    if s.prompt_logprobs is not None:
        prompt_lp = first_token_zero(s.prompt_logprobs.copy(), P)
        full_lp[p_pos] = prompt_lp

    # Each sample's slice of every column (views into the flat tensors).
    rows = _Columns(
        prompt=split_rows(s.prompts, P),
        response=split_rows(s.responses, R),
        full=split_rows(full, L),
        attention=torch.ones(full.shape, dtype=torch.bool).split(L.tolist()),
        assistant=split_rows(assistant, L),
        # Unscored prompts get NaN ("no score") like full's prompt slice: TorchRL's keys.
        prompt_lp=split_rows(full_lp[p_pos], P),
        response_lp=split_rows(s.response_logprobs, R),
        full_lp=split_rows(full_lp, L),
        fresh_from=torch.from_numpy(s.end_version_from).unbind(0),
        token_versions=split_rows(s.token_versions, R),
        cached=torch.from_numpy(s.cached_tokens).unbind(0),
    )
    extras = SharedStrings()
    return [_sample_row(rows, s, i, keys, extras) for i in range(len(P))]


class _Columns(NamedTuple):
    """Every column of a batch, split into one tensor per sample."""

    prompt: Sequence[torch.Tensor]
    response: Sequence[torch.Tensor]
    full: Sequence[torch.Tensor]
    attention: Sequence[torch.Tensor]
    assistant: Sequence[torch.Tensor]
    prompt_lp: Sequence[torch.Tensor]
    response_lp: Sequence[torch.Tensor]
    full_lp: Sequence[torch.Tensor]
    fresh_from: Sequence[torch.Tensor]
    token_versions: Sequence[torch.Tensor]
    cached: Sequence[torch.Tensor]


def _sample_row(c: _Columns, s, i: int, keys: OutputKeys, extras: SharedStrings) -> TensorDict:
    """Sample ``i`` as a 0-dim TensorDict of TorchRL's tensorclasses (unpadded)."""
    Tokens, LogProbs, Masks, _, _ = tensorclasses()
    unpadded = MetaData(False)
    tokens = {"prompt": c.prompt[i], "response": c.response[i], "full": c.full[i]}
    log_probs = {"prompt": c.prompt_lp[i], "response": c.response_lp[i], "full": c.full_lp[i]}
    masks = {"all_attention_mask": c.attention[i], "all_assistant_mask": c.assistant[i]}
    extra = {
        VERSION: extras(s.weight_versions[i]),
        END_VERSION: extras(s.weight_versions_end[i]),
        END_FROM: c.fresh_from[i],
        TOKEN_VERSION: c.token_versions[i],
        CACHED_TOKENS: c.cached[i],
        FINISH_REASON: extras(s.finish_reasons[i]),
    }
    return row_td(
        {
            keys.tokens: row_tc(Tokens, {**tokens, "padded": unpadded}),
            keys.log_probs: row_tc(LogProbs, {**log_probs, "padded": unpadded}),
            keys.masks: row_tc(Masks, {**masks, "padded": unpadded}),
            keys.extra: row_td(extra),
        }
    )


def generated_padded(
    batch: RequestBatch,
    pad_token_id: int,
    keys: OutputKeys = DEFAULT_KEYS,
    with_prompt_logprobs: bool = True,
) -> TensorDict:
    """A ``(N,)`` TensorDict of dense tensors in TorchRL's padded layout (``pad_output=True``)."""
    Tokens, LogProbs, Masks, _, _ = tensorclasses()
    s = samples_of(batch, with_prompt_logprobs)
    P, R = s.prompt_lengths, s.response_lengths
    n = len(P)
    prompt = torch.from_numpy(pad_flat(s.prompts, P, pad_token_id, left=True))
    resp = torch.from_numpy(pad_flat(s.responses, R, pad_token_id, left=False))
    p_mask = torch.arange(prompt.shape[1]) >= torch.from_numpy(prompt.shape[1] - P)[:, None]
    r_mask = torch.arange(resp.shape[1]) < torch.from_numpy(R)[:, None]
    resp_lp = torch.from_numpy(pad_flat(s.response_logprobs, R, 0.0, left=False))
    if s.prompt_logprobs is not None:
        plp = pad_flat(s.prompt_logprobs, P, 0.0, left=True)
        plp[np.arange(n)[P > 0], (plp.shape[1] - P)[P > 0]] = 0.0  # first token: no score
        prompt_lp = torch.from_numpy(plp)
    else:  # unscored: NaN ("no score"), padding 0.0
        prompt_lp = torch.zeros(prompt.shape).masked_fill_(p_mask, float("nan"))
    batch_size = torch.Size([n])
    lp = {"prompt": prompt_lp, "response": resp_lp, "full": torch.cat([prompt_lp, resp_lp], -1)}
    padded = MetaData(True, batch_size=batch_size)

    def tc(cls, source):
        return cls._from_tensordict(
            TensorDict._new_unsafe(source={**source, "padded": padded}, batch_size=batch_size)
        )

    return TensorDict._new_unsafe(
        source={
            keys.tokens: tc(
                Tokens, {"prompt": prompt, "response": resp, "full": torch.cat([prompt, resp], -1)}
            ),
            keys.log_probs: tc(LogProbs, lp),
            keys.masks: tc(
                Masks,
                {
                    "all_attention_mask": torch.cat([p_mask, r_mask], -1),
                    "all_assistant_mask": torch.cat([torch.zeros_like(p_mask), r_mask], -1),
                },
            ),
            keys.extra: TensorDict._new_unsafe(
                source={
                    VERSION: strings(s.weight_versions),
                    END_VERSION: strings(s.weight_versions_end),
                    END_FROM: torch.from_numpy(s.end_version_from),
                    TOKEN_VERSION: torch.from_numpy(
                        pad_flat(s.token_versions, R, NO_TOKEN_VERSION, left=False)
                    ),
                    CACHED_TOKENS: torch.from_numpy(s.cached_tokens),
                    FINISH_REASON: strings(s.finish_reasons),
                },
                batch_size=batch_size,
            ),
        },
        batch_size=batch_size,
    )

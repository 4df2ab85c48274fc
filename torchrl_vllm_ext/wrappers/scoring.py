"""Scored sequences (``generate=False``) -> TorchRL's LLM layout.

Scoring asks the engine for prompt log-probs of whole sequences (one generated token,
ignored). ``log_probs.full`` holds ``log p(full[t] | full[:t])`` with the first token's
score 0.0 (TorchRL's convention); when the input carries ``tokens.prompt`` the fields
are split into ``prompt`` / ``response`` and the assistant mask marks the response,
unless the input brings its own assistant mask, which is passed through.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from tensordict import MetaData, TensorDict, TensorDictBase

from torchrl_vllm_ext.batches import RequestBatch
from torchrl_vllm_ext.wrappers import inputs
from torchrl_vllm_ext.wrappers.convert import first_token_zero
from torchrl_vllm_ext.wrappers.inputs import PolicyInput
from torchrl_vllm_ext.wrappers.layout import (
    DEFAULT_KEYS,
    OutputKeys,
    row_tc,
    row_td,
    split_rows,
    tensorclasses,
)
from torchrl_vllm_ext.wrappers.options import PolicyOptions
from torchrl_vllm_ext.wrappers.padding import cat, left_mask, left_pad, lengths_of, positions

_PROMPT, _ASSISTANT = "prompt", "all_assistant_mask"


def scored_logprobs(batch: RequestBatch) -> tuple[np.ndarray, np.ndarray]:
    """Concatenated prompt log-probs of scored sequences (first token 0.0) and their lengths."""
    missing = np.flatnonzero(~batch.has_prompt_logprobs)
    if missing.size:
        raise ValueError(
            f"requests {missing[:5].tolist()} came back without prompt log-probs; scoring "
            "needs prompt_logprobs=0 in the sampling parameters."
        )
    lengths = batch.prompt_lengths
    return first_token_zero(batch.prompt_logprobs.copy(), lengths), lengths


def scored_rows(
    seqs: Sequence[np.ndarray],
    batch: RequestBatch,
    prompt_lengths: np.ndarray | None,
    assistant: Sequence[torch.Tensor] | None,
    keys: OutputKeys = DEFAULT_KEYS,
) -> list[TensorDict]:
    """Unpadded scoring output: ``log_probs.full`` per sequence, split at the prompt if known.

    ``prompt_lengths`` (from the input's ``tokens.prompt``) adds ``log_probs.prompt`` /
    ``.response`` and ``tokens.prompt`` / ``.response``; ``assistant`` is the input's
    assistant mask, passed through (else derived from the prompt lengths when known).
    """
    Tokens, LogProbs, Masks, _, _ = tensorclasses()
    lp, L = scored_logprobs(batch)
    full = cat(seqs, np.int64)
    full_t, lp_t = split_rows(full, L), split_rows(lp, L)
    attn_t = torch.ones(full.shape, dtype=torch.bool).split(L.tolist())
    split = None
    if prompt_lengths is not None:
        P = np.minimum(prompt_lengths, L)
        split = (P, split_rows(positions(L) >= np.repeat(P, L), L))
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
            masks[_ASSISTANT] = split[1][i]
        if assistant is not None:
            masks[_ASSISTANT] = assistant[i]
        rows.append(
            row_td(
                {
                    keys.tokens: row_tc(Tokens, tokens),
                    keys.log_probs: row_tc(LogProbs, log_probs),
                    keys.masks: row_tc(Masks, masks),
                }
            )
        )
    return rows


def scored_padded(
    tokens: torch.Tensor,
    mask: torch.Tensor,
    batch: RequestBatch,
    prompt_width: int | None,
    assistant: torch.Tensor | None,
    keys: OutputKeys = DEFAULT_KEYS,
) -> TensorDict:
    """Padded scoring output: log-probs scattered back to the masked positions of ``tokens``.

    ``prompt_width`` (the width of the input's padded ``tokens.prompt``) splits every
    field at that column, the ``[lpad | prompt | response | rpad]`` layout.
    """
    Tokens, LogProbs, Masks, _, _ = tensorclasses()
    lp, _ = scored_logprobs(batch)
    full_lp = torch.zeros(tokens.shape, dtype=torch.float32)
    full_lp[mask] = torch.from_numpy(lp)
    size = tokens.shape[:1]
    padded = MetaData(True, batch_size=size)
    tok = {"full": tokens, "padded": padded}
    log_probs = {"full": full_lp, "padded": padded}
    masks = {"all_attention_mask": mask, "padded": padded}
    if prompt_width is not None:
        w = prompt_width
        tok.update(prompt=tokens[:, :w], response=tokens[:, w:])
        log_probs.update(prompt=full_lp[:, :w], response=full_lp[:, w:])
        asst = mask.clone()
        asst[:, :w] = False
        masks[_ASSISTANT] = asst
    if assistant is not None:
        masks[_ASSISTANT] = assistant

    def tc(cls, source):
        return cls._from_tensordict(TensorDict._new_unsafe(source=source, batch_size=size))

    return TensorDict._new_unsafe(
        source={
            keys.tokens: tc(Tokens, tok),
            keys.log_probs: tc(LogProbs, log_probs),
            keys.masks: tc(Masks, masks),
        },
        batch_size=size,
    )


def scored_output(
    td: TensorDictBase, read: PolicyInput, batch: RequestBatch, options: PolicyOptions
):
    """The scoring output for input ``td``, whose sequences (``read.token_ids``) were
    scored as ``batch``, laid out as ``options`` say.

    Reads from ``td`` what splits the output: the padded input and its mask (to scatter
    back into), ``tokens.prompt`` (where the response starts) and an assistant mask.
    ``read.assistant_masks`` (scored histories: one per sequence) replaces the latter.
    """
    seqs, assistant_masks, keys = read.token_ids, read.assistant_masks, options.keys
    full_key, mask_key = options.read_key, options.attention_mask_key
    pad_token_id, tokens_input = options.pad_token_id, options.input_mode == "tokens"
    prompt_key, asst_key = (keys.tokens, _PROMPT), (keys.masks, _ASSISTANT)
    if options.pad_output:
        full = dense(td, full_key) if tokens_input else None
        if full is None:  # ragged or non-token input: pad what was scored
            full = torch.from_numpy(left_pad(seqs, pad_token_id, np.int64))
            mask = left_mask(lengths_of(seqs))
        else:
            full = full.reshape(-1, full.shape[-1])
            mask = dense(td, mask_key)
            mask = torch.ones_like(full, dtype=torch.bool) if mask is None else mask
            mask = mask.reshape(full.shape).bool()
        prompt = dense(td, prompt_key)
        width = prompt.shape[-1] if prompt is not None else None
        assistant = dense(td, asst_key)
        if assistant_masks is not None:  # the sequences were padded here, on the left
            assistant = torch.from_numpy(left_pad([m.numpy() for m in assistant_masks], 0, bool))
        elif assistant is not None and assistant.numel() == full.numel():
            assistant = assistant.reshape(full.shape).bool()
        else:
            assistant = None
        return scored_padded(full, mask, batch, width, assistant, keys)
    lengths = None
    if prompt_key in td.keys(True):
        lengths = lengths_of(inputs.read_tokens(td, prompt_key, None, None))
    asst = assistant_masks
    if asst is None and asst_key in td.keys(True):
        asst = list(inputs.flatten_rows(td.get(asst_key, as_list=True)))
        if len(asst) != len(seqs) or any(len(a) != len(p) for a, p in zip(asst, seqs, strict=True)):
            asst = None  # a mask of a padded input does not align with the scored rows
    return scored_rows(seqs, batch, lengths, asst, keys)


def dense(td: TensorDictBase, key) -> torch.Tensor | None:
    """The dense tensor under ``key``; None when absent, ragged or nested."""
    if key not in td.keys(True):
        return None
    try:
        value = td.get(key)
    except RuntimeError:  # ragged rows
        return None
    if not isinstance(value, torch.Tensor) or value.is_nested:
        return None
    return value

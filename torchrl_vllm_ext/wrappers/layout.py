"""TorchRL's LLM output layout, in one place: the keys and the helpers that build rows.

The top-level keys (``tokens``, ``log_probs``, ``masks``, ``text``, ``history``) are
TorchRL's wrapper defaults (:class:`OutputKeys`); the sub-keys are the fields of
``torchrl.modules.llm.policies``' tensorclasses. Ours are additive, under
``OutputKeys.extra`` (``"vllm"``): :data:`VERSION`, :data:`END_VERSION`, :data:`END_FROM`,
:data:`TOKEN_VERSION`, :data:`CACHED_TOKENS`, :data:`FINISH_REASON`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

EXTRA = "vllm"
"""Our additive sub-TensorDict of the policy's output."""
VERSION = "weight_version"
"""The engine weight version a sample's request was admitted at (str)."""
END_VERSION = "weight_version_end"
"""The version when it finished (later only if a ``keep`` sync happened meanwhile)."""
END_FROM = "weight_version_end_from"
"""Index of the first response token generated with ``END_VERSION`` (int64)."""
TOKEN_VERSION = "token_weight_version"
"""The version that made each response token (int64, shaped like ``("tokens",
"response")``, padded or ragged): exact where pushes fell inside a sample."""
NO_TOKEN_VERSION = -1
"""``TOKEN_VERSION`` of padding, and of tokens whose version label is not an integer."""
CACHED_TOKENS = "cached_tokens"
"""Prompt tokens vLLM's prefix cache served (int64)."""
FINISH_REASON = "finish_reason"
"""vLLM's finish reason: "stop", "length", "abort" (str)."""
VERSION_KEY = (EXTRA, VERSION)
END_VERSION_KEY = (EXTRA, END_VERSION)
END_FROM_KEY = (EXTRA, END_FROM)
TOKEN_VERSION_KEY = (EXTRA, TOKEN_VERSION)
FINISH_REASON_KEY = (EXTRA, FINISH_REASON)

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
    extra: str = EXTRA
    """Our additive sub-TensorDict: ``weight_version``, ``weight_version_end``,
    ``weight_version_end_from``, ``token_weight_version``, ``cached_tokens``,
    ``finish_reason``."""


DEFAULT_KEYS = OutputKeys()


def split_rows(values: np.ndarray, lengths: np.ndarray) -> tuple[torch.Tensor, ...]:
    """One 1-D tensor per row of a flat array (views, no copy)."""
    return torch.from_numpy(values).split(lengths.tolist())


def row_td(source: dict) -> TensorDict:
    """A 0-dim TensorDict over ``source`` (one sample's fresh 1-D views)."""
    # NOTE: built with the unchecked constructor: the values are fresh 1-D views we made
    # ourselves, and the checked one costs ~10x more per sample on the hot path.
    return TensorDict._new_unsafe(source=source, batch_size=_EMPTY)


def row_tc(cls, source: dict):
    """A 0-dim tensorclass ``cls`` (``Tokens``, ``LogProbs``, ...) over ``source``."""
    return cls._from_tensordict(row_td(source))


class SharedStrings:
    """One ``NonTensorData`` per distinct string, shared by the rows that carry it."""

    def __init__(self):
        self._cache: dict = {}

    def __call__(self, value):
        out = self._cache.get(value)
        if out is None:
            out = self._cache[value] = NonTensorData(value)
        return out


def tensorclasses():
    """TorchRL's LLM output tensorclasses: Tokens, LogProbs, Masks, Text, ChatHistory."""
    from torchrl.modules.llm.policies import ChatHistory, LogProbs, Masks, Text, Tokens

    return Tokens, LogProbs, Masks, Text, ChatHistory


def strings(values: Sequence[str | None]) -> NonTensorData | NonTensorStack:
    """``values`` as non-tensor data of batch ``(len(values),)``; read with ``.tolist()``.

    One shared ``NonTensorData`` when all values are equal (the usual case for versions
    and finish reasons: a stack costs a Python object per element).
    """
    first = values[0] if len(values) else None
    if all(v == first for v in values):
        return NonTensorData(first, batch_size=torch.Size([len(values)]))
    return NonTensorStack.from_list(list(values))


def texts(values: Sequence[str]) -> NonTensorStack:
    """One string per batch element; reads back as a list even for a batch of one
    (a shared ``NonTensorData`` would read back as one ``str``)."""
    return NonTensorStack.from_list(list(values))


__all__ = [
    "CACHED_TOKENS",
    "DEFAULT_KEYS",
    "END_FROM",
    "END_FROM_KEY",
    "END_VERSION",
    "END_VERSION_KEY",
    "EXTRA",
    "FINISH_REASON",
    "FINISH_REASON_KEY",
    "NO_TOKEN_VERSION",
    "TOKEN_VERSION",
    "TOKEN_VERSION_KEY",
    "VERSION",
    "VERSION_KEY",
    "OutputKeys",
    "SharedStrings",
    "row_tc",
    "row_td",
    "split_rows",
    "strings",
    "tensorclasses",
    "texts",
]

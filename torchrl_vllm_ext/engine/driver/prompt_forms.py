"""The prompt forms ``vllm.LLM.generate`` takes, turned into token ids for the service.

``generate(prompts)`` accepts what vLLM's offline ``LLM`` accepts: one prompt or a list,
each a string, a list of token ids, a ``TokensPrompt`` (``{"prompt_token_ids": [...]}``)
or a ``TextPrompt`` (``{"prompt": "..."}``); token arrays and 1-D tensors too. Text is
tokenized here, as vLLM's renderer does (``add_special_tokens=True`` unless
``tokenization_kwargs`` say otherwise), so the replicas receive token ids only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from torchrl_vllm_ext.errors import InvalidRequestError

_PROMPT_KEYS = ("prompt", "prompt_token_ids")


@dataclass(frozen=True)
class ParsedPrompts:
    """A batch in input order: each prompt's token ids, and its text when it was text."""

    token_ids: list
    """Per prompt: a sequence of token ids (list, array or 1-D tensor)."""
    texts: list[str | None]
    """Per prompt: the text it was given as (``RequestOutput.prompt``), else None."""


def _is_token_list(x: Any) -> bool:
    """A non-empty list or tuple of integers: one prompt of token ids (vLLM's rule)."""
    return (
        isinstance(x, list | tuple)
        and len(x) > 0
        and all(isinstance(t, int | np.integer) and not isinstance(t, bool) for t in x)
    )


def _is_single(prompts: Any) -> bool:
    if isinstance(prompts, str | Mapping) or _is_token_list(prompts):
        return True
    return getattr(prompts, "ndim", None) == 1  # a 1-D array or tensor of ids


def parse_prompts(
    prompts: Any,
    encode: Callable[[list[str]], list[list[int]]],
) -> ParsedPrompts:
    """Token ids of every prompt in ``prompts`` (one prompt or a list of them).

    ``encode`` tokenizes the text prompts (called once, with all of them; e.g.
    :func:`encode_texts` with a tokenizer).

    Examples:
        >>> enc = lambda texts: [[len(t)] for t in texts]
        >>> p = parse_prompts(["ab", [1, 2], {"prompt_token_ids": [3]}, {"prompt": "xyz"}], enc)
        >>> [list(t) for t in p.token_ids], p.texts
        ([[2], [1, 2], [3], [3]], ['ab', None, None, 'xyz'])
        >>> [list(t) for t in parse_prompts([5, 6, 7], enc).token_ids]  # one prompt
        [[5, 6, 7]]
    """
    if getattr(prompts, "ndim", 1) != 1:
        raise InvalidRequestError(
            f"prompts is a {prompts.ndim}-D array; padded batches are ambiguous here. Pass a "
            "list of 1-D token-id sequences (strip the padding), or use VLLMPolicy with a mask."
        )
    if _is_single(prompts):
        prompts = [prompts]
    elif isinstance(prompts, bytes) or not isinstance(prompts, Sequence):
        raise InvalidRequestError(
            "prompts must be a string, a list of token ids, a TokensPrompt / TextPrompt dict, "
            f"or a list of those; got {type(prompts).__name__}."
        )
    token_ids: list = []
    texts: list[str | None] = []
    for i, p in enumerate(prompts):
        if isinstance(p, Mapping):
            extra = sorted(set(p) - set(_PROMPT_KEYS))
            if extra or len(set(p) & set(_PROMPT_KEYS)) != 1:
                raise InvalidRequestError(
                    f"prompt {i} is a dict with keys {sorted(p)}; pass a TokensPrompt "
                    "({'prompt_token_ids': [...]}) or a TextPrompt ({'prompt': '...'}) "
                    + (
                        f"and nothing else ({extra} are not served)."
                        if extra
                        else "with one of them."
                    )
                )
            p = p.get("prompt_token_ids", p.get("prompt"))
        if isinstance(p, str):
            token_ids.append(None)
            texts.append(p)
        else:
            token_ids.append(p)
            texts.append(None)
    text_rows = [i for i, t in enumerate(texts) if t is not None]
    if text_rows:
        for i, ids in zip(text_rows, encode([texts[i] for i in text_rows]), strict=True):
            token_ids[i] = ids
    return ParsedPrompts(token_ids, texts)


def encode_texts(
    tokenizer, texts: list[str], tokenization_kwargs: Mapping[str, Any] | None = None
) -> list[list[int]]:
    """The tokenizer's ids of ``texts``, special tokens added as vLLM's renderer adds
    them unless ``tokenization_kwargs`` say otherwise."""
    kwargs = {"add_special_tokens": True, **(tokenization_kwargs or {})}
    return tokenizer(texts, **kwargs)["input_ids"]


def one_of(prompts, prompt_token_ids):
    """The prompts of a ``generate`` call, given as ``prompts`` or TorchRL's
    ``prompt_token_ids=``, once."""
    if (prompts is None) == (prompt_token_ids is None):
        raise InvalidRequestError(
            "generate() takes the prompts once: pass prompts (any vLLM form) or "
            "prompt_token_ids=, not both and not neither."
        )
    return prompts if prompts is not None else prompt_token_ids


__all__ = ["ParsedPrompts", "encode_texts", "one_of", "parse_prompts"]

"""Checks run on the driver before a batch is sent anywhere.

A rejected batch enqueues nothing, so the replicas keep serving undisturbed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from torchrl_vllm_ext._compat import (
    sampling_param_fields,
    vllm_engine_api,
    vllm_validation_errors,
)
from torchrl_vllm_ext.errors import InvalidRequestError


def normalize_prompts(prompt_token_ids: Any) -> list[np.ndarray]:
    """Turn a list of token-id sequences (lists, arrays or 1-D tensors) into int64 arrays."""
    if isinstance(prompt_token_ids, np.ndarray | str) or not isinstance(prompt_token_ids, Sequence):
        if hasattr(prompt_token_ids, "tolist") and getattr(prompt_token_ids, "ndim", 0) == 2:
            raise InvalidRequestError(
                "prompt_token_ids is a 2-D array; padded batches are ambiguous here. Pass a list "
                "of 1-D token-id sequences (strip the padding), or use VLLMPolicy with a mask."
            )
        raise InvalidRequestError(
            f"prompt_token_ids must be a list of token-id sequences, got {type(prompt_token_ids).__name__}."
        )
    out = []
    for i, p in enumerate(prompt_token_ids):
        if isinstance(p, str):
            raise InvalidRequestError(
                f"prompt {i} is a string ({p[:30]!r}); the service takes token ids. "
                "Tokenize first, or use VLLMPolicy with text input."
            )
        if isinstance(p, np.ndarray):
            arr = p
        elif hasattr(p, "numpy") and hasattr(p, "dim"):  # a torch tensor: share its memory
            arr = p.detach().cpu().numpy()
        else:
            arr = np.asarray(p)
        if arr.ndim != 1:
            raise InvalidRequestError(
                f"prompt {i} has shape {arr.shape}; each prompt must be a 1-D sequence of token ids."
            )
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise InvalidRequestError(
                f"prompt {i} has dtype {arr.dtype}; token ids must be integers."
            )
        out.append(arr.astype(np.int64, copy=False))
    return out


def out_of_vocabulary(prompts: Sequence[np.ndarray], max_token_id: int) -> tuple[int, int] | None:
    """``(row, id)`` of the first token id outside ``[0, max_token_id]``, or None; one
    vectorised pass over the whole batch (the policy and the service both ask).

    Examples:
        >>> out_of_vocabulary([np.array([1, 2]), np.array([3, 700, 4])], 511)
        (1, 700)
    """
    flat = np.concatenate(prompts)
    bad = (flat < 0) | (flat > max_token_id)
    if not bad.any():
        return None
    pos = int(np.argmax(bad))
    ends = np.cumsum([p.size for p in prompts])
    return int(np.searchsorted(ends, pos, side="right")), int(flat[pos])


def check_prompts(prompts: Sequence[np.ndarray], max_token_id: int, max_model_len: int) -> None:
    """Reject empty prompts, out-of-vocabulary ids and prompts the engine cannot extend."""
    if not prompts:
        raise InvalidRequestError("the batch is empty; pass at least one prompt.")
    lengths = np.fromiter((p.size for p in prompts), dtype=np.int64, count=len(prompts))
    if (lengths == 0).any():
        i = int(np.argmin(lengths))
        raise InvalidRequestError(
            f"prompt {i} is empty; every prompt needs at least one token (e.g. a BOS token)."
        )
    bad = out_of_vocabulary(prompts, max_token_id)
    if bad is not None:
        i, token = bad
        raise InvalidRequestError(
            f"prompt {i} contains token id {token}, outside the vocabulary [0, {max_token_id}]; "
            "check the tokenizer matches the served model."
        )
    if (lengths >= max_model_len).any():
        i = int(np.argmax(lengths >= max_model_len))
        raise InvalidRequestError(
            f"prompt {i} has {lengths[i]} tokens but max_model_len is {max_model_len}, which must "
            "exceed the prompt by at least one generated token; truncate the prompt or launch "
            "with a larger max_model_len."
        )


def make_sampling_params(params: Any, *, want_logprobs: bool = True):
    """Build vLLM ``SamplingParams`` from a dict or copy given ones, with our output options.

    Sampled-token log-probs are always returned (``logprobs=0``) in vLLM's flat layout,
    and only the final output of each request is streamed back.
    """
    vllm = vllm_engine_api()
    SamplingParams = vllm.SamplingParams
    if params is None:
        params = {}
    if isinstance(params, Mapping):
        max_tokens = params.get("max_tokens", 16)
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            raise InvalidRequestError(
                f"max_tokens={max_tokens!r} is invalid; it must be a positive integer."
            )
        n = params.get("n", 1)
        if not isinstance(n, int) or n < 1:
            raise InvalidRequestError(f"n={n!r} is invalid; it must be a positive integer.")
        try:
            sp = SamplingParams(**params)
        except (TypeError, *vllm_validation_errors()) as e:
            # vLLM's own validation error is not a ValueError: catch it by name too.
            raise InvalidRequestError(
                f"invalid sampling parameters {dict(params)}: {e}; {_sampling_fix(params)}"
            ) from e
    elif isinstance(params, SamplingParams):
        sp = params.clone()
    else:
        raise InvalidRequestError(
            f"sampling_params must be a vllm.SamplingParams or a dict, got {type(params).__name__}."
        )
    if want_logprobs and sp.logprobs is None:
        sp.logprobs = 0
    sp.flat_logprobs = True
    sp.output_kind = vllm.RequestOutputKind.FINAL_ONLY
    return sp


def with_seed(params, seed: int):
    """A copy of vLLM ``SamplingParams`` ``params`` with its own ``seed``."""
    sp = params.clone()
    sp.seed = int(seed)
    return sp


def _sampling_fix(params: Mapping[str, Any]) -> str:
    """How to fix a rejected sampling dict: the likely intended field, else the valid range."""
    import difflib

    fields = sampling_param_fields()
    for key in params:
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            return f"{hint}{key!r} is not a vllm.SamplingParams field; use one of {fields}."
    return "pass values vllm.SamplingParams accepts (its docstring gives each field's range)."


def expected_kv_tokens(
    prompts: Sequence[np.ndarray], params: Sequence[Any], max_model_len: int
) -> list[int]:
    """Tokens each request will hold in the KV cache at most (for KV-aware routing)."""
    out = []
    for p, sp in zip(prompts, params, strict=True):
        new = sp.max_tokens if sp.max_tokens is not None else max_model_len - p.size
        out.append(int(p.size + sp.n * new))
    return out

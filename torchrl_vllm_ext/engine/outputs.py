"""Rebuild vLLM ``RequestOutput`` objects on the driver from the replicas' plain data."""

from __future__ import annotations

import numpy as np

from torchrl_vllm_ext._compat import vllm_output_types
from torchrl_vllm_ext.messages import RequestData


def _flat(token_ids: np.ndarray, logprobs: np.ndarray, skip_first: bool = False):
    """vLLM's ``FlatLogprobs`` with one entry per position: the chosen token and its log-prob.

    With ``skip_first`` (prompt log-probs) position 0 has no entry, as in vLLM.
    """
    _, _, FlatLogprobs, _ = vllm_output_types()
    first = 1 if skip_first and len(token_ids) else 0
    n = len(token_ids) - first
    bounds = list(range(n + 1))
    return FlatLogprobs(
        start_indices=[0] * first + bounds[:-1],
        end_indices=[0] * first + bounds[1:],
        token_ids=token_ids[first:].tolist(),
        logprobs=logprobs[first:].tolist(),
        ranks=[None] * n,
        decoded_tokens=[None] * n,
    )


def to_request_output(data: RequestData, request_id: str):
    """A finished vLLM ``RequestOutput`` carrying the same tokens and log-probs."""
    RequestOutput, CompletionOutput, _, _ = vllm_output_types()
    completions = []
    for index, s in enumerate(data.samples):
        completions.append(
            CompletionOutput(
                index=index,
                text=s.text,
                token_ids=s.token_ids.tolist(),
                cumulative_logprob=float(s.logprobs.sum()) if s.logprobs is not None else None,
                logprobs=_flat(s.token_ids, s.logprobs) if s.logprobs is not None else None,
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
            )
        )
    prompt_lp = (
        _flat(data.prompt_token_ids, data.prompt_logprobs, skip_first=True)
        if data.prompt_logprobs is not None
        else None
    )
    return RequestOutput(
        request_id=request_id,
        prompt=None,
        prompt_token_ids=data.prompt_token_ids.tolist(),
        prompt_logprobs=prompt_lp,
        outputs=completions,
        finished=True,
    )

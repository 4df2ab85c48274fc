"""vLLM outputs <-> the package's plain data, both directions in one place.

- Replica side: :func:`pack_outputs` turns a batch's final vLLM ``RequestOutput``s into
  one :class:`~torchrl_vllm_ext.batches.RequestBatch` of flat arrays.
- Driver side: :func:`to_request_output` rebuilds a vLLM ``RequestOutput`` from a
  :class:`~torchrl_vllm_ext.messages.RequestData`, for callers of ``service.generate``.
"""

from __future__ import annotations

import numpy as np

from torchrl_vllm_ext._compat import vllm_output_types
from torchrl_vllm_ext.batches import EVERY_SAMPLE, RequestBatch
from torchrl_vllm_ext.messages import RequestData, Switch


def _chosen_logprobs(flat, length: int) -> np.ndarray:
    """Log-prob of the chosen token at each position of a vLLM ``FlatLogprobs``.

    vLLM puts the chosen (sampled or prompt) token first among a position's entries;
    positions without entries (the first prompt token) get NaN.
    """
    out = np.full(length, np.nan, dtype=np.float32)
    if length == 0 or flat is None or not flat.logprobs:
        return out
    starts = np.asarray(flat.start_indices, dtype=np.int64)
    ends = np.asarray(flat.end_indices, dtype=np.int64)
    values = np.asarray(flat.logprobs, dtype=np.float32)
    has = ends > starts
    out[: len(starts)][has] = values[starts[has]]
    return out


def prompt_logprobs_of(output) -> list[float]:
    """Log-probs a vLLM ``RequestOutput`` (asked for ``prompt_logprobs=0``) gives each
    prompt token after the first."""
    return _chosen_logprobs(output.prompt_logprobs, len(output.prompt_token_ids))[1:].tolist()


def _cat(arrays: list[np.ndarray], dtype) -> np.ndarray:
    return np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.empty(0, dtype)


def sample_switches(
    switches: dict[tuple[str, int], list[Switch]], request_id: str, index: int, length: int
) -> list[Switch]:
    """The switches that made tokens of one finished sample of ``length`` tokens, oldest
    first: its request's (recorded before it started) then its own.

    A switch at or past its length made none: the sample had finished when the weights
    changed (vLLM reports a finished sample of a running request by its final count).

    Examples:
        >>> recorded = {("r", EVERY_SAMPLE): [("1", 0)], ("r", 0): [("2", 3), ("3", 5)]}
        >>> sample_switches(recorded, "r", 0, 5), sample_switches(recorded, "r", 1, 4)
        ([('1', 0), ('2', 3)], [('1', 0)])
    """
    mine = switches.get((request_id, EVERY_SAMPLE), []) + switches.get((request_id, index), [])
    return [(version, tokens) for version, tokens in mine if tokens < length]


def pack_outputs(
    outputs: list,
    replica_id: int,
    start: str,
    end: str,
    switches: dict[tuple[str, int], list[Switch]] | None = None,
) -> RequestBatch:
    """Finished vLLM ``RequestOutput``s of one replica call -> one :class:`RequestBatch`.

    ``start`` / ``end``: the replica's weight version when the batch was admitted and
    when it finished. ``switches``: ``(request id, sample index or EVERY_SAMPLE)`` -> the
    weight switches while it was in flight, ``(version, tokens it had)``, oldest first
    (:meth:`~torchrl_vllm_ext.engine.replica.served_weights.ServedWeights.take_switches`).
    """
    switches = switches or {}
    prompts, prompt_lps, has_prompt_lp, per_request, cached = [], [], [], [], []
    ids, lps, has_lp, finish, stop, texts, made_by = [], [], [], [], [], [], []
    for out in outputs:
        prompt = np.asarray(out.prompt_token_ids, dtype=np.int64)
        prompts.append(prompt)
        has_prompt_lp.append(out.prompt_logprobs is not None)
        prompt_lps.append(_chosen_logprobs(out.prompt_logprobs, len(prompt)))
        per_request.append(len(out.outputs))
        cached.append(getattr(out, "num_cached_tokens", None) or 0)
        for comp in out.outputs:
            tokens = np.asarray(comp.token_ids, dtype=np.int64)
            ids.append(tokens)
            has_lp.append(comp.logprobs is not None)
            lps.append(_chosen_logprobs(comp.logprobs, len(tokens)))
            finish.append(comp.finish_reason)
            stop.append(comp.stop_reason)
            texts.append(comp.text or "")
            made_by.append(
                sample_switches(switches, out.request_id, comp.index, len(tokens))
                if switches
                else []
            )
    r = len(outputs)
    return RequestBatch(
        prompt_token_ids=_cat(prompts, np.int64),
        prompt_lengths=np.array([len(p) for p in prompts], dtype=np.int64),
        prompt_logprobs=_cat(prompt_lps, np.float32),
        has_prompt_logprobs=np.array(has_prompt_lp, dtype=bool),
        samples_per_request=np.array(per_request, dtype=np.int64),
        token_ids=_cat(ids, np.int64),
        sample_lengths=np.array([len(t) for t in ids], dtype=np.int64),
        logprobs=_cat(lps, np.float32),
        has_logprobs=np.array(has_lp, dtype=bool),
        finish_reasons=finish,
        stop_reasons=stop,
        texts=texts,
        replica_ids=np.full(r, replica_id, dtype=np.int64),
        versions_start=[start] * r,
        versions_end=[end] * r,
        switch_counts=np.array([len(m) for m in made_by], dtype=np.int64),
        switch_versions=[version for m in made_by for version, _ in m],
        switch_tokens=np.array([tokens for m in made_by for _, tokens in m], dtype=np.int64),
        cached_tokens=np.array(cached, dtype=np.int64),
    )


def _positions(token_ids: np.ndarray, logprobs: np.ndarray, flat: bool, skip_first: bool = False):
    """Per position, the chosen token and its log-prob, in vLLM's form: ``FlatLogprobs``
    (``flat``) or a list of ``{token id: Logprob}`` (vLLM's default); the top-k
    alternatives vLLM may add are not kept by the replicas.

    With ``skip_first`` (prompt log-probs) position 0 has no entry (None), as in vLLM.
    """
    types = vllm_output_types()
    first = 1 if skip_first and len(token_ids) else 0
    ids, lps = token_ids[first:].tolist(), logprobs[first:].tolist()
    if not flat:
        return [None] * first + [
            {t: types.Logprob(logprob=lp, rank=None, decoded_token=None)}
            for t, lp in zip(ids, lps, strict=True)
        ]
    n = len(ids)
    bounds = list(range(n + 1))
    return types.FlatLogprobs(
        start_indices=[0] * first + bounds[:-1],
        end_indices=[0] * first + bounds[1:],
        token_ids=ids,
        logprobs=lps,
        ranks=[None] * n,
        decoded_tokens=[None] * n,
    )


def to_request_output(data: RequestData, request_id: str, flat_logprobs: bool = False):
    """A finished vLLM ``RequestOutput`` carrying the same tokens and log-probs, these in
    vLLM's default form (a list of dicts) or, with ``flat_logprobs``, a ``FlatLogprobs``."""
    vllm = vllm_output_types()
    completions = [
        vllm.CompletionOutput(
            index=index,
            text=s.text,
            token_ids=s.token_ids.tolist(),
            cumulative_logprob=float(s.logprobs.sum()) if s.logprobs is not None else None,
            logprobs=_positions(s.token_ids, s.logprobs, flat_logprobs)
            if s.logprobs is not None
            else None,
            finish_reason=s.finish_reason,
            stop_reason=s.stop_reason,
        )
        for index, s in enumerate(data.samples)
    ]
    prompt_lp = (
        _positions(data.prompt_token_ids, data.prompt_logprobs, flat_logprobs, skip_first=True)
        if data.prompt_logprobs is not None
        else None
    )
    return vllm.RequestOutput(
        request_id=request_id,
        prompt=None,
        prompt_token_ids=data.prompt_token_ids.tolist(),
        prompt_logprobs=prompt_lp,
        outputs=completions,
        finished=True,
    )

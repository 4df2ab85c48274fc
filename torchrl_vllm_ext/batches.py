"""Batches as columns: the form requests (:class:`PromptBatch`) and results
(:class:`RequestBatch`) cross processes in.

Ray serialises every numpy array as its own out-of-band buffer, so a batch of 64
requests as per-request objects costs ~130 buffers; as a few flat arrays, a handful.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from torchrl_vllm_ext.messages import RequestData, SampleData, Switch

EVERY_SAMPLE = -1
"""The sample index of a switch that applies to every sample of a request: one held,
not started yet, when the weights changed (its samples had made no token)."""


@dataclass
class PromptBatch:
    """A replica's share of a batch: prompts in flat arrays, as results come back.

    It pickles as a few ``bytes`` (in band): Ray would give each numpy array its own
    out-of-band buffer, which costs more than the bytes for a share of a few dozen
    prompts.

    Examples:
        >>> import pickle
        >>> batch = PromptBatch.of([np.array([1, 2, 3]), np.array([4])], "b0", [5, 9])
        >>> batch = pickle.loads(pickle.dumps(batch, protocol=5))
        >>> batch.token_lists(), batch.request_ids()
        ([[1, 2, 3], [4]], ['b0-5', 'b0-9'])
    """

    token_ids: np.ndarray
    """Every prompt's ids, concatenated (int64)."""
    lengths: np.ndarray
    """Tokens per prompt (R,)."""
    id_prefix: str
    """Request ids are ``f"{id_prefix}-{index}"``."""
    indices: np.ndarray
    """Each prompt's index in the caller's batch (R,)."""
    seeds: np.ndarray | None = None
    """A sampling seed per prompt (R,), or None: the sampling parameters' own."""

    @classmethod
    def of(cls, prompts, id_prefix: str, indices, seeds=None) -> PromptBatch:
        """Pack 1-D int arrays (the prompts) and their indices."""
        return cls(
            token_ids=np.concatenate(prompts).astype(np.int64, copy=False),
            lengths=np.array([len(p) for p in prompts], dtype=np.int64),
            id_prefix=id_prefix,
            indices=np.asarray(indices, dtype=np.int64),
            seeds=None if seeds is None else np.asarray(seeds, dtype=np.int64),
        )

    def __len__(self) -> int:
        return len(self.lengths)

    def token_lists(self) -> list[list[int]]:
        """Each prompt's ids as a list of ints (what vLLM's prompt dicts take)."""
        flat, ends = self.token_ids.tolist(), np.cumsum(self.lengths).tolist()
        return [flat[start:end] for start, end in zip([0, *ends[:-1]], ends, strict=True)]

    def __reduce__(self):
        seeds = None if self.seeds is None else self.seeds.tobytes()
        return (
            _prompt_batch_from_bytes,
            (
                self.token_ids.tobytes(),
                self.lengths.tobytes(),
                self.id_prefix,
                self.indices.tobytes(),
                seeds,
            ),
        )

    def request_ids(self) -> list[str]:
        return [f"{self.id_prefix}-{i}" for i in self.indices.tolist()]


def _prompt_batch_from_bytes(tokens, lengths, id_prefix, indices, seeds) -> PromptBatch:
    def ints(raw: bytes) -> np.ndarray:
        return np.frombuffer(raw, dtype=np.int64)

    return PromptBatch(
        ints(tokens),
        ints(lengths),
        id_prefix,
        ints(indices),
        None if seeds is None else ints(seeds),
    )


@dataclass
class RequestBatch:
    """Finished requests, field by field in flat arrays: the one form results travel in.

    A replica returns one; the service merges the replicas' batches into one in input
    order, which goes straight into the TensorDict conversion
    (:mod:`torchrl_vllm_ext.wrappers.convert`). Ray serialises every numpy array as its
    own out-of-band buffer: 64 requests as :class:`RequestData` are ~130 buffers to
    deserialise on the driver, these a few flat arrays.
    :meth:`unpack` gives :class:`RequestData` views for callers that want one object
    per request.

    Examples:
        >>> import numpy as np
        >>> sample = SampleData(np.array([7, 8]), None, "length", None, "")
        >>> req = RequestData(np.array([1, 2, 3]), None, [sample], 0, "1", "1")
        >>> batch = RequestBatch.from_requests([req, req])
        >>> batch.token_ids.tolist(), batch.prompt_lengths.tolist()
        ([7, 8, 7, 8], [3, 3])
        >>> RequestBatch.merge([([1], batch.take(np.array([0]))), ([0], batch.take(np.array([1])))], 2).unpack()[0].prompt_token_ids.tolist()
        [1, 2, 3]
    """

    prompt_token_ids: np.ndarray
    """Every prompt's ids, concatenated (int64)."""
    prompt_lengths: np.ndarray
    """Tokens per prompt (R,)."""
    prompt_logprobs: np.ndarray
    """Prompt log-probs, concatenated like the ids (float32; NaN where not asked, and at
    each prompt's first token)."""
    has_prompt_logprobs: np.ndarray
    """Whether request r asked for prompt log-probs (bool, R)."""
    samples_per_request: np.ndarray
    """Samples of each request (R,)."""
    token_ids: np.ndarray
    """Every sample's ids, concatenated in request then sample order (int64)."""
    sample_lengths: np.ndarray
    """Tokens per sample (S,)."""
    logprobs: np.ndarray
    """Sampled-token log-probs, concatenated like the ids (float32; NaN where not asked)."""
    has_logprobs: np.ndarray
    """Whether sample s carries log-probs (bool, S)."""
    finish_reasons: list
    """vLLM's finish reason of each sample (S)."""
    stop_reasons: list
    """The stop string or token that ended each sample, if any (S)."""
    texts: list[str]
    """Detokenised completion of each sample ("" when detokenisation is off) (S)."""
    replica_ids: np.ndarray
    """Replica that served each request (R,)."""
    versions_start: list[str]
    """Weight version of the replica when each request was admitted (R)."""
    versions_end: list[str]
    """Weight version when it finished (differs only if a ``keep`` pause spanned a sync) (R)."""
    switch_counts: np.ndarray
    """Weight switches inside each sample (S,): pushes that landed while it generated and
    made some of its tokens (0: every token is its request's ``versions_start``)."""
    switch_versions: list[str]
    """Each switch's new version label, the samples' switches one after the other
    (``switch_counts.sum()``)."""
    switch_tokens: np.ndarray
    """Tokens the sample had made before each switch, like ``switch_versions`` (int64;
    increasing within a sample, each below its length)."""
    cached_tokens: np.ndarray
    """Prompt tokens of each request served from vLLM's prefix cache (R,)."""

    def __len__(self) -> int:
        return len(self.prompt_lengths)

    @property
    def request_of_sample(self) -> np.ndarray:
        """Index of the request each sample belongs to (S,)."""
        return np.repeat(np.arange(len(self)), self.samples_per_request)

    def sample_switches(self) -> list[list[Switch]]:
        """Each sample's switches, oldest first: ``(version, tokens it had before)``."""
        ends = np.cumsum(self.switch_counts).tolist()
        tokens = self.switch_tokens.tolist()
        return [
            list(zip(self.switch_versions[end - n : end], tokens[end - n : end], strict=True))
            for n, end in zip(self.switch_counts.tolist(), ends, strict=True)
        ]

    @property
    def end_version_from(self) -> np.ndarray:
        """Index of each sample's first token made with its request's ``versions_end``
        (S,): its last switch when that switch was to the end version; its length when
        the request's versions differ but the end version made no token of it (it
        finished first); 0 when they are equal (every token is ``end``'s)."""
        pairs = zip(self.versions_start, self.versions_end, strict=True)
        crossed = np.array([start != end for start, end in pairs], dtype=bool)
        req = self.request_of_sample
        out = np.where(crossed[req], self.sample_lengths, 0).astype(np.int64)
        last = np.cumsum(self.switch_counts) - 1
        for s in np.flatnonzero(self.switch_counts).tolist():  # only samples pushes fell in
            r = int(req[s])
            if crossed[r] and self.switch_versions[last[s]] == self.versions_end[r]:
                out[s] = self.switch_tokens[last[s]]
        return out

    def token_versions(self, missing: int = -1) -> np.ndarray:
        """The version that made each generated token, like ``token_ids`` (int64):
        the request's start version, then each switch's from its token on; ``missing``
        where a label is not an integer.

        Examples:
            >>> sample = SampleData(np.arange(5), None, "length", None, "", [("3", 1), ("4", 3)])
            >>> req = RequestData(np.array([1]), None, [sample], 0, "2", "4")
            >>> batch = RequestBatch.from_requests([req])
            >>> batch.token_versions().tolist(), batch.end_version_from.tolist()
            ([2, 3, 3, 4, 4], [3])
        """
        starts = np.array([_label(v, missing) for v in self.versions_start], dtype=np.int64)
        out = np.repeat(starts[self.request_of_sample], self.sample_lengths)
        first_token = np.cumsum(self.sample_lengths) - self.sample_lengths
        owner = np.repeat(np.arange(len(self.switch_counts)), self.switch_counts)
        for s, version, tokens in zip(
            owner.tolist(), self.switch_versions, self.switch_tokens.tolist(), strict=True
        ):
            begin = int(first_token[s]) + tokens
            out[begin : int(first_token[s] + self.sample_lengths[s])] = _label(version, missing)
        return out

    @classmethod
    def from_requests(cls, requests: list[RequestData]) -> RequestBatch:
        """Pack :class:`RequestData` (e.g. built by hand in a test) into flat arrays."""
        samples = [s for r in requests for s in r.samples]

        def cat(arrays, dtype):
            return (
                np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.empty(0, dtype)
            )

        def values_or_nan(arrays, lengths):
            return [
                a if a is not None else np.full(n, np.nan, np.float32)
                for a, n in zip(arrays, lengths, strict=True)
            ]

        prompt_lengths = np.array([r.prompt_token_ids.size for r in requests], dtype=np.int64)
        sample_lengths = np.array([s.token_ids.size for s in samples], dtype=np.int64)
        return cls(
            prompt_token_ids=cat([r.prompt_token_ids for r in requests], np.int64),
            prompt_lengths=prompt_lengths,
            prompt_logprobs=cat(
                values_or_nan([r.prompt_logprobs for r in requests], prompt_lengths), np.float32
            ),
            has_prompt_logprobs=np.array(
                [r.prompt_logprobs is not None for r in requests], dtype=bool
            ),
            samples_per_request=np.array([len(r.samples) for r in requests], dtype=np.int64),
            token_ids=cat([s.token_ids for s in samples], np.int64),
            sample_lengths=sample_lengths,
            logprobs=cat(values_or_nan([s.logprobs for s in samples], sample_lengths), np.float32),
            has_logprobs=np.array([s.logprobs is not None for s in samples], dtype=bool),
            finish_reasons=[s.finish_reason for s in samples],
            stop_reasons=[s.stop_reason for s in samples],
            texts=[s.text for s in samples],
            replica_ids=np.array([r.replica_id for r in requests], dtype=np.int64),
            versions_start=[r.weight_version_start for r in requests],
            versions_end=[r.weight_version_end for r in requests],
            switch_counts=np.array([len(s.switches) for s in samples], dtype=np.int64),
            switch_versions=[str(v) for s in samples for v, _ in s.switches],
            switch_tokens=np.array([t for s in samples for _, t in s.switches], dtype=np.int64),
            cached_tokens=np.array([r.cached_tokens for r in requests], dtype=np.int64),
        )

    @classmethod
    def merge(cls, parts: list[tuple[list[int], RequestBatch]], n: int) -> RequestBatch:
        """One batch of ``n`` requests from ``(input indices, batch)`` parts, in input order."""
        if len(parts) == 1 and parts[0][0] == list(range(n)):
            return parts[0][1]
        whole = cls.concat([b for _, b in parts])
        position = np.concatenate([np.asarray(idxs, dtype=np.int64) for idxs, _ in parts])
        order = np.empty(n, dtype=np.int64)
        order[position] = np.arange(n)
        return whole.take(order)

    @classmethod
    def concat(cls, batches: list[RequestBatch]) -> RequestBatch:
        """The requests of ``batches`` one after the other."""
        first = batches[0]
        if len(batches) == 1:
            return first
        fields = {}
        for name in first.__dataclass_fields__:
            values = [getattr(b, name) for b in batches]
            if isinstance(values[0], np.ndarray):
                fields[name] = np.concatenate(values)
            else:
                fields[name] = [v for vs in values for v in vs]
        return cls(**fields)

    def take(self, order: np.ndarray) -> RequestBatch:
        """The requests at indices ``order`` (vectorised: one gather per field)."""

        def gather(lengths, picked):
            """Flat indices of the segments ``picked`` of a concatenation with ``lengths``."""
            starts, sizes = np.cumsum(lengths) - lengths, lengths[picked]
            within = np.arange(int(sizes.sum())) - np.repeat(np.cumsum(sizes) - sizes, sizes)
            return np.repeat(starts[picked], sizes) + within

        tokens = gather(self.prompt_lengths, order)
        samples = gather(self.samples_per_request, order)
        sample_tokens = gather(self.sample_lengths, samples)
        switches = gather(self.switch_counts, samples)
        return RequestBatch(
            prompt_token_ids=self.prompt_token_ids[tokens],
            prompt_lengths=self.prompt_lengths[order],
            prompt_logprobs=self.prompt_logprobs[tokens],
            has_prompt_logprobs=self.has_prompt_logprobs[order],
            samples_per_request=self.samples_per_request[order],
            token_ids=self.token_ids[sample_tokens],
            sample_lengths=self.sample_lengths[samples],
            logprobs=self.logprobs[sample_tokens],
            has_logprobs=self.has_logprobs[samples],
            finish_reasons=[self.finish_reasons[s] for s in samples.tolist()],
            stop_reasons=[self.stop_reasons[s] for s in samples.tolist()],
            texts=[self.texts[s] for s in samples.tolist()],
            replica_ids=self.replica_ids[order],
            versions_start=[self.versions_start[r] for r in order.tolist()],
            versions_end=[self.versions_end[r] for r in order.tolist()],
            switch_counts=self.switch_counts[samples],
            switch_versions=[self.switch_versions[i] for i in switches.tolist()],
            switch_tokens=self.switch_tokens[switches],
            cached_tokens=self.cached_tokens[order],
        )

    def unpack(self) -> list[RequestData]:
        """One :class:`RequestData` per request (views of the flat arrays)."""

        def split(flat, lengths):
            return np.split(flat, np.cumsum(lengths)[:-1]) if len(lengths) else []

        prompts = split(self.prompt_token_ids, self.prompt_lengths)
        prompt_lps = split(self.prompt_logprobs, self.prompt_lengths)
        ids = split(self.token_ids, self.sample_lengths)
        lps = split(self.logprobs, self.sample_lengths)
        end_from, switches = self.end_version_from, self.sample_switches()
        samples = [
            SampleData(
                token_ids=ids[s],
                logprobs=lps[s] if self.has_logprobs[s] else None,
                finish_reason=self.finish_reasons[s],
                stop_reason=self.stop_reasons[s],
                text=self.texts[s],
                switches=switches[s],
                end_version_from=int(end_from[s]),
            )
            for s in range(len(ids))
        ]
        out, first = [], 0
        for r, n in enumerate(self.samples_per_request.tolist()):
            out.append(
                RequestData(
                    prompt_token_ids=prompts[r],
                    prompt_logprobs=prompt_lps[r] if self.has_prompt_logprobs[r] else None,
                    samples=samples[first : first + n],
                    replica_id=int(self.replica_ids[r]),
                    weight_version_start=self.versions_start[r],
                    weight_version_end=self.versions_end[r],
                    cached_tokens=int(self.cached_tokens[r]),
                )
            )
            first += n
        return out


def _label(version: str, missing: int) -> int:
    """A version label as an integer (``missing``: not one)."""
    text = str(version)
    return int(text) if text.isdecimal() else missing


__all__ = ["EVERY_SAMPLE", "PromptBatch", "RequestBatch", "Switch"]

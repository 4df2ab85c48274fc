"""Plain-data messages between the service and its replica actors: what a replica
reports (:class:`ReplicaInfo`, :class:`ReplicaStats`), what the service records
(:class:`ReplicaDeath`), and one finished request as objects (:class:`RequestData`).

Replicas never send vLLM objects back: a batch travels as the columnar
:class:`~torchrl_vllm_ext.batches.RequestBatch`, and the driver rebuilds vLLM
``RequestOutput``s only when a caller asks for them. Weight-sync wire specs live in
:mod:`torchrl_vllm_ext.weight_sync.specs`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

Switch = tuple[str, int]
"""A weight switch inside one sample: ``(the new version label, tokens it had made
before)``; its tokens from there on were made by that version."""


@dataclass
class SampleData:
    """One generated completion."""

    token_ids: np.ndarray
    """Generated token ids, int64, shape (T,)."""
    logprobs: np.ndarray | None
    """Log-prob of each generated token under the sampling model, float32 (T,); None if not asked."""
    finish_reason: str | None
    """vLLM's finish reason: "stop", "length", "abort", ..."""
    stop_reason: int | str | None
    """The stop string or token that ended the sample, if any."""
    text: str
    """Detokenised completion ("" when detokenisation is off)."""
    switches: list[Switch] = field(default_factory=list)
    """Weight switches inside the sample, oldest first (pushes that landed while it
    generated and made some of its tokens); its tokens before the first were made by the
    request's ``weight_version_start``."""
    end_version_from: int = 0
    """Index of the first token generated with the request's ``weight_version_end``
    (read only: derived from ``switches`` by ``RequestBatch.unpack``); tokens before it
    came from older weights (a ``keep`` pause spanned a sync); 0 when every token did."""


@dataclass
class RequestData:
    """One finished request: a prompt and its ``n`` samples."""

    prompt_token_ids: np.ndarray
    """Prompt token ids, int64 (P,)."""
    prompt_logprobs: np.ndarray | None
    """Log-prob of each prompt token given the tokens before it, float32 (P,); entry 0 is NaN."""
    samples: list[SampleData]
    """The ``n`` completions, in vLLM's order."""
    replica_id: int
    """Replica that served the request."""
    weight_version_start: str
    """Weight version of the replica when the request was admitted."""
    weight_version_end: str
    """Weight version when it finished (differs only if a ``keep`` pause spanned a sync)."""
    cached_tokens: int = 0
    """Prompt tokens vLLM found in its prefix cache (not recomputed)."""


@dataclass(frozen=True)
class ReplicaInfo:
    """Static facts a replica reports once its engine is up."""

    replica_id: int
    """Stable id of the replica within its service."""
    pid: int
    """Process id of the actor (the engine runs in its children)."""
    node_ip: str
    """Ray node the actor runs on."""
    max_model_len: int
    """Longest prompt + completion the engine accepts."""
    max_token_id: int
    """Largest token id the engine accepts (max of tokenizer and model vocabularies)."""
    kv_capacity_tokens: int
    """Tokens the KV cache holds (blocks x block size)."""
    temp_dir: str = ""
    """The replica process's temporary directory on its node (vLLM's rendezvous file and
    sockets; removed at shutdown, or reaped by the next start there once the process is
    dead)."""
    dtype: str = ""
    """The dtype the engine serves the weights in (``bfloat16``, ...; empty: not reported)."""
    kv_cache_bytes: int | None = None
    """The KV-cache size its engine was given (the engine arguments', or the size the first
    replica on its GPU measured) or logged while it started; None: not known."""


@dataclass(frozen=True)
class ReplicaDeath:
    """A replica the service lost (its actor, engine or node died)."""

    replica_id: int
    """Id of the replica (a restart reuses it)."""
    node_ip: str | None
    """Node it ran on."""
    at: float
    """``time.time()`` when the service noticed."""
    cause: str
    """The error that told the service, as ``Type: message``."""


@dataclass(frozen=True)
class ReplicaStats:
    """A replica's load, read from vLLM's scheduler statistics and the actor's own counters."""

    replica_id: int
    """Stable id of the replica."""
    running: int
    """Requests the scheduler is running (vLLM ``SchedulerStats.num_running_reqs``)."""
    waiting: int
    """Requests waiting to be scheduled (``num_waiting_reqs``)."""
    kv_cache_usage: float
    """Fraction of KV-cache blocks in use (``kv_cache_usage``)."""
    outstanding: int
    """Requests accepted by the actor and not yet returned."""
    weight_version: str
    """Weight version the engine serves."""
    paused: bool
    """Whether generation is paused."""

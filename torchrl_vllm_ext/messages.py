"""Plain-data messages between the service and its replica actors.

Replicas never send vLLM objects back: a finished request travels as numpy arrays
and strings (cheap to serialise, no per-token Python objects), and the driver
rebuilds vLLM ``RequestOutput``s only when a caller asks for them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


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


# ---------------------------------------------------------------------------- weight sync
@dataclass(frozen=True)
class TensorSpec:
    """One parameter as it travels: Hugging Face name, dtype, shape and checksum."""

    name: str
    """Hugging Face parameter name (e.g. ``model.layers.0.mlp.up_proj.weight``)."""
    dtype: str
    """torch dtype name without the ``torch.`` prefix (``float32``, ``bfloat16``, ...)."""
    shape: tuple[int, ...]
    """Full (unsharded) shape."""
    checksum: int = 0
    """Sum of the tensor's bytes read as uint64 words, mod 2**64 (see weight_sync.checksum)."""


@dataclass(frozen=True)
class BucketSpec:
    """A packed bucket of the broadcast transport: same-dtype tensors laid end to end."""

    dtype: str
    """dtype of every tensor in the bucket."""
    tensors: tuple[TensorSpec, ...]
    """The tensors, in the order they are packed."""
    nbytes: int
    """Size of the packed buffer."""
    checksum: int
    """Checksum of the packed buffer."""


@dataclass(frozen=True)
class UpdateHeader:
    """The one control message of a broadcast update; buckets follow as collectives."""

    version: str
    """Weight version the update installs."""
    buckets: tuple[BucketSpec, ...]
    """Bucket layout, in broadcast order."""


@dataclass(frozen=True)
class SlotManifest:
    """What a published storage slot holds; written atomically as ``current.json``."""

    version: str
    """Weight version in the slot."""
    slot: str
    """Slot directory name ("A" or "B")."""
    tensors: tuple[TensorSpec, ...]
    """Every tensor of the slot, with its checksum."""

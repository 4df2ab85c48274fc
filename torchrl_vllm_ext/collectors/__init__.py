"""TorchRL collector integration: weight updates through our scheme, bounded-staleness async collection."""

from torchrl_vllm_ext.collectors.async_collection import AsyncCollection
from torchrl_vllm_ext.collectors.partial import (
    StaleTokens,
    VersionSpan,
    exact_spans,
    exclude_stale_tokens,
    has_token_versions,
    mask_stale_tokens,
    sample_token_versions,
    stale_prefix,
    token_spans,
    version_runs,
)
from torchrl_vllm_ext.collectors.rollout_queue import BusyClock, QueuedBatch, RolloutQueue
from torchrl_vllm_ext.collectors.staleness import (
    GatedPolicy,
    StalenessFilter,
    StalenessGate,
    sample_versions,
)
from torchrl_vllm_ext.collectors.updater import WeightSyncUpdater

__all__ = [
    "AsyncCollection",
    "BusyClock",
    "GatedPolicy",
    "QueuedBatch",
    "RolloutQueue",
    "StaleTokens",
    "StalenessFilter",
    "StalenessGate",
    "VersionSpan",
    "WeightSyncUpdater",
    "exact_spans",
    "exclude_stale_tokens",
    "has_token_versions",
    "mask_stale_tokens",
    "sample_token_versions",
    "sample_versions",
    "stale_prefix",
    "token_spans",
    "version_runs",
]

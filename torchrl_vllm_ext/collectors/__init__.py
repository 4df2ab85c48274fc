"""TorchRL collector integration: weight updates through our scheme, bounded-staleness async collection."""

from torchrl_vllm_ext.collectors.async_collection import AsyncCollection
from torchrl_vllm_ext.collectors.partial import mask_stale_tokens, stale_prefix
from torchrl_vllm_ext.collectors.staleness import (
    GatedPolicy,
    StalenessFilter,
    StalenessGate,
    sample_versions,
)
from torchrl_vllm_ext.collectors.updater import WeightSyncUpdater

__all__ = [
    "AsyncCollection",
    "GatedPolicy",
    "StalenessFilter",
    "StalenessGate",
    "WeightSyncUpdater",
    "mask_stale_tokens",
    "sample_versions",
    "stale_prefix",
]

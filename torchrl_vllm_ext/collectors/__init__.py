"""TorchRL collector integration: weight updates through our weight-sync scheme."""

from torchrl_vllm_ext.collectors.updater import WeightSyncUpdater

__all__ = ["WeightSyncUpdater"]

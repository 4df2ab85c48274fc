"""``auto``'s receiver (vLLM worker side): the worker reports its GPU, by UUID, for the plan."""

from __future__ import annotations

import torch

from torchrl_vllm_ext.weight_sync.transports.devices import device_uuid


class PlanReceiver:
    """``auto``'s part of a worker's weight sync (the worker extension's device method
    delegates here)."""

    def weight_sync_device(self) -> str | None:
        """The normalised UUID of this worker's GPU (None without CUDA): the transport plan
        compares devices by UUID, since Ray renumbers the GPUs each process sees."""
        if not torch.cuda.is_available():
            return None
        return device_uuid(torch.cuda.current_device())

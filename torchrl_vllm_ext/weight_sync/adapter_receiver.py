"""AdapterReceiver: a LoRA adapter's tensors into a vLLM worker's LoRA manager, no file.

The replica hands every worker an adapter as plain data (the header and buffer of
:class:`~torchrl_vllm_ext.engine.adapters.AdapterTensors`, or where the buffer lies in the
driver's shared memory, which the worker maps once and keeps); the worker checks that the
buffer holds every tensor the header names, then builds vLLM's LoRA model from the views
and registers it, pinned (:func:`torchrl_vllm_ext._compat.register_lora_from_tensors`). vLLM's
own ``remove_lora`` unloads it.
"""

from __future__ import annotations

import logging

from torchrl_vllm_ext._compat import register_lora_from_tensors
from torchrl_vllm_ext.engine.adapters import unpack_adapter
from torchrl_vllm_ext.engine.shared_memory import SharedRegion

logger = logging.getLogger(__name__)


class AdapterReceiver:
    """The worker side of adapters from memory.

    Args:
        worker: vLLM's ``Worker`` (its model runner holds the LoRA manager).
    """

    def __init__(self, worker):
        self._worker = worker

    def add_lora_from_tensors(
        self, lora_id: int, name: str, header_json: str, data: bytes | memoryview | tuple
    ) -> bool:
        """Build adapter ``lora_id`` (``name``) from its tensors (``data``: their bytes, or
        a :class:`~torchrl_vllm_ext.engine.shared_memory.SharedRegion` of the driver's
        shared memory as a tuple) and register it; True."""
        if isinstance(data, tuple | list):  # vLLM's RPC may hand a tuple back as a list
            data = SharedRegion(*data).read()
        tensors, config = unpack_adapter(header_json, data)
        register_lora_from_tensors(self._worker, lora_id, tensors, config)
        logger.debug(
            "LoRA adapter %s (id %d): %d tensors, %.1f MB, from memory",
            name, lora_id, len(tensors), len(data) / 1e6,
        )  # fmt: skip
        return True


__all__ = ["AdapterReceiver"]

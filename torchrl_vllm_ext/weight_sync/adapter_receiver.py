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
from collections import OrderedDict

from torchrl_vllm_ext._compat import register_lora_from_tensors, registered_lora_ids
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
        self._copies: OrderedDict[tuple, tuple[bytearray, int]] = OrderedDict()
        """Region of the driver's shared memory -> the writable copy of the last adapter
        read from it and that adapter's id: the next one read from there is copied into it
        once vLLM no longer holds that adapter (the driver reuses a region only for a new
        version of the adapter it retired)."""

    def add_lora_from_tensors(
        self, lora_id: int, name: str, header_json: str, data: bytes | memoryview | tuple
    ) -> bool:
        """Build adapter ``lora_id`` (``name``) from its tensors (``data``: their bytes, or
        a :class:`~torchrl_vllm_ext.engine.shared_memory.SharedRegion` of the driver's
        shared memory as a tuple) and register it; True."""
        into = None
        if isinstance(data, tuple | list):  # vLLM's RPC may hand a tuple back as a list
            region = tuple(data)
            data = SharedRegion(*region).read()
            into = self._reusable(region, lora_id)
        tensors, config = unpack_adapter(header_json, data, into)
        register_lora_from_tensors(self._worker, lora_id, tensors, config)
        logger.debug(
            "LoRA adapter %s (id %d): %d tensors, %.1f MB, from memory",
            name, lora_id, len(tensors), len(data) / 1e6,
        )  # fmt: skip
        return True

    def _reusable(self, region: tuple, lora_id: int) -> bytearray:
        """The copy of ``region`` to build adapter ``lora_id`` in: the last one read from
        there if vLLM dropped that adapter, else a new one (kept for the next)."""
        kept = self._copies.pop(region, None)
        if kept is None or kept[1] in registered_lora_ids(self._worker):
            kept = (bytearray(region[-1]), lora_id)
        self._copies[region] = (kept[0], lora_id)
        while len(self._copies) > _KEEP_COPIES:
            self._copies.popitem(last=False)  # vLLM's adapters keep theirs alive
        return kept[0]


_KEEP_COPIES = 8
"""Regions whose copies a worker keeps (an adapter sync uses ``keep + 1``)."""


__all__ = ["AdapterReceiver"]

"""What TorchRL's code and tests call on ``AsyncVLLM``'s actors (``service.actors[i]``), as a
base of :class:`~.actor.VLLMReplica`: each call answered from the replica's own state, or
refused with a typed error where the package serves the feature its own way (vLLM's native
weight transfer: pushes are verified and versioned by ``WeightSyncScheme``)."""

from __future__ import annotations

import asyncio

from torchrl_vllm_ext.errors import WeightSyncError

_NATIVE_TRANSFER = (
    "replica {}: vLLM's native weight transfer (TorchRL's VLLMWeightSyncScheme and "
    "AsyncVLLM's NCCL group) is not served: pushes into these replicas are verified and "
    "versioned. Push with vLLMUpdaterV2(service), service.update_weights(...), or "
    "torchrl_vllm_ext.WeightSyncScheme(service) (a TorchRL WeightSyncScheme)."
)

V1_UPDATER_METHODS = frozenset({"init_weight_update_group", "update_weight_broadcast"})
"""The worker methods TorchRL's ``vLLMUpdater`` (V1) calls through ``collective_rpc``
(``collectors/llm/weight_update/vllm.py``): its NCCL group with vLLM's workers."""


def refuse_v1_updater(method: str, where: str) -> None:
    """Raise :class:`WeightSyncError` naming the supported pushes when ``method`` is one
    of TorchRL's V1 updater's worker calls; return otherwise.

    Examples:
        >>> refuse_v1_updater("my_extension_method", "replica 0")
        >>> refuse_v1_updater("init_weight_update_group", "replica 0")
        Traceback (most recent call last):
        ...
        torchrl_vllm_ext.errors.WeightSyncError: replica 0: collective_rpc('init_weight_update_group') ...
    """
    if method in V1_UPDATER_METHODS:
        raise WeightSyncError(
            f"{where}: collective_rpc({method!r}) is TorchRL's vLLMUpdater (V1) joining "
            "vLLM's workers to its NCCL group, which these replicas do not serve: pushes into "
            "them are verified and versioned. Push with vLLMUpdaterV2(service) (or "
            "vLLMUpdater(v2=True, vllm_engine=service)), or give the collector "
            "weight_updater=WeightSyncUpdater(WeightSyncScheme(service)) (both from "
            "torchrl_vllm_ext)."
        )


class TorchRLActorCalls:
    """TorchRL's actor surface over a replica (``self``: the :class:`~.actor.VLLMReplica`)."""

    def ready(self) -> bool:
        return self.engine is not None

    def get_tokenizer(self):
        """The served model's tokenizer (TorchRL's ``actor.get_tokenizer.remote()``)."""
        from torchrl_vllm_ext.hf import load_tokenizer

        return load_tokenizer(self._engine_kwargs.get("tokenizer") or self._model, "tokenizer")

    async def collective_rpc_v1(
        self, method: str, timeout: float | None = None, args: tuple = (), kwargs=None
    ):
        """TorchRL's name and argument order of :meth:`collective_rpc`."""
        return await asyncio.wait_for(self.collective_rpc(method, args, kwargs), timeout)

    def get_world_size(self) -> int:
        """Workers of this replica (tensor x pipeline parallel)."""
        kw = self._engine_kwargs
        return kw.get("tensor_parallel_size", 1) * kw.get("pipeline_parallel_size", 1)

    async def get_num_unfinished_requests(self) -> int:
        return self._outstanding

    async def get_cache_usage(self) -> float:
        return self._require_engine().load().kv_cache_usage

    async def init_weight_transfer_engine(self, init_request) -> None:
        raise WeightSyncError(_NATIVE_TRANSFER.format(self.replica_id))

    async def update_weights_native(self, update_request) -> None:
        raise WeightSyncError(_NATIVE_TRANSFER.format(self.replica_id))

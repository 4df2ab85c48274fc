"""What TorchRL's code and tests call on ``AsyncVLLM``'s actors (``service.actors[i]``), a
part held by :class:`~.actor.VLLMReplica`: each call answered from the replica's own state, or
refused with a typed error where the package serves the feature its own way (vLLM's native
weight transfer: pushes are verified and versioned by ``WeightSyncScheme``)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from torchrl_vllm_ext.engine.replica.engine import Engine
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
    """TorchRL's actor surface over a replica (but ``ready``, the actor's own): a part held by the
    :class:`~.actor.VLLMReplica`, whose Ray methods of the same names delegate to it.

    Args:
        replica_id: the replica (named in every error).
        engine: the replica's engine, or :class:`ReplicaDeadError` when it has none.
        tokenizer: the served tokenizer's path or name.
        world_size: the replica's workers (tensor x pipeline parallel).
        collective_rpc: the replica's worker call (:meth:`.WorkerCalls.collective_rpc`).
        outstanding: the requests the replica runs now.

    Examples:
        >>> calls = TorchRLActorCalls(0, lambda: None, "model", 2, None, lambda: 3)
        >>> calls.get_world_size()
        2
    """

    def __init__(
        self,
        replica_id: int,
        engine: Callable[[], Engine],
        tokenizer: str,
        world_size: int,
        collective_rpc: Callable[..., Awaitable],
        outstanding: Callable[[], int],
    ):
        self.replica_id = replica_id
        self._engine = engine
        self._tokenizer = tokenizer
        self._world_size = world_size
        self._collective_rpc = collective_rpc
        self._outstanding = outstanding

    def get_tokenizer(self):
        """The served model's tokenizer (TorchRL's ``actor.get_tokenizer.remote()``)."""
        from torchrl_vllm_ext.hf import load_tokenizer

        return load_tokenizer(self._tokenizer, "tokenizer")

    async def collective_rpc_v1(
        self, method: str, timeout: float | None = None, args: tuple = (), kwargs=None
    ):
        """TorchRL's name and argument order of :meth:`.WorkerCalls.collective_rpc`."""
        return await asyncio.wait_for(self._collective_rpc(method, args, kwargs), timeout)

    def get_world_size(self) -> int:
        """Workers of this replica (tensor x pipeline parallel)."""
        return self._world_size

    async def get_num_unfinished_requests(self) -> int:
        return self._outstanding()

    async def get_cache_usage(self) -> float:
        return self._engine().load().kv_cache_usage

    async def init_weight_transfer_engine(self, init_request) -> None:
        raise WeightSyncError(_NATIVE_TRANSFER.format(self.replica_id))

    async def update_weights_native(self, update_request) -> None:
        raise WeightSyncError(_NATIVE_TRANSFER.format(self.replica_id))

"""ShardedPlan: what rank 0 decides for a sharded push, the same typed value on every rank
(it crosses the ranks as JSON: :func:`~..specs.to_json` / :func:`~..specs.from_json`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from torchrl_vllm_ext.errors import WeightSyncError
from torchrl_vllm_ext.weight_sync.params import torch_dtype
from torchrl_vllm_ext.weight_sync.sharded.routes import pushed_names
from torchrl_vllm_ext.weight_sync.sharded.streamed import bucket_plan, header_of
from torchrl_vllm_ext.weight_sync.specs import SlotManifest, SlotTarget, TensorSpec, UpdateHeader
from torchrl_vllm_ext.weight_sync.transports.protocol import Streamed, WrittenByRanks


@dataclass(frozen=True)
class ShardedPlan:
    """One sharded push, as rank 0 planned it.

    Examples:
        >>> from torchrl_vllm_ext.weight_sync.specs import from_json, to_json
        >>> plan = ShardedPlan("3", (TensorSpec("w", "float32", (2,)),), 8, buckets=((0,),))
        >>> from_json(to_json(plan), ShardedPlan) == plan, plan.names, plan.written
        (True, ['w'], False)
    """

    version: str
    """The version the push installs (the one given, else TorchRL's next)."""
    tensors: tuple[TensorSpec, ...]
    """What it sends, in the served checkpoint's order: full shapes, and the dtypes the
    ranks write (the slots' served dtype with delta pushes on) or gather."""
    nbytes: int
    """Bytes of the pushed weights, in their own dtypes."""
    probe: tuple[int, ...] = ()
    """The value check's probe sequence (empty: unchecked)."""
    reference_dtype: str | None = None
    """The dtype the replicas serve, scored beside float32 by the value check's collective
    forward; None: this push is not checked."""
    slot: SlotTarget | None = None
    """Written by the ranks (storage): the slot each rank writes its blocks into."""
    buckets: tuple[tuple[int, ...], ...] = ()
    """Streamed (broadcast): the buckets, as indices into :attr:`tensors`, gathered in
    this order."""

    @property
    def names(self) -> list[str]:
        """The pushed tensors' names, in order."""
        return [t.name for t in self.tensors]

    @property
    def written(self) -> bool:
        """Whether the ranks write the push in place (else they gather it, streamed)."""
        return self.slot is not None

    def manifest(self, checksums: dict[str, int]) -> SlotManifest:
        """The manifest publishing the written slot, with every tensor's ``checksums``."""
        tensors = tuple(
            TensorSpec(t.name, t.dtype, t.shape, checksums[t.name]) for t in self.tensors
        )
        return SlotManifest(version=self.version, slot=self.slot.slot, tensors=tensors)

    def header(self) -> UpdateHeader:
        """The streamed buckets' header (their checksums follow them)."""
        return header_of(self.tensors, self.buckets, self.version)


def make_plan(
    scheme,
    transport: WrittenByRanks | Streamed,
    shapes: dict[str, tuple[tuple[int, ...], str]],
    has_module: bool,
    version: str,
) -> ShardedPlan:
    """Rank 0's plan of a push of tensors of ``shapes`` ((full shape, dtype) by name) as
    ``version`` through the scheme's ``transport``; for a written push, its slot is
    reserved. ``has_module``: the ranks push a module (a value check can run its forward)."""
    names = pushed_names(shapes, scheme.expected)
    reference_dtype = None
    if scheme.arrival.due():
        if not has_module:
            raise WeightSyncError(
                "the value check needs the sharded model (a collective forward on every "
                "rank): push the model, not a state dict, or create the scheme with "
                "verify='never'."
            )
        reference_dtype = scheme.arrival.served_dtype_name(list(scheme.fleet.ready()))
    probe = tuple(scheme.arrival.probe) if reference_dtype is not None else ()
    nbytes = sum(torch_dtype(shapes[n][1]).itemsize * math.prod(shapes[n][0]) for n in names)
    if isinstance(transport, WrittenByRanks):
        # The scheme's slots hold its served dtype when delta pushes are on (its 1-process
        # pushes write them so): the ranks' blocks are cast as they are written.
        stored = scheme.delta_dtype
        tensors = tuple(TensorSpec(n, stored or shapes[n][1], tuple(shapes[n][0])) for n in names)
        slot = transport.reserve_written(tensors)
        return ShardedPlan(version, tensors, nbytes, probe, reference_dtype, slot=slot)
    tensors = tuple(TensorSpec(n, shapes[n][1], tuple(shapes[n][0])) for n in names)
    buckets = bucket_plan(tensors, transport.bucket_bytes)
    return ShardedPlan(version, tensors, nbytes, probe, reference_dtype, buckets=buckets)

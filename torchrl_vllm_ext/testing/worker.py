"""A worker extension for tests and benchmarks: the package's own
(:class:`~torchrl_vllm_ext.weight_sync.worker.WeightSyncWorkerExtension`) plus what only they
call, named by dotted path (``ServiceConfig(worker_extension_cls=TESTING_WORKER_EXTENSION)``)
so that the product's load path carries no test switch.

- **Broken loads**: :data:`BREAK_LOADS_ENV` in the driver's environment when a replica starts
  (every ``TORCHRL_VLLM_*`` setting reaches the replicas) names, per version, a checkpoint
  tensor every worker leaves out of that version's load (the push's value check must then
  fail it), or :data:`FAIL_HALF_WAY` (the load writes half the tensors and raises).
- ``weight_checksums``: each served parameter's position-sensitive checksum (a replayed
  push and the loader must agree bitwise).
- ``use_load_plan``: switch the worker's load plans off or on (benchmarks compare both).
- ``stage_slot_copy``: copy the published storage slot into a host staging buffer as a GPU
  worker stages it before its pause, its slices or every tensor whole (benchmarks compare
  both on CPUs, where workers stage nothing).
"""

from __future__ import annotations

import logging
import os
import time

import torch

from torchrl_vllm_ext.weight_sync.loading.loads import Loads
from torchrl_vllm_ext.weight_sync.loading.plan import content_sums, layout_of
from torchrl_vllm_ext.weight_sync.loading.staging import StagingArea
from torchrl_vllm_ext.weight_sync.transports.storage.slots import SlotReader
from torchrl_vllm_ext.weight_sync.worker import WeightSyncWorkerExtension, WorkerWeightSync

logger = logging.getLogger(__name__)

TESTING_WORKER_EXTENSION = "torchrl_vllm_ext.testing.worker.TestingWorkerExtension"
"""The dotted path a test gives ``worker_extension_cls``."""

BREAK_LOADS_ENV = "TORCHRL_VLLM_TEST_BREAK_LOADS"
"""``"<version>=<checkpoint tensor name>"`` entries, comma-separated (one replica start
serves many broken pushes); read by each worker at each load."""

FAIL_HALF_WAY = "!fail-half-way"
"""The :data:`BREAK_LOADS_ENV` entry that fails a load after it wrote half the tensors."""


class TestingMethods:
    """The testing extension's own worker methods (called through ``collective_rpc``)."""

    __test__ = False

    CHECKSUMS = "weight_checksums"
    """() -> {parameter name: position-sensitive checksum} of the served parameters."""
    LOAD_PLAN = "use_load_plan"
    """(enabled: bool | None = None) -> whether this worker's in-place loads use plans."""
    STAGE_SLOT_COPY = "stage_slot_copy"
    """(root: str, sliced: bool) -> {"seconds", "bytes"} of one staging copy of the slot."""


def broken_for(knob: str, version: str) -> set[str]:
    """The tensors ``knob`` (:data:`BREAK_LOADS_ENV`) names for ``version``.

    Examples:
        >>> sorted(broken_for("v1=a.w,v2=b.w,v1=c.w", "v1"))
        ['a.w', 'c.w']
    """
    entries = (entry.partition("=") for entry in knob.split(",") if entry)
    return {name for v, _, name in entries if v == version}


class BrokenLoads(Loads):
    """Loads that leave out what :data:`BREAK_LOADS_ENV` names for their version."""

    def load(self, named_tensors, version: str, non_blocking: bool = False, changes=None):
        broken = broken_for(os.environ.get(BREAK_LOADS_ENV, ""), version)
        if not broken:
            return super().load(named_tensors, version, non_blocking, changes)
        logger.warning("test: not loading %s of version %s", sorted(broken), version)
        named = list(named_tensors)
        if FAIL_HALF_WAY not in broken:
            return super().load([(n, t) for n, t in named if n not in broken], version)
        super().load(named[: len(named) // 2], version, non_blocking)
        self.writing = version  # half written: the replica must not be served
        raise RuntimeError(f"test: the load of {version} failed half-way")


class TestingWorkerExtension(WeightSyncWorkerExtension):
    """The package's worker extension with broken loads and the methods above."""

    __test__ = False  # not a pytest test class
    loads_class = BrokenLoads

    def weight_checksums(self) -> dict[str, int]:
        """Each served parameter's position-sensitive checksum (one host sync)."""
        params = dict(self.get_model().named_parameters())
        return dict(zip(params, content_sums(list(params.values())), strict=True))

    def use_load_plan(self, enabled: bool | None = None) -> bool:
        """Switch this worker's load plans on or off (None: leave); whether they are on."""
        plans = WorkerWeightSync.of(self).loads.plans
        if enabled is not None:
            plans.enabled = bool(enabled)
        return plans.enabled

    def stage_slot_copy(self, root: str, sliced: bool) -> dict:
        """Copy the published slot of ``root`` into a host staging buffer (reserved at the
        first call and kept) the way a GPU worker stages it: only the views its load plan
        reads (``sliced``; the plan the CPU pause replays, traced by an earlier push) or
        every tensor whole. ``{"seconds": of the copy, "bytes": copied}``."""
        readers = self.__dict__.setdefault("bench_readers", {})
        reader = readers.setdefault(root, SlotReader(root))
        _, tensors = reader.read(verify=False)
        area = self.__dict__.setdefault("bench_staging", StagingArea())
        specs = [(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]
        area.reserve(specs, "device", torch.device("cpu"))  # plain host memory on CPUs
        reads = WorkerWeightSync.of(self).loads.plans.reads(layout_of(tensors.items()))
        if sliced and reads is None:
            raise RuntimeError(f"no load plan for the layout of {root}: push it once first")
        start = time.perf_counter()
        area.fill(tensors, slices=reads.views if sliced else None)
        seconds = time.perf_counter() - start
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        return {"seconds": seconds, "bytes": reads.received_bytes if sliced else nbytes}

"""The receiving step every transport shares, in one vLLM worker: stage a version while the
engine keeps generating, then load it in the pause.

Each transport's receiver (``transports/<name>/receiver.py``) produces
``[(checkpoint name, tensor)]`` and hands it to :meth:`Loads.stage` (in a background thread)
or :meth:`Loads.load` (now). Where the parameters can be written in place (dense models),
the load is the model's own ``load_weights`` traced once per layout and replayed as one
batched copy afterwards (:mod:`.planned`); otherwise (MoE, quantized, CPU-packed) vLLM's
layerwise reload (``_compat.worker_reload_weights``). The staging buffer (on the device, or
in pinned host memory: :mod:`.staging`) is reserved at the first sync and kept.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from dataclasses import dataclass, field, replace

import torch

from torchrl_vllm_ext._compat import worker_reload_weights
from torchrl_vllm_ext.errors import WeightSyncError
from torchrl_vllm_ext.weight_sync import cpu_layout
from torchrl_vllm_ext.weight_sync.loading.planned import LoadReport, PlannedLoader, model_state
from torchrl_vllm_ext.weight_sync.loading.scatter import Changes
from torchrl_vllm_ext.weight_sync.loading.slices import SliceReads
from torchrl_vllm_ext.weight_sync.loading.staging import StagingArea, StagingPlace, staging_place

logger = logging.getLogger(__name__)

Named = list[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class Received:
    """A version a receiver produced: its tensors and, for a delta, what changed since the
    base (the pause then writes only that, :mod:`.scatter`)."""

    named: Named
    changes: Changes | None = None
    reads: SliceReads | None = None
    """Only these views of the tensors were staged (a storage worker's slices): the pause
    must replay the plan they came from, or load ``whole`` instead."""
    whole: Named | None = None
    """With ``reads``: the whole tensors (the storage slot's), for a pause whose plan no
    longer replays (a parameter moved since staging); None where there are none (a
    per-worker broadcast sent only the slices: such a pause fails, naming why)."""


@dataclass
class Staged:
    """A version being staged by a background thread, and what the thread produced."""

    version: str
    thread: threading.Thread
    result: Received | None = None
    error: BaseException | None = None


@dataclass
class Loads:
    """Staging and loading for one vLLM worker, shared by every transport's receiver.

    Args:
        worker: vLLM's ``Worker`` (its model, its config, vLLM's layerwise reload).
    """

    worker: object
    staging: StagingArea = field(default_factory=StagingArea)
    """The staging buffer, reserved at the first GPU sync and kept (:mod:`.staging`)."""
    plans: PlannedLoader = field(default_factory=PlannedLoader)
    """The load plans of this worker's model, by layout."""
    staged: Staged | None = None
    """The version a transport staged for the next pause, if any."""
    writing: str | None = None
    """The version a load is writing: set until it completes, so that a load that fails
    half-way leaves it set and the replica is not served (:meth:`intact`)."""
    in_place_of: tuple | None = None
    """``(model, whether it loads in place)``: asked once per model."""
    served: str | None = None
    """The version the parameters hold as a load plan wrote it (the base a delta may be
    scattered into); None after any other load, a failed one, or vLLM's sleep."""

    # ------------------------------------------------------------------ staging
    def stage(self, version: str, produce) -> bool:
        """Run ``produce() -> [(name, tensor)] | Received`` in a thread while the engine
        keeps generating."""

        def run():
            try:
                result = produce()
                staged.result = result if isinstance(result, Received) else Received(result)
            except BaseException as e:  # reported by staged_ready / load_staged
                staged.error = e

        staged = Staged(version, threading.Thread(target=run, name="tvllm-stage", daemon=True))
        staged.thread.start()
        self.staged = staged
        return True

    def staged_ready(self, version: str) -> bool:
        """Whether the staged read of ``version`` finished; raises if it failed (bad slot)."""
        staged = self._staged(version)
        if staged.thread.is_alive():
            return False
        if staged.error is not None:
            self.staged = None
            raise staged.error
        return True

    def load_staged(self, version: str) -> LoadReport:
        """Finish the staged read of ``version`` and load it (the part that needs the pause)."""
        staged = self._staged(version)
        staged.thread.join()
        self.staged = None
        if staged.error is not None:
            raise staged.error
        result = staged.result
        named = result.named
        if result.reads is not None:
            state = functools.partial(model_state, self.worker.get_model())
            replays = self.plans.replays(named, state)
            if not replays and result.whole is None:
                raise WeightSyncError(
                    f"version {version}: this worker received only its slices (per-worker "
                    "broadcast sends) and its load plan no longer replays (a parameter "
                    "moved since the slices were reported); nothing was loaded, it keeps "
                    "serving its previous weights. Push again: the plan is traced anew "
                    "on a whole-tensor broadcast."
                )
            if not replays:
                # Only the plan's views were staged and it no longer replays: the slot's
                # whole tensors, which the loader may read anywhere.
                logger.info("the load plan changed since staging: loading the whole tensors")
                report = self.load(result.whole, version)
                staged_bytes = 0 if result.whole is named else result.reads.received_bytes
                received = report.nbytes + staged_bytes
                return replace(report, received_bytes=received)
        # Staged in pinned host memory for a GPU: one batched non-blocking copy, one sync
        # (a slot's own pages, not pinned, copy as they come).
        pinned = (
            bool(named)
            and named[0][1].device.type == "cpu"
            and torch.cuda.is_available()
            and named[0][1].is_pinned()
        )
        report = self.load(named, version, non_blocking=pinned, changes=result.changes)
        return report if result.reads is None else report.read_as(result.reads)

    def _staged(self, version: str) -> Staged:
        if self.staged is None or self.staged.version != version:
            raise WeightSyncError(
                f"no staged weights for version {version!r}; stage them first (the "
                "transport's stage call)."
            )
        return self.staged

    def copy_in(self, tensors, device, place: StagingPlace, slices=None) -> Named:
        """Copy ``tensors`` into the staging buffer on ``device`` (or pinned host memory:
        ``place``), on a side stream so the engine's own work is not ordered behind it;
        ``slices``: only those views of the tensors they name (:meth:`.StagingArea.fill`)."""
        specs = [(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]
        if self.staging.reserve(specs, place, device):
            logger.info(
                "weight staging: %.2f GB reserved %s and kept for every push of this layout",
                self.staging.nbytes / 1e9,
                f"on {device}" if place == "device" else "in pinned host memory",
            )
        stream = torch.cuda.Stream(device) if place == "device" and device.type == "cuda" else None
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            staged = self.staging.fill(tensors, non_blocking=place == "device", slices=slices)
        if stream is not None:
            stream.synchronize()
        return staged

    # ------------------------------------------------------------------ loading
    def load(
        self,
        named_tensors,
        version: str,
        non_blocking: bool = False,
        changes: Changes | None = None,
    ) -> LoadReport:
        """Load ``named_tensors`` into the served parameters, in place where the model
        allows (its loader, traced once per layout and replayed; a delta of the version
        they hold: only what ``changes`` says changed), else by vLLM's layerwise reload;
        ``non_blocking``: they are in pinned host memory."""
        named_tensors = list(named_tensors)
        model = self.worker.get_model()
        base, self.served = self.served, None
        self.writing = version
        report = None
        if self.in_place(model):
            state = functools.partial(model_state, model)
            if changes is not None and changes.base == base:
                report = self.plans.scatter(model.load_weights, state, named_tensors, changes)
            # The model's own loader maps HF names onto fused/sharded parameters and
            # copies into them (replayed from its plan after the first push of a layout):
            # the served tensors stay where they are.
            if report is None:
                report = self.plans.load(model.load_weights, state, named_tensors, non_blocking)
        else:
            # Packed (CPU oneDNN), expert (MoE) or quantized weights: vLLM's layerwise
            # reload redoes the post-load processing of every layer (and _compat what it
            # misses).
            worker_reload_weights(self.worker, _on_gpu_for_reload(named_tensors))
            nbytes = sum(t.numel() * t.element_size() for _, t in named_tensors)
            report = LoadReport("layerwise", nbytes, why=_LAYERWISE)
        self.writing = None
        if report.path in ("replay", "trace", "scatter"):
            self.served = version
        return report

    def forget_served(self) -> bool:
        """The parameters no longer hold what the last load wrote (vLLM's sleep discarded
        them): the next delta is loaded whole."""
        self.served = None
        return True

    def in_place(self, model) -> bool:
        """:func:`.cpu_layout.loads_in_place`, asked once per model."""
        if self.in_place_of is None or self.in_place_of[0] is not model:
            self.in_place_of = (model, cpu_layout.loads_in_place(model))
        return self.in_place_of[1]

    def intact(self) -> bool:
        """False after a load that failed once it had begun writing the parameters."""
        return self.writing is None


def _on_gpu_for_reload(named_tensors: Named) -> Named:
    """The tensors vLLM's layerwise reload gets on a GPU worker: on the GPU, when they
    are in host memory (pinned staging of a sleep-mode replica, a storage slot read by a
    restarted replica) and the GPU has room for a transient copy (freed after the load);
    its post-load kernels then never see a host tensor."""
    if not named_tensors or named_tensors[0][1].device.type != "cpu":
        return named_tensors
    if not torch.cuda.is_available():
        return named_tensors
    device = torch.device("cuda", torch.cuda.current_device())
    nbytes = sum(t.numel() * t.element_size() for _, t in named_tensors)
    free, total = torch.cuda.mem_get_info(device)
    if staging_place(nbytes, free, total) != "device":
        return named_tensors
    moved = [(n, t.to(device, non_blocking=True)) for n, t in named_tensors]
    torch.cuda.current_stream(device).synchronize()
    return moved


_LAYERWISE = (
    "vLLM's layerwise reload: the model keeps weights in a layout of its own (fused MoE "
    "experts, quantized or CPU-packed weights), re-derived after each load"
)

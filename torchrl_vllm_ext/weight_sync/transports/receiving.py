"""The receiving step every transport shares, in vLLM's worker: stage a version while the
engine keeps generating, then load it in the pause.

:class:`Receiving` is the last base of
:class:`~torchrl_vllm_ext.weight_sync.worker.WeightSyncWorkerExtension` (``self`` is vLLM's
``Worker``); each transport's receiver mixin (``transports/<name>/receiver.py``) produces
``[(checkpoint name, tensor)]`` and hands it to :meth:`Receiving._tvllm_stage` (in a
background thread) or :meth:`Receiving._tvllm_load` (now). Where the parameters can be
written in place (dense models), the load is the model's own ``load_weights`` traced once
per layout and replayed as one batched copy afterwards (:mod:`.planned_load`); otherwise
(MoE, quantized, CPU-packed) vLLM's layerwise reload (``_compat.worker_reload_weights``),
exactly as before plans. Staging buffers (on the device, or in pinned host memory:
:mod:`.staging`) are reserved at the first sync and kept from push to push.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading

import torch

from torchrl_vllm_ext._compat import worker_reload_weights
from torchrl_vllm_ext.errors import WeightSyncError
from torchrl_vllm_ext.protocol import TEST_FAIL_HALF_WAY, TEST_SKIP_LOAD_ENV
from torchrl_vllm_ext.weight_sync import cpu_layout
from torchrl_vllm_ext.weight_sync.transports.load_plan import content_sums
from torchrl_vllm_ext.weight_sync.transports.planned_load import (
    LoadReport,
    PlannedLoader,
    model_state,
)
from torchrl_vllm_ext.weight_sync.transports.staging import Place, StagingArea, staging_place

logger = logging.getLogger(__name__)


class Receiving:
    """Staging and loading, shared by every transport's receiver (``self``: vLLM's Worker)."""

    def _tvllm_stage(self, version: str, produce) -> bool:
        """Run ``produce() -> [(name, tensor)]`` in a thread while the engine keeps generating."""
        staged: dict = {}

        def run():
            try:
                staged["result"] = produce()
            except BaseException as e:  # reported by staged_weights_ready / load_staged_weights
                staged["error"] = e

        thread = threading.Thread(target=run, name="tvllm-stage", daemon=True)
        thread.start()
        self._tvllm_staged = (version, thread, staged)
        return True

    def staged_weights_ready(self, version: str) -> bool:
        """Whether the staged read of ``version`` finished; raises if it failed (bad slot)."""
        thread, staged = self._tvllm_staged_for(version)
        if thread.is_alive():
            return False
        if "error" in staged:
            self._tvllm_staged = (None, None, {})
            raise staged["error"]
        return True

    def load_staged_weights(self, version: str) -> str:
        """Finish the staged read and load it (the only part that needs the pause)."""
        self._tvllm_load_staged(version)
        return version

    def apply_staged_weights(self, version: str) -> dict:
        """:meth:`load_staged_weights`, reporting how it loaded: ``{"version", "path",
        "nbytes", "replayed_bytes", "why"}`` (the pause call of the staged transports)."""
        return {"version": version, **self._tvllm_load_staged(version).as_dict()}

    def use_load_plan(self, enabled: bool | None = None) -> bool:
        """Switch this worker's load plans on or off (None: leave as is); whether they are
        on. Off, every in-place load runs the model's loader (``TORCHRL_VLLM_LOAD_PLAN=0``
        in the replica's environment starts it so)."""
        loader = self._tvllm_planned()
        if enabled is not None:
            loader.enabled = bool(enabled)
        return loader.enabled

    def weight_checksums(self) -> dict[str, int]:
        """Each served parameter's position-sensitive checksum (one host sync): what a
        replayed push and the loader must agree on, bitwise."""
        params = dict(self.get_model().named_parameters())
        return dict(zip(params, content_sums(list(params.values())), strict=True))

    def _tvllm_load_staged(self, version: str) -> LoadReport:
        thread, staged = self._tvllm_staged_for(version)
        thread.join()
        self._tvllm_staged = (None, None, {})
        if "error" in staged:
            raise staged["error"]
        named = staged["result"]
        # Staged in pinned host memory for a GPU: one batched non-blocking copy, one sync
        # (a slot's own pages, not pinned, copy as they come).
        pinned = (
            bool(named)
            and named[0][1].device.type == "cpu"
            and torch.cuda.is_available()
            and named[0][1].is_pinned()
        )
        return self._tvllm_load(named, version, non_blocking=pinned)

    def _tvllm_staged_for(self, version: str):
        staged_version, thread, staged = getattr(self, "_tvllm_staged", (None, None, {}))
        if staged_version != version or thread is None:
            raise WeightSyncError(
                f"no staged weights for version {version!r}; call stage_weight_broadcast first."
            )
        return thread, staged

    def _tvllm_copy_in(self, tensors, device, place: Place) -> list[tuple[str, torch.Tensor]]:
        """Copy ``tensors`` into this worker's staging buffer on ``device`` (or pinned host
        memory: ``place``), reserved at the first sync and kept (:class:`.StagingArea`),
        on a side stream so the engine's own work is not ordered behind it."""
        area = self.__dict__.setdefault("_tvllm_staging", StagingArea())
        specs = [(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]
        if area.reserve(specs, place, device):
            logger.info(
                "weight staging: %.2f GB reserved %s and kept for every push of this layout",
                area.nbytes / 1e9,
                f"on {device}" if place == "device" else "in pinned host memory",
            )
        stream = torch.cuda.Stream(device) if place == "device" else None
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            staged = area.fill(tensors, non_blocking=place == "device")
        if stream is not None:
            stream.synchronize()
        return staged

    def _tvllm_load(self, named_tensors, version: str, non_blocking: bool = False) -> LoadReport:
        """Load ``named_tensors`` into the served parameters, in place where the model
        allows (its loader, traced once per layout and replayed), else by vLLM's layerwise
        reload; ``non_blocking``: they are in pinned host memory."""
        named_tensors, fail = _skip_for_test(named_tensors, version)
        named_tensors = list(named_tensors)
        model = self.get_model()
        # Set until the load completes: one that fails from here on may have written some
        # parameters, and the replica must not serve them (weights_intact says so).
        self._tvllm_writing = version
        if self._tvllm_in_place(model):
            # The model's own loader maps HF names onto fused/sharded parameters and
            # copies into them (replayed from its plan after the first push of a layout):
            # the served tensors stay where they are.
            report = self._tvllm_planned().load(
                model.load_weights, lambda: model_state(model), named_tensors, non_blocking
            )
        else:
            # Packed (CPU oneDNN), expert (MoE) or quantized weights: vLLM's layerwise
            # reload redoes the post-load processing of every layer (and _compat what it
            # misses).
            worker_reload_weights(self, _on_gpu_for_reload(named_tensors))
            nbytes = sum(t.numel() * t.element_size() for _, t in named_tensors)
            report = LoadReport("layerwise", nbytes, why=_LAYERWISE)
        if fail:
            raise RuntimeError(f"test hook: load of {version} failed half-way")
        self._tvllm_writing = None
        return report

    def _tvllm_in_place(self, model) -> bool:
        """:func:`.cpu_layout.loads_in_place`, asked once per model."""
        known = self.__dict__.get("_tvllm_in_place_of")
        if known is None or known[0] is not model:
            known = (model, cpu_layout.loads_in_place(model))
            self._tvllm_in_place_of = known
        return known[1]

    def _tvllm_planned(self) -> PlannedLoader:
        return self.__dict__.setdefault("_tvllm_load_plans", PlannedLoader())

    def weights_intact(self) -> bool:
        """False after a load that failed once it had begun writing the parameters."""
        return getattr(self, "_tvllm_writing", None) is None


def _on_gpu_for_reload(named_tensors: list) -> list:
    """The tensors vLLM's layerwise reload gets on a GPU worker: on the GPU, when they
    are in host memory (pinned staging of a sleep-mode replica, a storage slot read by a
    restarted replica) and the GPU has room for a transient copy (freed after the load),
    as device staging gave it before sleep-mode replicas staged in pinned memory; its
    post-load kernels then never see a host tensor."""
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


def _skip_for_test(named_tensors, version: str):
    """``(tensors, fail)``: the tensors a test leaves out of ``version`` left out, or half of
    them with ``fail`` set (:data:`TEST_SKIP_LOAD_ENV`)."""
    skip = skipped_for_test(os.environ.get(TEST_SKIP_LOAD_ENV, ""), version)
    if not skip:
        return named_tensors, False
    logger.warning(
        "test hook %s: not loading %s of version %s", TEST_SKIP_LOAD_ENV, sorted(skip), version
    )
    if TEST_FAIL_HALF_WAY in skip:
        named_tensors = list(named_tensors)
        return named_tensors[: len(named_tensors) // 2], True
    return [(n, t) for n, t in named_tensors if n not in skip], False


def skipped_for_test(knob: str, version: str) -> set[str]:
    """The tensors ``knob`` (``"<version>=<tensor>[,<version>=<tensor>...]"``) names for
    ``version``: one replica start serves many broken pushes.

    Examples:
        >>> sorted(skipped_for_test("v1=a.w,v2=b.w,v1=c.w", "v1"))
        ['a.w', 'c.w']
    """
    entries = (entry.partition("=") for entry in knob.split(",") if entry)
    return {name for v, _, name in entries if v == version}

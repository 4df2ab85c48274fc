"""What a replica's actor asks of vLLM: ``AsyncLLM``'s weight version and pause calls, the
KV-size line a starting engine logs, the in-process engine's internals."""

from __future__ import annotations

import copy
import logging
import re
from typing import NamedTuple

from torchrl_vllm_ext._compat.vllm_api import PauseMode

logger = logging.getLogger(__name__)


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


MEMORY_LORA_PATH = "/nonexistent/torchrl-vllm-adapter-from-memory/{lora_id}"
"""The ``lora_path`` of an adapter the workers built from tensors. vLLM wants one in every
request; it reads it only to load an adapter its workers do not hold, which they always
do here (pinned from the add to the removal, and a replica refuses requests naming one it
does not hold). Absolute, so vLLM never takes it for a Hugging Face repo id, and unique
per adapter (the prefix cache's keys include it)."""


def lora_request(name: str, lora_id: int, path: str | None):
    """vLLM's ``LoRARequest`` for an adapter directory, or (``path`` None) for an adapter
    the workers built from tensors."""
    from vllm.lora.request import LoRARequest

    path = MEMORY_LORA_PATH.format(lora_id=lora_id) if path is None else path
    return LoRARequest(lora_name=name, lora_int_id=lora_id, lora_path=path)


def tokens_so_far(output_processor, external_ids: set[str]) -> dict[tuple[str, int], int]:
    """Tokens generated so far by each sample of the given requests, from the engine's
    output processor (``LLMEngine`` and ``AsyncLLM`` both keep one in the caller's
    process): ``{(request id, sample index): count}``.

    With ``n > 1`` vLLM runs one child request per sample and drops a child's state when
    it finishes; its parent keeps the finished child's final output (our requests are
    ``FINAL_ONLY``), read here so the finished sample is reported by its final count.
    """
    counts = {}
    for state in output_processor.request_states.values():
        rid = state.external_req_id
        if rid not in external_ids:
            continue
        counts[(rid, state.request_index)] = state.detokenizer.num_output_tokens()
        parent = state.parent_req
        for done in parent.output_aggregator if parent is not None else ():
            if done is not None:  # a finished child of a running request
                counts[(rid, done.index)] = len(done.token_ids)
    return counts


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

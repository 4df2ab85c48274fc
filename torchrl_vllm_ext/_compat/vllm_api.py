"""vLLM's classes, errors and limits, asked for from any process (imported lazily)."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Literal, NamedTuple, get_args

logger = logging.getLogger(__name__)

PauseMode = Literal["abort", "wait", "keep"]
"""vLLM's ``vllm.v1.engine.PauseMode``, spelled here so no import is needed to check one
(``tests/unit/test_compat.py`` checks the two agree)."""
PAUSE_MODES: tuple[str, ...] = get_args(PauseMode)


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

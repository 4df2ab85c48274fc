"""An engine stand-in that answers every request at once: the package's own ceiling.

:class:`InstantEngine` is an :class:`~torchrl_vllm_ext.engine.replica.engine.Engine` whose
``generate`` returns finished vLLM ``RequestOutput``s built from precomputed tokens and
log-probs (``max_tokens`` of them per sample, finish reason ``length``) without scheduling,
model or sampling. A service launched with ``engine_cls=INSTANT_ENGINE`` then runs
everything the package does per batch for real: validation, routing, the Ray hop both
ways, the replica's ``generate`` (requests, seeds, cache salts, ``pack_outputs``), the
merge, and ``VLLMPolicy``'s conversion to TorchRL's layout. What it leaves out is vLLM's
own work (scheduler, forward passes, sampling, its output processor, detokenisation), so
the tokens/s a batch reaches through it is the most the package can carry
(``benchmarks/bench_ceiling.py``).

Examples:
    >>> from torchrl_vllm_ext import VLLMService
    >>> from torchrl_vllm_ext.testing import make_tiny_model
    >>> with VLLMService.launch(
    ...     make_tiny_model(), engine_cls=INSTANT_ENGINE
    ... ) as svc:  # doctest: +SKIP
    ...     batch = svc.generate_request_batch([[1, 2, 3]], {"max_tokens": 4})
    ...     batch.token_ids.tolist()
    [3, 4, 5, 6]
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from torchrl_vllm_ext._compat import EngineLimits, PauseMode, SchedulerLoad, vllm_output_types
from torchrl_vllm_ext.engine.outputs import to_request_output
from torchrl_vllm_ext.engine.replica.engine import Engine
from torchrl_vllm_ext.errors import ConfigurationError
from torchrl_vllm_ext.messages import RequestData, SampleData

INSTANT_ENGINE = f"{__name__}.InstantEngine"
"""``ServiceConfig.engine_cls`` of a service whose replicas answer at once."""
FIRST_TOKEN = 3  # past the tiny tokenizer's special tokens


class InstantEngine(Engine):
    """Answers each request at once with ``max_tokens`` tokens per sample (ids counting up
    from 3, log-prob -1.0 each), as finished vLLM outputs.

    Args:
        limits: what the replica reports (the model's context and vocabulary).
    """

    def __init__(self, limits: EngineLimits):
        self._limits = limits
        self._version = "0"
        self._samples: dict[tuple[int, int, bool], list] = {}  # precomputed completions

    @classmethod
    async def start(cls, engine_args) -> InstantEngine:
        config = json.loads((Path(engine_args.model) / "config.json").read_text())
        return cls(
            EngineLimits(
                max_model_len=int(
                    engine_args.max_model_len or config.get("max_position_embeddings", 4096)
                ),
                max_token_id=int(config.get("vocab_size", 32000)) - 1,
                kv_capacity_tokens=1 << 24,
                dtype=str(config.get("torch_dtype") or config.get("dtype") or "float32"),
            )
        )

    @property
    def limits(self) -> EngineLimits:
        return self._limits

    @property
    def errored(self) -> bool:
        return False

    async def generate(
        self,
        inputs: Sequence[dict],
        params: Sequence[Any],
        request_ids: Sequence[str],
        lora_request: Any = None,
    ) -> list:
        RequestOutput = vllm_output_types().RequestOutput
        outputs = [
            RequestOutput(
                request_id=rid,
                prompt=None,
                prompt_token_ids=inp["prompt_token_ids"],
                prompt_logprobs=None,
                outputs=self._completions(p),
                finished=True,
            )
            for inp, p, rid in zip(inputs, params, request_ids, strict=True)
        ]
        await asyncio.sleep(0)  # one turn of the loop, as an engine's answer takes
        return outputs

    def _completions(self, params) -> list:
        """The samples of a request with these parameters (built once per shape)."""
        n, logprobs = int(params.n), params.logprobs is not None
        length = int(params.max_tokens or 16)
        key = (length, n, logprobs)
        if key not in self._samples:
            ids = FIRST_TOKEN + np.arange(length) % (self._limits.max_token_id - FIRST_TOKEN)
            sample = SampleData(
                token_ids=ids.astype(np.int64),
                logprobs=np.full(length, -1.0, np.float32) if logprobs else None,
                finish_reason="length",
                stop_reason=None,
                text="",
            )
            data = RequestData(
                prompt_token_ids=np.zeros(0, np.int64),
                prompt_logprobs=None,
                samples=[sample] * n,
                replica_id=-1,
                weight_version_start="0",
                weight_version_end="0",
            )
            self._samples[key] = to_request_output(data, "template", flat_logprobs=True).outputs
        return self._samples[key]

    async def add_lora(self, lora_request) -> bool:
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        return True

    async def list_loras(self) -> set[int]:
        return set()

    async def abort(self, request_ids: Sequence[str]) -> None:
        return None

    async def _pause(self, mode: PauseMode, clear_cache: bool) -> None:
        return None

    async def resume(self) -> None:
        return None

    async def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None):
        raise ConfigurationError(
            f"InstantEngine has no vLLM workers to run {method!r} on: it stands in for "
            "generation only (launch without engine_cls to push weights)."
        )

    async def tokens_so_far(self, request_ids: Sequence[str]) -> dict[tuple[str, int], int]:
        return {}

    def load(self) -> SchedulerLoad:
        return SchedulerLoad(0, 0, 0.0)

    async def reset_prefix_cache(self) -> bool:
        return True

    async def set_weight_version(self, version: str) -> None:
        self._version = version

    async def get_weight_version(self) -> str:
        return self._version

    async def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        self._samples.clear()


__all__ = ["INSTANT_ENGINE", "InstantEngine"]

"""The engine interface of a replica: one small set of calls, one adapter per engine kind.

:class:`~torchrl_vllm_ext.engine.replica.VLLMReplica` talks to its engine only through
:class:`Engine`, so it has no branch on the engine kind:

- :class:`~torchrl_vllm_ext.engine.inproc.InprocEngine`: vLLM's ``LLMEngine`` stepped by a
  thread of the actor (CPU replicas with one worker: no engine-core process, no IPC per step);
- :class:`~torchrl_vllm_ext.engine.async_engine.AsyncEngine`: vLLM's ``AsyncLLM`` with its
  engine-core process (GPU and tensor/pipeline-parallel replicas).

Both give the same tokens and log-probs. Pause modes are vLLM's (``abort`` / ``wait`` /
``keep``) and are checked here, once, for both.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

from torchrl_vllm_ext._compat import PAUSE_MODES, EngineLimits, PauseMode, SchedulerLoad
from torchrl_vllm_ext.errors import ConfigurationError


def check_pause_mode(mode: str) -> PauseMode:
    """``mode`` if it is one of vLLM's pause modes; a typed error naming them otherwise.

    The one check of a pause mode, wherever one enters (service, scheme, replica, engine).

    Examples:
        >>> check_pause_mode("keep")
        'keep'
        >>> check_pause_mode("freeze")
        Traceback (most recent call last):
        ...
        torchrl_vllm_ext.errors.ConfigurationError: pause mode 'freeze' is not one of vLLM's ('abort', 'wait', 'keep'): 'abort' ends in-flight requests, 'wait' lets them finish, 'keep' freezes them until resume.
    """
    if mode not in PAUSE_MODES:
        raise ConfigurationError(
            f"pause mode {mode!r} is not one of vLLM's {PAUSE_MODES}: 'abort' ends in-flight "
            "requests, 'wait' lets them finish, 'keep' freezes them until resume."
        )
    return mode


class Engine(abc.ABC):
    """A started vLLM v1 engine, as a replica uses it. Build one with :meth:`start`.

    Examples:
        >>> from vllm.engine.arg_utils import AsyncEngineArgs
        >>> engine = await engine_class(in_process=True).start(
        ...     AsyncEngineArgs(model=model_dir, dtype="float32")
        ... )  # doctest: +SKIP
        >>> await engine.pause("keep"); await engine.resume()  # doctest: +SKIP
    """

    @classmethod
    @abc.abstractmethod
    async def start(cls, engine_args) -> Engine:
        """Build the engine from ``vllm.AsyncEngineArgs`` on the running event loop."""

    @property
    @abc.abstractmethod
    def limits(self) -> EngineLimits:
        """Context length, largest token id and KV-cache capacity."""

    @property
    @abc.abstractmethod
    def errored(self) -> bool:
        """Whether the engine is gone (every later call raises vLLM's ``EngineDeadError``)."""

    @abc.abstractmethod
    async def generate(
        self,
        inputs: Sequence[dict],
        params: Sequence[Any],
        request_ids: Sequence[str],
        lora_request: Any = None,
    ) -> list:
        """Run a batch of requests; their final vLLM ``RequestOutput``s, in order.

        ``lora_request``: the vLLM ``LoRARequest`` every request of the batch uses (None:
        the base weights). A request vLLM rejects raises and leaves none of the batch in
        the engine. Cancelling the caller does not abort the requests: call :meth:`abort`.
        """

    @abc.abstractmethod
    async def add_lora(self, lora_request) -> bool:
        """Load a LoRA adapter (vLLM ``LoRARequest``)."""

    @abc.abstractmethod
    async def remove_lora(self, lora_id: int) -> bool:
        """Unload the adapter with vLLM id ``lora_id``."""

    @abc.abstractmethod
    async def list_loras(self) -> set[int]:
        """The vLLM ids of the loaded adapters."""

    @abc.abstractmethod
    async def abort(self, request_ids: Sequence[str]) -> None:
        """Abort requests by id (idempotent; unknown ids are ignored)."""

    async def pause(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """Stop scheduling: ``abort`` in-flight requests, ``wait`` for them, or ``keep`` them
        frozen; requests sent while paused start on :meth:`resume`."""
        await self._pause(check_pause_mode(mode), clear_cache)

    @abc.abstractmethod
    async def _pause(self, mode: PauseMode, clear_cache: bool) -> None: ...

    @abc.abstractmethod
    async def resume(self) -> None:
        """Resume scheduling after :meth:`pause`."""

    async def sleep(self, level: int, mode: PauseMode) -> None:
        """Free accelerator memory (vLLM sleep mode): level 1 offloads the weights to host
        memory and drops the KV cache; level 2 drops both (push weights after waking)."""
        raise self._no_sleep_mode()

    async def wake_up(self, tags: list[str] | None) -> None:
        """Restore what :meth:`sleep` freed: all of it, or only ``tags`` (``weights``,
        ``kv_cache``); scheduling resumes once everything is awake."""
        raise self._no_sleep_mode()

    def _no_sleep_mode(self) -> ConfigurationError:
        return ConfigurationError(
            f"{type(self).__name__} has no sleep mode: it needs GPU replicas launched with "
            "enable_sleep_mode=True (vLLM's AsyncLLM; vLLM-CPU has no sleep mode)."
        )

    async def is_sleeping(self) -> bool:
        return False

    @abc.abstractmethod
    async def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None):
        """Call a worker(-extension) method on every worker; one result per worker."""

    @abc.abstractmethod
    async def tokens_so_far(self, request_ids: Sequence[str]) -> dict[tuple[str, int], int]:
        """Tokens each sample of these in-flight requests has generated so far, keyed
        ``(request id, sample index)`` (requests not started or finished are absent)."""

    @abc.abstractmethod
    def load(self) -> SchedulerLoad:
        """Running / waiting requests and KV-cache usage, from vLLM's scheduler."""

    @abc.abstractmethod
    async def reset_prefix_cache(self) -> bool:
        """Drop the prefix cache (after a weight update)."""

    @abc.abstractmethod
    async def set_weight_version(self, version: str) -> None:
        """Label the served weights (vLLM's weight version)."""

    @abc.abstractmethod
    async def get_weight_version(self) -> str: ...

    @abc.abstractmethod
    async def check_health(self) -> None:
        """Raise if the engine is gone."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop the engine and its processes or threads."""


def engine_class(in_process: bool) -> type[Engine]:
    """The adapter of an engine kind (imported lazily: each pulls in vLLM)."""
    if in_process:
        from torchrl_vllm_ext.engine.inproc import InprocEngine

        return InprocEngine
    from torchrl_vllm_ext.engine.async_engine import AsyncEngine

    return AsyncEngine

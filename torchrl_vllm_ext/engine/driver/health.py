"""HealthChecks: every ready replica pinged every ``health_check_interval`` seconds.

A ping goes through the pool's fan-out, so a replica found dead meets the one death
policy (recorded, restarted). A part of
:class:`~torchrl_vllm_ext.engine.driver.pool.ReplicaPool`; it owns its background task.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from torchrl_vllm_ext.engine.calls import Outcomes
from torchrl_vllm_ext.engine.config import ServiceConfig

logger = logging.getLogger(__name__)


class HealthChecks:
    """Pings the ready replicas, now or periodically.

    Args:
        config: ``health_check_interval`` (0: no periodic check) and
            ``health_check_timeout``.
        call_all: the pool's ``call_all`` (its death policy applies).
    """

    def __init__(self, config: ServiceConfig, call_all: Callable[..., Awaitable[Outcomes]]):
        self.config = config
        self._call_all = call_all
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Check every ``health_check_interval`` seconds from now on (on the loop)."""
        if self.config.health_check_interval > 0 and self._task is None:
            self._task = asyncio.ensure_future(self._every_interval())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _every_interval(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_check_interval)
            await self.check()

    async def check(self) -> dict[int, bool]:
        """Ping every ready replica; the dead are restarted. ``{replica_id: healthy}``."""
        out = await self._call_all("check_health", timeout=self.config.health_check_timeout)
        for rid, error in out.errors.items():
            logger.warning("health check of replica %d failed: %r", rid, error)
        return {
            rid: out.results.get(rid) is True
            for rid in sorted({*out.results, *out.errors, *out.dead})
        }


__all__ = ["HealthChecks"]

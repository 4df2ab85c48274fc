"""StandInPool: a :class:`~torchrl_vllm_ext.engine.driver.pool.ReplicaPool` that serves
actors started elsewhere (stand-in actors in unit tests: no Ray, no vLLM).

The product's pool starts every replica it serves; tests of its labels, admission and
death policy, and of a weight-sync scheme over it, hand it stand-ins instead
(:meth:`StandInPool.adopt`). The pool does not own them: stopping one forgets it (no
shutdown call, no Ray kill, no placement group), and a restart after a death starts a
replica of the pool's own in its place, as in the product.
"""

from __future__ import annotations

import itertools
from typing import Any

from torchrl_vllm_ext.engine.config import ServiceConfig
from torchrl_vllm_ext.engine.driver.launcher import ReplicaLauncher
from torchrl_vllm_ext.engine.driver.pool import ReplicaPool
from torchrl_vllm_ext.engine.driver.records import Record
from torchrl_vllm_ext.engine.fleet import ReplicaState, ReplicaView


class _StandInLauncher(ReplicaLauncher):
    """Stops the adopted stand-ins by forgetting them; everything else as the product's."""

    def __init__(self, config: ServiceConfig):
        super().__init__(config)
        self.adopted: list[Any] = []  # the stand-in actors (compared by identity)

    async def stop(self, rid: int, actor: Any, pg: Any, graceful: bool = True) -> None:
        if any(actor is stand_in for stand_in in self.adopted):
            self.adopted = [a for a in self.adopted if a is not actor]
            return
        await super().stop(rid, actor, pg, graceful)


class StandInPool(ReplicaPool):
    """A pool whose ready replicas are stand-ins given by the test.

    Examples:
        >>> from torchrl_vllm_ext.messages import ReplicaInfo
        >>> from torchrl_vllm_ext.testing import make_tiny_model
        >>> pool = StandInPool(ServiceConfig(model=make_tiny_model()), "svc")
        >>> pool.adopt(ReplicaView(0, object(), ReplicaInfo(0, 1, "127.0.0.1", 256, 100, 64)))
        >>> [v.replica_id for v in pool.ready()], pool.limits.max_model_len
        ([0], 256)
    """

    def __init__(self, config: ServiceConfig, name: str):
        super().__init__(config, name)
        self.launcher = _StandInLauncher(config)

    def adopt(self, replica: ReplicaView) -> None:
        """Serve ``replica`` (its handle a stand-in actor) as a ready replica."""
        rec = Record(replica.replica_id, pg=None, node=replica.node)
        rec.actor, rec.info = replica.handle, replica.info
        self.launcher.adopted.append(replica.handle)
        self.records.add(rec)
        self._ids = itertools.count(max(r.replica_id for r in self.records.all()) + 1)
        if self._limits is None:
            self._limits = replica.info
        self.records.set_state(rec, ReplicaState.READY)


__all__ = ["StandInPool"]

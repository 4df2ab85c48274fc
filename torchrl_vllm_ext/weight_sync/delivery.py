"""Delivery: a push from its transfer on, as one value the scheme's delivery is given.

The scheme's own push (``WeightSyncScheme.apush``) builds one after validating; a push
whose bytes were made ready elsewhere (a sharded trainer's ranks: :mod:`.sharded`) builds
its own, with the steps its ranks took, and hands it to ``apush_prepared``. Either way
the scheme transfers, pauses and loads, checks and commits (steps 2 to 5 of
:mod:`.scheme`), and its report covers the whole push: ``seconds`` from :attr:`start`,
:attr:`phases` first among its phases.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from torchrl_vllm_ext.weight_sync.transports.protocol import Prepared, Replicas
from torchrl_vllm_ext.weight_sync.verify import TimedReference


@dataclass(frozen=True)
class Delivery:
    """A push from its transfer on: what it sends, how, and what was done before.

    Examples:
        >>> async def prepare(replicas):
        ...     return Prepared()
        >>> push = Delivery("3", 1024, prepare, phases={"validate": 0.01})
        >>> asyncio.run(push.taken_reference()) is None
        True
    """

    version: str
    """The version the push installs."""
    nbytes: int
    """Bytes of the pushed weights (the replicas' load deadline is sized by them)."""
    prepare: Callable[[Replicas], Awaitable[Prepared]]
    """The transfer step (a transport's ``prepare``), given the replicas ready now."""
    reference: TimedReference | Awaitable[TimedReference] | None = None
    """The value check's reference: computed already (a sharded trainer's ranks), being
    computed beside the transfer, or None (this push is not checked)."""
    phases: Mapping[str, float] = field(default_factory=dict)
    """Seconds of the steps before the transfer (``validate``; a sharded push's
    ``agree``, ``reference``, ``ranks_write``)."""
    start: float = field(default_factory=time.perf_counter)
    """When the push began (``time.perf_counter``): its report's ``seconds`` count from it."""

    async def taken_reference(self) -> TimedReference | None:
        """The reference, once computed (None: this push is not checked)."""
        if self.reference is None or isinstance(self.reference, TimedReference):
            return self.reference
        return await self.reference

    async def drop_reference(self) -> None:
        """Wait out a reference still being computed, its outcome dropped: the push failed
        before it was needed (its thread ends before the next push starts one)."""
        if self.reference is not None and not isinstance(self.reference, TimedReference):
            await asyncio.gather(self.reference, return_exceptions=True)

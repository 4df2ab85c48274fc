"""Admission: what a started replica is brought to, and whether it then takes traffic.

A (re)started replica's engine holds the checkpoint, labelled as the checkpoint. Before it
takes traffic it is given what the service serves: the live adapters (the
:meth:`Admission.before_traffic` steps), the live weights (the weights provider: the
scheme that pushed last) and the service's pause and sleep
(:func:`~torchrl_vllm_ext.engine.serving.restart_steps`). It is then ``READY`` if it
holds the live weights (:class:`~torchrl_vllm_ext.engine.labels.WeightLabels`), else
``HELD`` out of traffic until a push brings it there (or ``READY`` under the checkpoint's
label with ``allow_mixed_versions``). Admission owns the facts that decide it: the labels,
the provider, the service's pause and sleep state, and the hooks run when the service
serves again. A part of :class:`~torchrl_vllm_ext.engine.driver.pool.ReplicaPool`; runs
on the service's event loop.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from torchrl_vllm_ext.engine.config import ServiceConfig
from torchrl_vllm_ext.engine.driver.records import Record, ReplicaRecords
from torchrl_vllm_ext.engine.fleet import ReplicaState, ReplicaView, WeightsProvider
from torchrl_vllm_ext.engine.labels import WeightLabels
from torchrl_vllm_ext.engine.serving import ServingState, restart_steps

logger = logging.getLogger(__name__)

BringUpStep = Callable[[ReplicaView], Awaitable[Any]]
ServingHook = Callable[[tuple[ReplicaView, ...]], Awaitable[Any]]
Died = Callable[[ReplicaView, BaseException, str], Any]


class Admission:
    """Brings started replicas to the service and decides whether each takes traffic.

    Args:
        config: the service's configuration (``weight_version``, ``allow_mixed_versions``).
        records: the pool's records (a decision sets a record's state).

    Examples:
        >>> from torchrl_vllm_ext.testing import make_tiny_model
        >>> admission = Admission(ServiceConfig(model=make_tiny_model()), ReplicaRecords())
        >>> admission.labels.live, admission.provider, admission.serving.serving
        ('0', None, True)
    """

    def __init__(self, config: ServiceConfig, records: ReplicaRecords):
        self.config = config
        self._records = records
        self.labels = WeightLabels.at_launch(config.weight_version)
        """The live version, the checkpoint's label, and which weights the live one names
        (:mod:`~torchrl_vllm_ext.engine.labels`): what a started replica holds and serves."""
        self.provider: WeightsProvider | None = None
        """Brings started replicas to the live weights (the scheme that pushed last)."""
        self.serving = ServingState()
        """The service's pause and sleep (``Control`` sets it): a restarted replica is
        brought to the same state before it counts as ready."""
        self._bring_up_steps: list[BringUpStep] = []
        self._serving_hooks: list[ServingHook] = []

    # ------------------------------------------------------------------ hooks
    def before_traffic(self, step: BringUpStep) -> None:
        """Await ``step(replica)`` on every started replica before it takes traffic (after
        its engine is up, before the weights provider)."""
        self._bring_up_steps.append(step)

    def when_serving(self, hook: ServingHook) -> Callable[[], None]:
        """Await ``hook(ready replicas)`` each time the service serves again after a pause
        or a sleep (a push's deferred value check); returns the function that removes it."""
        self._serving_hooks.append(hook)
        return lambda: self._serving_hooks.remove(hook) if hook in self._serving_hooks else None

    async def serving_again(self) -> None:
        """Run the :meth:`when_serving` hooks, if the service now serves (``Control``
        calls it after resume and wake-up)."""
        if self.serving.serving:
            for hook in list(self._serving_hooks):
                await hook(self._records.ready())

    # ------------------------------------------------------------------ a started replica
    async def bring_to_service(self, view: ReplicaView) -> str | None:
        """Bring a started replica (it holds the checkpoint, under the checkpoint's label)
        to the live adapters, the live weights and the service's pause and sleep; returns
        the version the provider loaded (None: none, it still holds the checkpoint)."""
        for step in self._bring_up_steps:  # adapters, before it takes traffic
            await step(view)
        state, actor = self.serving, view.handle
        loaded = None
        for step in restart_steps(state):
            if step == "bring_up":
                provider = self.provider
                if provider is not None and provider.version is not None:
                    loaded = await provider.bring_up(view)
            elif step == "sleep":
                await actor.sleep.remote(state.sleep_level, "abort")
            elif step == "wake_weights":
                await actor.wake_up.remote(["weights"])
            else:  # "pause"
                await actor.pause.remote(*state.paused)
        return loaded

    def admit(self, rec: Record, loaded: str | None) -> None:
        """A started replica that loaded ``loaded`` takes traffic if it holds the live
        weights (or the service allows mixed versions); else it is held out of it, unless no
        replica serves the live version any more: then the checkpoint is the live version."""
        labels, mixed = self.labels, self.config.allow_mixed_versions
        rec.holds = loaded
        label = labels.label_of(loaded)
        decision = labels.admit(loaded, mixed, live_served=bool(self._records.ready()))
        if decision == "ready":
            self._records.set_state(rec, ReplicaState.READY)
        elif decision == "fall_back":
            self._fall_back(rec)
        elif decision == "mixed":
            logger.warning(
                "replica %d serves weight version %r beside the live version %r "
                "(allow_mixed_versions=True): its samples say so",
                rec.replica_id,
                label,
                labels.live,
            )
            self._records.set_state(rec, ReplicaState.READY)
        else:
            logger.warning(
                "replica %d holds weight version %r, not the live version %r, and no "
                "weight-sync scheme can bring it there: it takes no requests until a push "
                "does (launch with allow_mixed_versions=True to let it serve under its own "
                "label)",
                rec.replica_id,
                label,
                labels.live,
            )
            self._records.set_state(rec, ReplicaState.HELD)

    def _fall_back(self, rec: Record) -> None:
        """No replica serves the live version any more: the checkpoint, which ``rec`` and
        the held replicas hold, becomes the live version under its own label."""
        logger.warning(
            "no replica serves weight version %r any more (each started since when no "
            "weight-sync scheme could bring it there): the service serves the checkpoint's "
            "weights under their label %r now",
            self.labels.live,
            self.labels.checkpoint,
        )
        self.labels = self.labels.fallen_back()
        for other in [rec, *self._records.all()]:
            if other is rec or (other.state is ReplicaState.HELD and other.holds is None):
                other.state = ReplicaState.READY
        self._records.publish()

    # ------------------------------------------------------------------ the live weights
    def set_provider(self, provider: WeightsProvider | None) -> bool:
        """Make ``provider`` bring started replicas to the live weights (None: nobody);
        True if it has a version (a push committed it) and held replicas wait for it
        (:meth:`release_held` brings them there)."""
        self.provider = provider
        if provider is None or provider.version is None:
            return False
        self.labels = self.labels.pushed(provider.version)
        self._records.publish()
        return any(r.state is ReplicaState.HELD for r in self._records.all())

    def relabel(self, version: str) -> None:
        """Every ready replica's weights are labelled ``version`` from now on (the caller
        labels them); no provider brings started replicas to them any more."""
        self.labels = self.labels.relabelled(version)
        self.provider = None
        self._records.publish()

    async def release_held(self, provider: WeightsProvider, died: Died) -> None:
        """Bring every held replica to ``provider``'s version (after the push that made it
        the provider: its bring-up waits on the push lock); each then takes traffic. One
        that fails goes to ``died(view, error, what)``: the pool's death policy."""
        for rec in [r for r in self._records.all() if r.state is ReplicaState.HELD]:
            view = rec.view()
            try:
                loaded = await provider.bring_up(view)
            except Exception as e:  # dead, or the load failed: restarted, as a death
                died(view, e, "its bring-up to the live version")
                continue
            if rec.state is ReplicaState.HELD and self._records.get(rec.replica_id) is rec:
                self.admit(rec, loaded)

    def restart_note(self) -> str:
        """What a restarted replica will serve, for the death's error message."""
        provider = self.provider
        return self.labels.restart_note(
            provider is not None and provider.version is not None,
            self.config.allow_mixed_versions,
        )


__all__ = ["Admission"]

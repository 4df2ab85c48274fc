"""Weight labels: a replica never serves under a version whose weights it does not hold.

A replica's engine starts holding the checkpoint's weights. The weights provider (the
weight-sync scheme that pushed last) then brings it to the live version; once that scheme
closed, or the live label was set by hand over pushed weights, nothing can. The pool keeps
one :class:`WeightLabels` to know, for every replica it starts (a restart, an added
replica), what it holds and under which label, and whether it may take traffic:

- a replica the provider brought to the live version serves it;
- a replica that loaded nothing holds the checkpoint and carries the checkpoint's label
  (``ServiceConfig.weight_version``, or what ``set_weight_version`` named while nothing
  was pushed); it serves when the live weights are the checkpoint's, else it is held out
  of traffic (``ReplicaState.HELD``) until a push brings it to the live version, unless the
  service allows mixed versions (``ServiceConfig.allow_mixed_versions``): then it serves
  the checkpoint under the checkpoint's label beside the others;
- when no replica serves the live version any more (every one restarted since the scheme
  closed), the live label follows what the replicas hold: the service serves the
  checkpoint under the checkpoint's label, and a push works as on a fresh service.

Plain data and functions, unit-tested without vLLM (tests/unit/test_labels.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Literal

from torchrl_vllm_ext.engine.fleet import ReplicaState
from torchrl_vllm_ext.errors import NoHealthyReplicaError

Admission = Literal["ready", "mixed", "held", "fall_back"]
"""What the pool does with a started replica: serve (it holds the live weights), serve under
its own label (mixed versions allowed), hold it out of traffic, or make the checkpoint it
holds the live version (no replica serves the live one any more)."""


@dataclass(frozen=True)
class WeightLabels:
    """The service's live version, the checkpoint's label, and which weights the live one names.

    Examples:
        >>> labels = WeightLabels.at_launch("0")
        >>> labels.holds_live(None)  # a replica that loaded nothing holds the checkpoint
        True
        >>> labels = labels.pushed("3")
        >>> labels.holds_live(None), labels.holds_live("3"), labels.label_of(None)
        (False, True, '0')
        >>> labels.relabelled("v3").checkpoint  # the label names the pushed weights
        '0'
    """

    live: str
    """The version every replica that takes traffic serves (``service.weight_version``)."""
    checkpoint: str
    """The label of the checkpoint's weights: what a replica whose engine just started
    holds, and is labelled with until a provider loads the live version into it."""
    live_is_checkpoint: bool = True
    """Whether the live version names the checkpoint's weights (nothing pushed since launch;
    labels set by hand only). Never true again after a push: a push's weights are known
    only to the scheme that pushed them."""

    @classmethod
    def at_launch(cls, version: str) -> WeightLabels:
        """A fresh service: every replica serves the checkpoint under ``version``."""
        return cls(str(version), str(version))

    def pushed(self, version: str) -> WeightLabels:
        """A push committed ``version``: the live weights are pushed ones."""
        return replace(self, live=str(version), live_is_checkpoint=False)

    def relabelled(self, version: str) -> WeightLabels:
        """Every ready replica relabelled ``version``, keeping its weights: the checkpoint's
        label follows while the live weights are the checkpoint's."""
        version = str(version)
        checkpoint = version if self.live_is_checkpoint else self.checkpoint
        return replace(self, live=version, checkpoint=checkpoint)

    def label_of(self, loaded: str | None) -> str:
        """The label of a started replica that loaded ``loaded`` (None: nothing, the
        checkpoint)."""
        return self.checkpoint if loaded is None else str(loaded)

    def holds_live(self, loaded: str | None) -> bool:
        """Whether a started replica that loaded ``loaded`` (None: nothing) holds the live
        weights."""
        if loaded is None:
            return self.live_is_checkpoint
        return str(loaded) == self.live

    def admit(self, loaded: str | None, allow_mixed: bool, live_served: bool) -> Admission:
        """What becomes of a started replica that loaded ``loaded`` (None: nothing, it
        holds the checkpoint), ``live_served``: whether another replica serves the live
        version.

        Examples:
            >>> labels = WeightLabels.at_launch("0").pushed("3")
            >>> labels.admit("3", False, True), labels.admit(None, True, True)
            ('ready', 'mixed')
            >>> labels.admit(None, False, True), labels.admit(None, False, False)
            ('held', 'fall_back')
        """
        if self.holds_live(loaded):
            return "ready"
        if allow_mixed:
            return "mixed"
        if loaded is None and not live_served:
            return "fall_back"
        return "held"

    def fallen_back(self) -> WeightLabels:
        """No replica serves the live version: the checkpoint's weights, under its label,
        are the live ones."""
        return WeightLabels.at_launch(self.checkpoint)

    def restart_note(self, can_bring_up: bool, allow_mixed: bool) -> str:
        """What a replica (re)started now will serve, for logs and errors."""
        if can_bring_up or self.live_is_checkpoint:
            return f"at weight version {self.live}"
        where = (
            "and serves them under that label beside version "
            if allow_mixed
            else "and takes no requests until a push brings it to version "
        )
        return (
            f"with the checkpoint's weights (labelled {self.checkpoint!r}) {where}{self.live!r} "
            "(no weight-sync scheme can bring it there: the one that pushed it is closed)"
        )


def held_refusal(
    service: str, states: Mapping[int, ReplicaState], live: str
) -> NoHealthyReplicaError | None:
    """The error a request gets at once when no replica serves and some are held (nothing
    is starting that could serve later); None otherwise.

    Examples:
        >>> held_refusal("svc", {0: ReplicaState.HELD}, "3")  # doctest: +ELLIPSIS
        NoHealthyReplicaError("service svc has no replica serving weight version '3': ...")
        >>> held_refusal("svc", {0: ReplicaState.HELD, 1: ReplicaState.STARTING}, "3") is None
        True
    """
    held = sorted(rid for rid, state in states.items() if state is ReplicaState.HELD)
    waiting = (ReplicaState.STARTING, ReplicaState.DEAD, ReplicaState.READY)
    if not held or any(state in waiting for state in states.values()):
        return None
    return NoHealthyReplicaError(
        f"service {service} has no replica serving weight version {live!r}: replicas {held} "
        "started when no weight-sync scheme could bring them to it (the one that pushed it "
        "closed, or set_weight_version relabelled pushed weights), so they hold the "
        "checkpoint's weights and are held out of traffic (state 'held'). Push again (a new "
        "WeightSyncScheme brings them to its version), or launch the service with "
        "allow_mixed_versions=True to let them serve the checkpoint under its own label."
    )


__all__ = ["WeightLabels", "held_refusal"]

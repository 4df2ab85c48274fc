"""TorchRLPushes: the one adapter between TorchRL's push entry points and a scheme, and the
one place a push's version is decided when the caller does not give it.

TorchRL reaches a scheme four ways, each a thin face over :class:`TorchRLPushes`:

- the scheme's own TorchRL sender hooks (``init_on_sender`` / ``connect`` / ``send``: a
  collector given ``weight_sync_schemes=``): :class:`~.scheme_contract.SchemeContract`;
- :class:`~torchrl_vllm_ext.collectors.updater.WeightSyncUpdater` (``weight_updater=``,
  ``collector.update_policy_weights_``);
- the service's ``RLvLLMEngine`` weight calls (``vLLMUpdaterV2(service)``):
  :class:`~.engine_updates.EngineUpdates`;
- TorchRL's scheme-and-sender shape (``create_sender().update_weights()``):
  :class:`~.script_scheme.ServiceSender`, over the engine calls.

A collector that tracks its policy version moves to ``policy_version + 1`` after the push
(TorchRL increments after it), so the push is served as that; without one, the version
after the one served (the next integer), or for a non-integer label the count of this
scheme's TorchRL pushes + 1. One counter: the adapter's.
"""

from __future__ import annotations

from collections.abc import Callable

from torchrl_vllm_ext.errors import ConfigurationError


def next_version(current: str, pushes: int) -> str:
    """The version after the engine's ``current``: the next integer, or (a non-integer
    label) the count of pushes made so far + 1.

    Examples:
        >>> next_version("0", 0), next_version("41", 3), next_version("sft", 2)
        ('1', '42', '3')
    """
    return str(int(current) + 1) if current.isdigit() else str(pushes + 1)


def tracked_version(collector) -> int | None:
    """The policy version a collector tracks (None: it tracks none, or there is none);
    a typed error for one a push cannot follow (UUID versions).

    Examples:
        >>> tracked_version(None) is None
        True
    """
    current = getattr(collector, "policy_version", None) if collector is not None else None
    if current is None:
        return None
    if isinstance(current, bool) or not isinstance(current, int):
        raise ConfigurationError(
            f"the collector's policy version is {current!r}; pushes need integer versions to "
            "serve the next one: use track_policy_version=True (not a "
            "PolicyVersion(version_type='uuid'))."
        )
    return current


class TorchRLPushes:
    """A scheme's pushes from TorchRL: the version each is served as, and one counter.

    Args:
        push: ``push(weights, version) -> SyncReport`` (the scheme's).
        current: the version the replicas serve now (the scheme's, else the service's).

    Examples:
        >>> served = []
        >>> pushes = TorchRLPushes(lambda w, v: served.append(v) or v, lambda: "0")
        >>> pushes.push("weights"), pushes.push("weights", policy_version=6)
        ('1', '7')
        >>> pushes.count
        2
    """

    def __init__(self, push: Callable, current: Callable[[], str]):
        self._push = push
        self._current = current
        self.count = 0
        """TorchRL pushes made through this adapter."""

    def next_version(self, policy_version: int | None = None) -> str:
        """The version the next push is served as (``policy_version``: the collector's)."""
        if policy_version is not None:
            return str(policy_version + 1)
        return next_version(self._current(), self.count)

    def push(self, weights, policy_version: int | None = None):
        """Push ``weights`` as :meth:`next_version`; blocks; the scheme's report."""
        report = self._push(weights, self.next_version(policy_version))
        self.count += 1
        return report


__all__ = ["TorchRLPushes", "next_version", "tracked_version"]

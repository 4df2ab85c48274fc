"""Which version a push is served as, when the caller does not say: one rule for TorchRL's
collectors (``WeightSyncUpdater``, the scheme's ``send``) and engine calls (``update_weights``)."""

from __future__ import annotations

from torchrl_vllm_ext.errors import ConfigurationError


def next_version(current: str, pushes: int) -> str:
    """The version after the engine's ``current``: the next integer, or (a non-integer
    label) the count of pushes made by the caller.

    Examples:
        >>> next_version("0", 0), next_version("41", 3), next_version("sft", 2)
        ('1', '42', '3')
    """
    return str(int(current) + 1) if current.isdigit() else str(pushes + 1)


def collector_next_version(collector, pushes: int) -> int:
    """The version a collector is about to move to: its ``policy_version + 1`` (TorchRL's
    collectors increment after the push), or the caller's push count + 1 when it tracks
    no version.

    Examples:
        >>> collector_next_version(None, 4)
        5
    """
    current = getattr(collector, "policy_version", None) if collector is not None else None
    if current is None:
        return pushes + 1
    if isinstance(current, bool) or not isinstance(current, int):
        raise ConfigurationError(
            f"the collector's policy version is {current!r}; pushes need integer versions to "
            "serve the next one: use track_policy_version=True (not a "
            "PolicyVersion(version_type='uuid'))."
        )
    return current + 1


__all__ = ["collector_next_version", "next_version"]

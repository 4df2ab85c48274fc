"""Which transport a scheme builds, and whether its pushes are deltas: plain functions of
the fleet and the user's arguments (``WeightSyncScheme.__init__`` asks them once)."""

from __future__ import annotations

import ray

from torchrl_vllm_ext.errors import ConfigurationError
from torchrl_vllm_ext.weight_sync.transports import registry


def choose_transport(fleet, requested: str, shared_dir) -> tuple[str, str]:
    """Pick the transport for ``auto``; returns (transport, reason)."""
    if requested not in registry.names():
        raise ConfigurationError(f"transport={requested!r} is not one of {registry.names()}.")
    if requested != "auto":
        return requested, "requested explicitly"
    if fleet.uses_gpu:
        # Where the trainer's tensors are is known at the push: planned then (plan.py).
        return "auto", "planned per replica at each push, by GPU UUID"
    if shared_dir is not None:
        return "storage", f"a shared directory was given ({shared_dir})"
    here = ray.util.get_node_ip_address()
    hosts = {r.node for r in fleet.ready()}
    if hosts <= {here}:
        return "storage", f"the trainer and every replica share host {here}"
    return (
        "broadcast",
        f"replicas on other hosts {sorted(hosts - {here})} and no shared directory: gloo broadcast",
    )


DELTAS = ("auto", True, False)
SIXTEEN_BIT = ("bfloat16", "float16")


def delta_dtype(delta: bool | str, transport: str, served: str) -> str | None:
    """The dtype a scheme's delta pushes compare in (the served one), or None: full pushes.

    Examples:
        >>> delta_dtype("auto", "broadcast", "bfloat16"), delta_dtype("auto", "storage", "float32")
        ('bfloat16', None)
    """
    if delta not in DELTAS:
        raise ConfigurationError(f"delta={delta!r} is not one of {DELTAS}.")
    if delta is False:
        return None
    if transport not in registry.delta_names():
        if delta is True:
            raise ConfigurationError(
                f"delta=True needs a transport that sends deltas {registry.delta_names()}; "
                f"{transport!r} sends every byte. Pass one of those as transport=, or "
                "delta='auto'."
            )
        return None
    if delta == "auto" and served not in SIXTEEN_BIT:
        return None  # float32 serving: a step changes nearly every value
    return served

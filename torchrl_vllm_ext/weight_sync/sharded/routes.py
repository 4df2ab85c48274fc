"""What a sharded push sends and by which route, as plain functions of the scheme's state."""

from __future__ import annotations

from torchrl_vllm_ext.errors import ConfigurationError, WeightSyncError
from torchrl_vllm_ext.weight_sync.specs import TensorSpec
from torchrl_vllm_ext.weight_sync.transports import registry

SHARDED_TRANSPORTS = registry.names(cpu=True, composite=False)
"""The transports a sharded push writes (storage) or streams (broadcast) into: those
that run on CPUs too and are not composed of others."""


def route_for(transport: str, uses_gpu: bool) -> str:
    """The route of a sharded push over a scheme whose transport is ``transport``.

    ``auto`` on CPU replicas has already picked storage or broadcast (the scheme's choice
    stands); on GPU replicas it plans per replica at each push (CUDA IPC of the trainer's
    own buckets), which a trainer whose buckets are gathered bucket by bucket does not
    have yet: the sharded push refuses it by name.

    Examples:
        >>> route_for("storage", True), route_for("broadcast", False)
        ('storage', 'broadcast')
    """
    if transport in SHARDED_TRANSPORTS:
        return transport
    planned = (
        " (planned per replica on GPUs)" if uses_gpu and transport not in SHARDED_TRANSPORTS else ""
    )
    raise ConfigurationError(
        f"a sharded push writes a storage slot or streams a broadcast; the scheme's "
        f"transport is {transport!r}{planned}. Create the scheme on rank 0 with "
        "transport='storage' (one host, or a shared storage_dir) or transport='broadcast'."
    )


def sharded_route(scheme) -> str:
    """:func:`route_for` the scheme's transport."""
    return route_for(scheme.transport_impl.name, scheme.fleet.uses_gpu)


def pushed_names(
    shapes: dict[str, tuple[tuple[int, ...], str]], expected: dict[str, TensorSpec]
) -> list[str]:
    """The names a push of tensors of ``shapes`` ((shape, dtype) by name) sends, in the
    checkpoint's order; a typed error naming the first missing, extra or misshapen one.
    An LM head the checkpoint does not store is its tied input embedding: left out.

    Examples:
        >>> spec = {"w": TensorSpec("w", "float32", (2,))}
        >>> pushed_names({"w": ((2,), "float32"), "lm_head.weight": ((2,), "float32")}, spec)
        ['w']
    """
    missing = [n for n in expected if n not in shapes]
    if missing:
        raise WeightSyncError(
            f"parameter {missing[0]!r} is missing from the pushed weights ({len(missing)} "
            "missing); push the full sharded model with Hugging Face names."
        )
    extra = [n for n in shapes if n not in expected and n != "lm_head.weight"]
    if extra:
        raise WeightSyncError(
            f"parameter {extra[0]!r} is not in the served checkpoint; check the parameter "
            f"names (e.g. {next(iter(expected))!r}) match the model the replicas serve."
        )
    for name, spec in expected.items():
        shape, dtype = shapes[name]
        if tuple(shape) != tuple(spec.shape):
            raise WeightSyncError(
                f"parameter {name!r} has shape {tuple(shape)} but the served model expects "
                f"{tuple(spec.shape)}; push weights of the same architecture."
            )
        if dtype not in ("float32", "bfloat16", "float16"):
            raise WeightSyncError(f"parameter {name!r} has dtype {dtype}; use a floating dtype.")
    return list(expected)

"""What a sharded push sends and through which capability of the scheme's transport, as
plain functions of the scheme's state."""

from __future__ import annotations

from torchrl_vllm_ext.errors import WeightSyncError
from torchrl_vllm_ext.extensions import load_class
from torchrl_vllm_ext.weight_sync.specs import TensorSpec
from torchrl_vllm_ext.weight_sync.transports import registry
from torchrl_vllm_ext.weight_sync.transports.protocol import (
    Streamed,
    Transport,
    WrittenByRanks,
    capability,
)

CAPABILITIES = (WrittenByRanks, Streamed)
"""What a transport must declare to take a sharded push: the ranks write its bytes in
place (storage), or it sends buckets as the ranks gather them (broadcast)."""

SHARDED_TRANSPORTS = tuple(
    name
    for name, info in registry.TRANSPORTS.items()
    if issubclass(load_class(info.sender), CAPABILITIES)
)
"""The registry's transports that take a sharded push: those whose senders declare one of
:data:`CAPABILITIES` (storage and broadcast)."""


def sharded_route(transport: Transport) -> WrittenByRanks | Streamed:
    """``transport`` as the capability a sharded push goes through (written by the ranks
    first); a :class:`~torchrl_vllm_ext.errors.TransportCapabilityError` naming it when it
    declares neither.

    ``auto`` on CPU replicas has already picked storage or broadcast (the scheme's choice
    stands); on GPU replicas it plans per replica at each push (CUDA IPC of the trainer's
    own buckets), which a trainer whose buckets are gathered bucket by bucket does not
    have yet: refused by name.
    """
    choices = " or ".join(f"transport={n!r}" for n in SHARDED_TRANSPORTS)
    return capability(
        transport,
        CAPABILITIES,
        "a sharded push (its ranks write a slot, or stream buckets, themselves)",
        f"Create the scheme on rank 0 with {choices} (storage: one host, or a shared storage_dir).",
    )


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

"""Weight-sync transports: how the bytes reach the replicas (see :mod:`.base`)."""

from torchrl_vllm_ext.weight_sync.transports.base import Replicas, Transport, WorkerCall

__all__ = ["Replicas", "Transport", "WorkerCall", "make_transport"]


def make_transport(name: str, fleet, **options) -> Transport:
    """The transport registered as ``name`` (``storage`` or ``broadcast``)."""
    if name == "storage":
        from torchrl_vllm_ext.weight_sync.transports.storage import StorageTransport

        return StorageTransport(
            fleet, storage_dir=options.get("storage_dir"), deadline=options.get("deadline")
        )
    if name == "broadcast":
        from torchrl_vllm_ext.weight_sync.transports.broadcast import BroadcastTransport

        return BroadcastTransport(
            fleet, bucket_bytes=options["bucket_bytes"], deadline=options.get("deadline")
        )
    raise ValueError(f"no transport named {name!r}")

"""Weight-sync transports: how the bytes reach the replicas (see :mod:`.base`)."""

from torchrl_vllm_ext.weight_sync.transports.base import Replicas, Transport, WorkerCall

__all__ = ["Replicas", "Transport", "WorkerCall", "make_transport"]


def make_transport(name: str, fleet, **options) -> Transport:
    """The transport registered as ``name``: ``storage``, ``broadcast``, ``ipc``, or ``auto``
    (planned per replica by device: GPU replicas)."""
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
    if name == "ipc":
        from torchrl_vllm_ext.weight_sync.transports.ipc import IpcTransport

        return IpcTransport(fleet, options["bucket_bytes"], options.get("deadline"))
    if name == "auto":
        from torchrl_vllm_ext.weight_sync.transports.planned import PlannedTransport

        return PlannedTransport(
            fleet, options["bucket_bytes"], options.get("deadline"), options.get("storage_dir")
        )
    raise ValueError(f"no transport named {name!r}")

"""Weight-sync transports: how the bytes reach the replicas (see :mod:`.base`)."""

from torchrl_vllm_ext.weight_sync.transports.base import Replicas, Transport, WorkerCall, fan_out

__all__ = ["Replicas", "Transport", "WorkerCall", "fan_out", "make_transport"]


def make_transport(name: str, service, **options) -> Transport:
    """The transport registered as ``name`` (``storage`` or ``broadcast``)."""
    if name == "storage":
        from torchrl_vllm_ext.weight_sync.transports.storage import StorageTransport

        return StorageTransport(service, storage_dir=options.get("storage_dir"))
    if name == "broadcast":
        from torchrl_vllm_ext.weight_sync.transports.broadcast import BroadcastTransport

        return BroadcastTransport(
            service, bucket_bytes=options["bucket_bytes"], timeout_s=options["timeout_s"]
        )
    raise ValueError(f"no transport named {name!r}")

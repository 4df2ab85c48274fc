"""Weight-sync transports: how a push's bytes reach the replicas. Each transport is a folder
(``storage/``, ``broadcast/``, ``ipc/``, ``auto/``) holding its sender and its receiver,
behind one protocol (:mod:`.protocol`) and one registry of names (:mod:`.registry`); what
several share sits beside them (:mod:`.packing`, :mod:`.devices`, and the wire specs in
:mod:`torchrl_vllm_ext.weight_sync.specs`); how a worker stages and loads what its receiver got
is :mod:`torchrl_vllm_ext.weight_sync.loading`."""

from torchrl_vllm_ext.weight_sync.transports.protocol import (
    Replicas,
    Transport,
    TransportOptions,
    WorkerCall,
)
from torchrl_vllm_ext.weight_sync.transports.registry import make_transport, names

__all__ = ["Replicas", "Transport", "TransportOptions", "WorkerCall", "make_transport", "names"]

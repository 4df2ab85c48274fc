"""CUDA IPC handles as plain data: torch's reduce_tensor fields survive JSON and come back
as rebuild arguments for the receiver's own device number (the CUDA calls themselves run
in the gpu tier)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from torchrl_vllm_ext.errors import WeightSyncError
from torchrl_vllm_ext.weight_sync.specs import CudaIpcHandle, IpcUpdate, from_json, to_json
from torchrl_vllm_ext.weight_sync.transports.ipc.handles import handle_from_args, rebuild_args
from torchrl_vllm_ext.weight_sync.transports.packing import pack

GPU = "8f6c1a2e-0000-1111-2222-333344445555"


def reduce_args(device: int = 3, event: bytes | None = b"\x01evt\xff") -> tuple:
    """The 15 rebuild arguments torch's reduce_tensor gives for a uint8 bucket on CUDA
    (handles are opaque bytes: any bytes, including NUL and high bytes, must survive)."""
    return (
        torch.Tensor,
        torch.Size([4096]),
        (1,),
        128,
        torch.storage.UntypedStorage,
        torch.uint8,
        device,
        b"\x00ipc-mem-handle\xfe" * 4,
        1 << 20,
        512,
        False,
        b"/torch_123_ref\x00",
        7,
        event,
        True,
    )


@pytest.mark.parametrize("event", [b"\x01evt\xff", None])
def test_a_handle_round_trips_through_json_onto_the_receivers_device(event):
    args = reduce_args(device=3, event=event)
    handle = handle_from_args(args, GPU)
    wire = to_json(handle)
    assert isinstance(wire, str) and "\\u0000" not in wire  # bytes travel as base64
    back = rebuild_args(from_json(wire, CudaIpcHandle), device_index=0)
    expected = list(args)
    expected[6] = 0  # the receiver's number for the same GPU
    assert list(back) == expected


def test_an_update_carries_the_bucket_layout_and_one_handle_per_bucket():
    tensors = {"a": torch.ones(3, 4), "b": torch.zeros(5, dtype=torch.bfloat16)}
    header, buffers = pack(tensors, "v2")
    update = IpcUpdate(header, tuple(handle_from_args(reduce_args(), GPU) for _ in buffers))
    back = from_json(to_json(update), IpcUpdate)
    assert back == update and len(back.handles) == len(back.header.buckets) == 2


def test_only_flat_uint8_buckets_and_torchs_storage_classes_are_accepted():
    bad_dtype = list(reduce_args())
    bad_dtype[5] = torch.float32
    with pytest.raises(WeightSyncError, match="only 1-D uint8 buckets"):
        handle_from_args(tuple(bad_dtype), GPU)
    forged = dataclasses.replace(handle_from_args(reduce_args(), GPU), storage_cls="os.system")
    with pytest.raises(WeightSyncError, match=r"'os\.system' is not one of torch's"):
        rebuild_args(forged, 0)

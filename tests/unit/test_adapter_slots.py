"""An adapter push's packing without vLLM: AdapterPacker's kept slots, the shared memory
replicas on the driver's node read (another process maps it), and which slot each push of
an AdapterSync writes (never a live version's)."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys

import pytest
import torch

from torchrl_vllm_ext.engine import shared_memory
from torchrl_vllm_ext.engine.adapters import AdapterPacker, unpack_adapter
from torchrl_vllm_ext.errors import WeightSyncError
from torchrl_vllm_ext.weight_sync.adapters import AdapterSync, check_adapter

from .test_adapters_from_memory import StandInService, lora_config, lora_tensors

needs_memfd = pytest.mark.skipif(not shared_memory.available(), reason="no memfd here")


def test_each_slot_keeps_its_push_and_a_push_allocates_nothing():
    packer = AdapterPacker(slots=2)
    first = packer.pack(lora_tensors(1), lora_config(), slot=0)
    second = packer.pack(lora_tensors(2), lora_config(), slot=1)
    again = packer.pack(lora_tensors(3), lora_config(), slot=1)
    assert again.data is second.data, "a slot's buffer is kept"
    for packed, seed in ((first, 1), (again, 3)):
        got, config = unpack_adapter(packed.header_json, packed.data)
        assert all(torch.equal(got[k], t) for k, t in lora_tensors(seed).items())
        assert config["r"] == 4
    # A non-contiguous source and another layout are packed too (the layout is redone).
    odd = {"w": torch.arange(6.0).reshape(2, 3).t()}
    packed = packer.pack(odd, {"r": 1}, slot=0)
    got, _ = unpack_adapter(packed.header_json, packed.data)
    assert torch.equal(got["w"], odd["w"])


def test_a_nan_is_found_by_one_sum_over_the_packed_slot():
    packer = AdapterPacker(slots=1)
    tensors = lora_tensors()
    packer.pack(tensors, lora_config())
    assert check_adapter(packer.tensors, lora_config(), None, 8, packer.flat())["r"] == 4
    next(iter(tensors.values()))[1, 2] = math.nan
    packer.pack(tensors, lora_config())
    with pytest.raises(WeightSyncError, match=r"q_proj.lora_A.*NaN"):
        check_adapter(packer.tensors, lora_config(), None, 8, packer.flat())
    # Finite values whose sum overflows are checked tensor by tensor: no error.
    big = {"a": torch.full((4,), 3e38)}
    packer.pack(big, {"r": 1})
    check_adapter(packer.tensors, {"r": 1}, None, 8, packer.flat())


@needs_memfd
def test_another_process_reads_the_slot_without_a_file():
    packer = AdapterPacker(slots=2)
    packed = packer.pack(lora_tensors(5), lora_config(), slot=1)
    region = packed.shared
    assert region is not None and region.offset == region.size // 2
    code = (
        "import sys; from torchrl_vllm_ext.engine.shared_memory import SharedRegion\n"
        f"r = SharedRegion(*{region.as_tuple()!r})\n"
        "sys.stdout.buffer.write(bytes(r.read()))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, check=True)
    assert out.stdout == packed.data.tobytes()
    stale = dataclasses.replace(region, inode=region.inode + 1)
    assert region.readable() and not stale.readable(), "a reused descriptor is refused"


def test_a_push_never_writes_the_slot_of_a_live_version():
    svc = StandInService(max_loras=3)
    with AdapterSync(svc, "policy", keep=2) as sync:
        for version in range(1, 7):
            sync.push((lora_tensors(version), lora_config()), version)
            slots = sync._slots
            assert list(slots) == sync.live_versions
            assert len(set(slots.values())) == len(slots), f"two live versions share {slots}"
            assert set(slots.values()) <= {0, 1, 2}

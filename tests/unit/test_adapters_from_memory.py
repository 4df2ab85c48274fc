"""Adapters from memory without vLLM: the packed form (AdapterTensors) and its checks, the
replica's rules (AdapterUse), and AdapterSync's steps over a recording stand-in service
(the value check, the version rules, making room in the replicas' LoRA cache)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import json
import math
import warnings
from types import SimpleNamespace

import pytest
import torch

from torchrl_vllm_ext.engine.adapters import (
    AdapterRegistry,
    adapter_capacity,
    pack_adapter,
    unpack_adapter,
)
from torchrl_vllm_ext.engine.replica.adapter_use import AdapterUse
from torchrl_vllm_ext.errors import WeightSyncError
from torchrl_vllm_ext.weight_sync.adapters import AdapterSync


class TaskType(enum.Enum):
    CAUSAL_LM = "CAUSAL_LM"


def lora_tensors(seed: int = 0, rank: int = 4) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    prefix = "base_model.model.model.layers.0.self_attn"
    return {
        f"{prefix}.q_proj.lora_A.weight": torch.randn(rank, 32, generator=gen),
        f"{prefix}.q_proj.lora_B.weight": torch.randn(32, rank, generator=gen),
        f"{prefix}.v_proj.lora_A.weight": torch.randn(rank, 32, generator=gen),
        f"{prefix}.v_proj.lora_B.weight": torch.randn(16, rank, generator=gen),
    }


def lora_config(rank: int = 4) -> dict:
    return {"r": rank, "lora_alpha": 2 * rank, "target_modules": {"v_proj", "q_proj"}}


# ---------------------------------------------------------------------------- packing
def test_packing_keeps_every_tensor_bitwise_at_aligned_offsets():
    tensors = {
        "a": torch.randn(3, 5, dtype=torch.bfloat16),
        "b": torch.randn(7, dtype=torch.float64),
        "c": torch.zeros(0, 4),
        "d": torch.arange(6, dtype=torch.float16).reshape(2, 3).t(),  # not contiguous
    }
    config = {"r": 2, "target_modules": {"q_proj", "k_proj"}, "task_type": TaskType.CAUSAL_LM}
    packed = pack_adapter(tensors, config)
    header = json.loads(packed.header_json)
    assert all(offset % 64 == 0 for _, _, _, offset, _ in header["tensors"])
    got, got_config = unpack_adapter(packed.header_json, packed.data)
    assert list(got) == list(tensors)
    for name, t in tensors.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape
        assert torch.equal(got[name], t), name
    assert got_config == {"r": 2, "target_modules": ["k_proj", "q_proj"], "task_type": "CAUSAL_LM"}
    got["a"].add_(1)  # the views are writable: vLLM may cast or pin them in place


def test_a_worker_reuses_a_regions_copy_only_once_vllm_dropped_its_adapter():
    from torchrl_vllm_ext.weight_sync.adapter_receiver import AdapterReceiver

    registered: set[int] = set()
    manager = SimpleNamespace(list_adapters=lambda: set(registered))
    receiver = AdapterReceiver(SimpleNamespace(model_runner=SimpleNamespace(lora_manager=manager)))
    region = (1, 2, 3, 4096, 0, 128)  # pid, fd, inode, size, offset, nbytes
    first = receiver._reusable(region, lora_id=1)
    registered.add(1)
    second = receiver._reusable(region, lora_id=2)  # adapter 1 still held: a new copy
    assert second is not first and len(second) == 128
    registered.discard(2)
    assert receiver._reusable(region, lora_id=3) is second  # adapter 2 dropped: reused
    packed = pack_adapter({"w": torch.arange(4.0)}, {"r": 1})
    got, _ = unpack_adapter(packed.header_json, packed.data, bytearray(len(packed.data)))
    assert torch.equal(got["w"], torch.arange(4.0))


def test_a_buffer_missing_bytes_is_refused_naming_the_tensor():
    packed = pack_adapter({"first": torch.ones(4), "second": torch.ones(100)}, {"r": 1})
    with pytest.raises(ValueError, match=r"'second'.*push it again"):
        unpack_adapter(packed.header_json, packed.data[:100])


def test_an_empty_adapter_packs_to_an_empty_buffer():
    packed = pack_adapter({}, {"r": 1})
    assert packed.data.nbytes == 0
    assert unpack_adapter(packed.header_json, packed.data) == ({}, {"r": 1})


def test_adapter_capacity_is_vllms_cpu_cache():
    assert adapter_capacity({}) == 1  # vLLM's max_loras default
    assert adapter_capacity({"max_loras": 3}) == 3
    assert adapter_capacity({"max_loras": 2, "max_cpu_loras": 5}) == 5


def test_registry_holds_adapters_from_memory_without_a_directory():
    reg = AdapterRegistry()
    adapter, previous = reg.add("policy@1", None, nbytes=123)
    assert adapter.in_memory and adapter.path is None and adapter.nbytes == 123
    assert previous is None
    again, previous = reg.add("policy@1", None, nbytes=5)
    assert previous == adapter and again.lora_id != adapter.lora_id


# ---------------------------------------------------------------------------- the replica
def test_adapter_use_refuses_after_release_and_waits_for_running_batches():
    async def scenario():
        use = AdapterUse()
        assert not use.holds(3)
        use.hold(3)
        use.enter(3)
        use.enter(3)
        removal = asyncio.ensure_future(use.release(3))
        await asyncio.sleep(0)
        assert not use.holds(3), "new batches are refused at once"
        use.leave(3)
        await asyncio.sleep(0)
        assert not removal.done(), "one batch still runs"
        use.leave(3)
        await asyncio.wait_for(removal, 1)
        use.hold(4)
        await asyncio.wait_for(use.release(4), 1)  # unused: at once

    asyncio.run(scenario())


# ---------------------------------------------------------------------------- AdapterSync
class StandInService:
    """What AdapterSync calls on a service, recorded."""

    def __init__(self, **engine_kwargs):
        self.config = SimpleNamespace(engine_kwargs={"max_lora_rank": 8, **engine_kwargs})
        self.weight_version = "0"
        self.calls: list[tuple] = []
        self.loaded: dict[str, tuple[dict, dict]] = {}

    def add_lora_tensors(self, name, tensors, config):
        self.calls.append(("add", name))
        self.loaded[name] = (tensors, config)
        return len(self.loaded)

    def set_weight_version(self, version):
        self.weight_version = version

    async def aremove_lora(self, name):
        self.calls.append(("remove", name))
        self.loaded.pop(name)

    def remove_lora(self, name):
        asyncio.run(self.aremove_lora(name))

    def run(self, coro):
        return asyncio.run(coro)

    def submit(self, coro):
        future = concurrent.futures.Future()
        future.set_result(asyncio.run(coro))
        return future


def test_a_push_sends_the_tensors_and_config_and_labels_the_version():
    svc = StandInService(max_loras=3)
    tensors = lora_tensors()
    with AdapterSync(svc, "policy", keep=2) as sync:
        report = sync.push((tensors, lora_config()), 1)
        assert report.lora_name == sync.current == "policy@1" and svc.weight_version == "1"
        sent, config = svc.loaded["policy@1"]
        assert all(torch.equal(sent[k], t) for k, t in tensors.items())
        assert config["r"] == 4
        assert set(report.phases) == {"validate", "make_room", "load", "retire"}
        assert report.nbytes == sum(t.numel() * 4 for t in tensors.values())
    assert svc.loaded == {}, "close retires every live version"


def test_versions_retire_after_the_load_when_the_cache_has_room():
    svc = StandInService(max_loras=3)
    with AdapterSync(svc, "policy", keep=2) as sync:
        for version in (1, 2, 3):
            report = sync.push((lora_tensors(version), lora_config()), version)
        assert svc.calls[-2:] == [("add", "policy@3"), ("remove", "policy@1")]
        assert report.retired == ["1"] and sync.live_versions == ["2", "3"]


def test_versions_retire_before_the_load_when_the_cache_is_full():
    svc = StandInService(max_loras=2)  # keep=2 fills it: the new version needs a slot
    with AdapterSync(svc, "policy", keep=2) as sync:
        for version in (1, 2, 3):
            report = sync.push((lora_tensors(version), lora_config()), version)
        assert svc.calls[-2:] == [("remove", "policy@1"), ("add", "policy@3")]
        assert report.retired == ["1"] and sync.live_versions == ["2", "3"]
        assert set(svc.loaded) == {"policy@2", "policy@3"}


def test_keep_beyond_the_replicas_lora_cache_is_refused():
    with pytest.raises(WeightSyncError, match=r"keep=3 .* of 2 .*max_cpu_loras>=4"):
        AdapterSync(StandInService(max_loras=2), keep=3)


def test_storage_dir_and_shared_are_deprecated_and_write_nothing(tmp_path):
    with pytest.warns(DeprecationWarning, match="write no file"):
        sync = AdapterSync(StandInService(max_loras=2), storage_dir=tmp_path, shared=True)
    sync.push((lora_tensors(), lora_config()), 1)
    sync.close()
    assert list(tmp_path.iterdir()) == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        AdapterSync(StandInService(max_loras=2)).close()


def test_bad_pushes_are_refused_before_the_service_is_called():
    svc = StandInService(max_loras=2)
    with AdapterSync(svc, keep=2) as sync:
        sync.push((lora_tensors(), lora_config()), 1)
        bad = lora_tensors()
        next(iter(bad.values()))[0, 0] = math.nan
        with pytest.raises(WeightSyncError, match="NaN"):
            sync.push((bad, lora_config()), 2)
        with pytest.raises(WeightSyncError, match="r=2"):
            sync.push((lora_tensors(rank=2), lora_config(rank=2)), 3)
        with pytest.raises(WeightSyncError, match="already live"):
            sync.push((lora_tensors(), lora_config()), 1)
        assert svc.calls == [("add", "policy@1")] and sync.current == "policy@1"

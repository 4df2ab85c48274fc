"""The two replica engines agree: vLLM's ``LLMEngine`` in the actor (CPU default) and
``AsyncLLM`` with its engine-core process (``engine_process=True``, GPU default).

Two ``AsyncLLM`` replicas serve the module's tests (a replica's launch is ~20 s on 2
cores), started as replicas sharing a GPU start (engine/driver/start_order.py: one after
the other, the second with the KV-cache size the first logged), which the first test
checks; the last test shuts them down and checks what a shutdown removes.
"""

from __future__ import annotations

import logging
import os
import signal
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


START_ORDER = "torchrl_vllm_ext.engine.driver.start_order"
"""The logger of the start order (INFO: which replicas start now, with which size)."""


class KeptRecords(logging.Handler):
    """Every record of a logger, kept (caplog is per test; the service is the module's)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(scope="module")
def start_log():
    """The start order's records while the module runs."""
    logger, kept = logging.getLogger(START_ORDER), KeptRecords()
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(kept)
    yield kept.records
    logger.removeHandler(kept)
    logger.setLevel(level)


@pytest.fixture(scope="module")
def engine_process_service(tiny_model, ray_cluster, start_log):
    """Two replicas whose ``AsyncLLM`` runs its engine core in a process of its own (its
    start blocks the actor's event loop, as on GPU), forced into the start order of
    replicas sharing a GPU."""
    from torchrl_vllm_ext.engine.driver import launcher

    with pytest.MonkeyPatch.context() as patch:  # as replicas sharing a GPU (at launch)
        patch.setattr(launcher, "orders_starts", lambda *args: True)
        svc = VLLMService.launch(
            tiny_model,
            num_replicas=2,
            cpus_per_replica=CPUS_PER_REPLICA,
            engine_process=True,
            health_check_interval=1.0,
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


# The restart (an AsyncLLM start, ~20 s) is slow: a restart reuses the pinned size by
# tests/unit/test_start_order.py::test_a_restart_reuses_the_size_and_waits_for_nobody,
# passes through the same start as the follower's pinned one here, and every restart test
# runs the pool's restart path by default.
@pytest.mark.parametrize(
    "restart", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["start", "restart"]
)
def test_replicas_sharing_a_gpu_start_with_the_size_the_first_logged(
    engine_process_service, start_log, restart
):
    """The GPU start order on CPU engines: the first reports the KV-cache size its engine
    logs from the actor's watch group while it starts; the other starts with that size; a
    restart of the first reuses it."""
    from ..helpers import wait_restarted

    svc = engine_process_service
    (key, pin), *others = svc.pool.launcher.start_gates.order.pins.items()
    assert not others and key[1] == "*", "CPU actors see no device: one key per node"
    # vLLM-CPU logs "Explicitly set (0.06/...) GiB": the size, rounded down.
    assert 0.05 * (1 << 30) < pin.nbytes <= ENGINE_KWARGS["kv_cache_memory_bytes"]
    follower = 1 - pin.measured_by
    assert svc.replica_info(follower).kv_cache_bytes == pin.nbytes
    assert (
        svc.replica_info(pin.measured_by).kv_cache_bytes == (ENGINE_KWARGS["kv_cache_memory_bytes"])
    )
    messages = [r.getMessage() for r in start_log]
    assert any(f"replicas [{follower}] start now" in m for m in messages), messages
    assert len(svc.generate([[1, 2, 3]] * 4, {"max_tokens": 2})) == 4
    if not restart:
        return

    old = svc.replica_info(pin.measured_by).pid
    os.kill(old, signal.SIGKILL)
    wait_restarted(svc, pin.measured_by, old)
    assert svc.replica_info(pin.measured_by).kv_cache_bytes == pin.nbytes
    line = f"replica {pin.measured_by} starts on GPU *@{key[0]} with kv_cache_memory_bytes"
    assert any(r.getMessage().startswith(line) for r in start_log)


def test_async_engine_replica_gives_the_in_process_replicas_tokens_and_logprobs(
    service, engine_process_service
):
    in_process = service.generate_request_data(PROMPTS, PARAMS)
    assert engine_children(service) == [], "CPU replicas run their engine in the actor"

    svc = engine_process_service
    assert len(engine_children(svc)) == svc.num_replicas, "AsyncLLM runs an engine-core process"
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

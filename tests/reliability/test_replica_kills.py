"""Replica processes SIGKILLed at random moments, during generation and during weight sync.

Every accepted request completes or fails with a typed error, killed replicas come back
at the current weights (checked exactly: their log-probs equal the trainer's), and the
service keeps serving. The default run kills once per test; ``--runslow`` 10 and 8 times.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import os
import random
import time

import pytest

from torchrl_vllm_ext import WeightSyncError, leftovers

from ..helpers import (
    Traffic,
    assert_replicas_match,
    kill_replica,
    perturb,
    prompts,
    wait_ready,
    wait_restarted,
    wait_until,
)

logger = logging.getLogger(__name__)


def _reaped(path: str) -> bool:
    """Whether ``path`` is gone after a reap (what the next start on this node runs)."""
    leftovers.reap()
    return not os.path.exists(path)


@pytest.mark.parametrize(
    "kills", [1, pytest.param(10, marks=pytest.mark.slow)], ids=lambda k: f"{k}-kills"
)
def test_sigkill_during_generation_loses_no_request(service, kills):
    rng = random.Random(kills)
    wait_ready(service)
    version = service.weight_version
    traffic = Traffic(service).start()
    try:
        for _ in range(kills):
            wait_ready(service)
            time.sleep(rng.uniform(0.2, 2.0))  # a random moment of the traffic
            victim = rng.choice(service.replica_ids)
            old_tmp = service.replica_info(victim).temp_dir
            old_pid, what = kill_replica(service, victim, rng)
            logger.info("killed the %s of replica %d", what, victim)
            wait_restarted(service, victim, old_pid)
            assert service.weight_versions()[victim] == version
            # Its temporary directory (vLLM's rendezvous file) goes at the next start on
            # this node once its process is gone: its successor's, or this reap.
            wait_until(functools.partial(_reaped, old_tmp), 30, what=f"{old_tmp} to be reaped")
    finally:
        traffic.stop()
    ok, errors = traffic.check()
    assert ok > 0
    logger.info("%d batches answered, %d failed with a typed error", ok, errors)
    data = service.generate_request_data(
        prompts(4, seed=1), {"max_tokens": 2}, routing="round_robin"
    )
    assert {d.replica_id for d in data} == set(service.replica_ids)


@pytest.mark.parametrize(
    "kills", [1, pytest.param(8, marks=pytest.mark.slow)], ids=lambda k: f"{k}-kills"
)
def test_sigkill_during_weight_sync_keeps_replicas_consistent(service, trainer, scheme, kills):
    rng = random.Random(100 + kills)
    wait_ready(service)
    # The first push also tells how long one takes, to aim the kills inside pushes.
    perturb(trainer, seed=1000)
    push_s = scheme.push(trainer, version="sync-kill-base").seconds
    assert_replicas_match(service, trainer, "sync-kill-base")
    traffic = Traffic(service, threads=2).start()
    outcomes = []
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            for k in range(kills):
                wait_ready(service)
                before = {n: t.clone() for n, t in trainer.state_dict().items()}
                perturb(trainer, seed=1001 + k)
                version = f"sync-kill-{k}"
                fut = pool.submit(scheme.push, trainer, version)
                time.sleep(rng.uniform(0.0, 1.2 * push_s))
                victim = rng.choice(service.replica_ids)
                old_pid, what = kill_replica(service, victim, rng)
                try:
                    fut.result(timeout=600)
                    outcomes.append("pushed")
                except WeightSyncError as e:  # typed; then nothing may serve the new version
                    outcomes.append("rejected")
                    logger.info("push %s rejected: %s", version, e)
                    trainer.load_state_dict(before)
                    version = service.weight_version
                wait_restarted(service, victim, old_pid)
                logger.info(
                    "killed the %s of replica %d during a push: %s", what, victim, outcomes[-1]
                )
                assert_replicas_match(service, trainer, version)
    finally:
        traffic.stop()
    traffic.check(full_length=False)
    logger.info("push outcomes under kills: %s", outcomes)
    # The next push works on every replica, restarted ones included.
    perturb(trainer, seed=1999)
    scheme.push(trainer, version="sync-kill-after")
    assert_replicas_match(service, trainer, "sync-kill-after")

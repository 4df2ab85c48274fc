"""A replica killed mid-batch, and scaling while serving.

Each test leaves the shared service as it found it (two ready replicas at version "0"),
so the file runs in any order with the others. Each keeps a weight-sync scheme open, which
brings a started replica to the live weights: after a push whose scheme closed (earlier
files) a started replica would hold the checkpoint and be held out of traffic
(tests/integration/test_version_labels.py).
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
from collections import Counter

import psutil

from torchrl_vllm_ext import WeightSyncScheme

from ..helpers import wait_until

LONG = {"max_tokens": 64, "ignore_eos": True}


def prompts(n, seed=0):
    return [[7 + seed, 8, 9, 10 + i, 11 + i] for i in range(n)]


def test_sigkill_during_a_batch_loses_nothing_and_replica_restarts(service, hf_model):
    with WeightSyncScheme(service, transport="storage") as scheme:
        scheme.push(hf_model, version="7")  # the checkpoint's weights, labelled 7
        sigkill_during_a_batch(service)
        scheme.push(hf_model, version="0")


def sigkill_during_a_batch(service) -> None:
    victim = service.replica_ids[0]
    old_pid = service.replica_info(victim).pid
    engine_pids = [p.pid for p in psutil.Process(old_pid).children(recursive=True)]
    batch = prompts(48)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(service.generate_request_data, batch, LONG, routing="round_robin")
        wait_until(
            lambda: any(s.running > 0 for s in service.stats() if s.replica_id == victim),
            60,
            what="the victim replica running requests",
        )
        os.kill(old_pid, signal.SIGKILL)
        data = fut.result(timeout=300)
    assert [d.prompt_token_ids.tolist() for d in data] == batch, "every prompt answered, in order"
    assert all(len(d.samples[0].token_ids) == 64 for d in data)
    assert victim not in {d.replica_id for d in data}, (
        "the dead replica's share was retried elsewhere"
    )

    def restarted():
        return any(r.replica_id == victim and r.info.pid != old_pid for r in service.replicas())

    wait_until(restarted, timeout=300, interval=1.0, what="the killed replica to restart")
    assert service.weight_versions()[victim] == "7", (
        "a restarted replica comes back at the current version"
    )
    wait_until(
        lambda: (
            not any(
                psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in engine_pids
            )
        ),
        30,
        what="the dead replica's engine processes to exit",
    )
    data = service.generate_request_data(
        prompts(4, seed=1), {"max_tokens": 2}, routing="round_robin"
    )
    assert {d.replica_id for d in data} == set(service.replica_ids)


def test_add_then_remove_replicas_while_serving(service, hf_model):
    with WeightSyncScheme(service, transport="storage") as scheme:
        scheme.push(hf_model, version="0")  # added replicas are brought to it
        add_then_remove_replicas(service)


def add_then_remove_replicas(service) -> None:
    before = service.replica_ids
    added = service.add_replicas(1)
    assert len(added) == 1 and service.num_replicas == 3
    ids = [
        d.replica_id
        for d in service.generate_request_data(prompts(6), {"max_tokens": 2}, routing="round_robin")
    ]
    assert set(ids) == set(before) | set(added)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(
            service.generate_request_data, prompts(30, seed=2), LONG, routing="round_robin"
        )
        wait_until(
            lambda: sum(s.outstanding > 0 for s in service.stats()) == 3,
            60,
            what="all three replicas busy",
        )
        removed = service.remove_replicas(1)
        data = fut.result(timeout=300)
    assert service.num_replicas == 2 and removed[0] not in service.replica_ids
    served = Counter(d.replica_id for d in data)
    assert served[removed[0]] == 10, "the removed replica drained its share before stopping"
    assert all(len(d.samples[0].token_ids) == 64 for d in data)
    ids = {
        d.replica_id
        for d in service.generate_request_data(prompts(4), {"max_tokens": 2}, routing="round_robin")
    }
    assert removed[0] not in ids

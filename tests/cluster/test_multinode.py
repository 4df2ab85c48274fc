"""Replicas on several Ray nodes: placement, weights over both transports to every node,
adapters shipped to other nodes, and the loss of a whole node mid-batch.

Tests run in file order and share one service: the last one kills a node.
"""

from __future__ import annotations

import concurrent.futures
import glob
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from torchrl_vllm_ext import InsufficientResourcesError, WeightSyncScheme
from torchrl_vllm_ext.testing.loopback_cluster import LoopbackCluster
from torchrl_vllm_ext.weight_sync.adapters import AdapterSync

from ..helpers import (
    SEQUENCE,
    WORKERS,
    assert_replicas_match,
    hf_token_logprobs,
    launch_on_workers,
    make_adapter,
    nodes_of,
    perturb,
    wait_until,
)

logger = logging.getLogger(__name__)
LONG = {"max_tokens": 200, "ignore_eos": True}


def shipped_copies(lora_id) -> list[str]:
    """Adapter directories the replicas wrote from shipped files (all nodes share /dev/shm)."""
    return [
        d
        for base in ("/dev/shm", tempfile.gettempdir())
        for d in glob.glob(f"{base}/torchrl-vllm-replica-adapters-*/{lora_id}")
    ]


def test_spread_puts_one_replica_on_each_worker_node_and_none_on_the_head(spread_service):
    assert sorted(nodes_of(spread_service).values()) == list(WORKERS)
    data = spread_service.generate_request_data(
        [[5, 6, 7]] * 4, {"max_tokens": 4}, routing="round_robin"
    )
    assert {d.replica_id for d in data} == set(spread_service.replica_ids)


def test_pack_fills_one_node_and_strict_spread_refuses_more_replicas_than_nodes(
    spread_service, loopback, tiny_model
):
    with pytest.raises(InsufficientResourcesError, match="strict_spread"):
        launch_on_workers(
            loopback, tiny_model, num_replicas=3, placement="strict_spread", cpus_per_replica=0.25
        )
    with launch_on_workers(
        loopback, tiny_model, num_replicas=2, placement="pack", cpus_per_replica=0.25
    ) as packed:
        placed = set(nodes_of(packed).values())
        assert len(placed) == 1 and placed <= set(WORKERS), placed


def _adapter_gaps(service, peft_model, lora: str) -> dict[int, float]:
    """Each replica's largest log-prob gap to the PEFT model with adapter ``lora``."""
    expected = hf_token_logprobs(peft_model, SEQUENCE)
    data = service.generate_request_data(
        [SEQUENCE] * 2, {"max_tokens": 1, "prompt_logprobs": 0}, routing="round_robin", lora=lora
    )
    assert {d.replica_id for d in data} == set(service.replica_ids)
    return {
        d.replica_id: (torch.tensor(d.prompt_logprobs[1:]) - expected).abs().max().item()
        for d in data
    }


def test_adapter_pushes_reach_replicas_on_other_nodes_from_memory(
    spread_service, tiny_model, tmp_path
):
    """An adapter push writes no file on any node: each replica reads the tensors from
    Ray's object store and serves the adapter with the PEFT model's log-probs."""
    peft_model = make_adapter(tiny_model, tmp_path / "unused", seed=4)
    with AdapterSync(spread_service, "nodes", keep=1) as sync:
        report = sync.push(peft_model, "a1")
        assert shipped_copies(spread_service.list_loras()[sync.current]) == []
        gaps = _adapter_gaps(spread_service, peft_model, sync.current)
        assert max(gaps.values()) < 1e-4, f"adapter log-probs off by {gaps}"
    logger.info("adapter push to 2 nodes: %.3fs (%s)", report.seconds, report.phases)


def test_adapter_files_reach_replicas_on_other_nodes(spread_service, tiny_model, tmp_path):
    """The driver's adapter directory is not read on other nodes: each replica gets the
    files through Ray's object store, writes them to a directory of its own and serves
    the adapter with the PEFT model's log-probs."""
    peft_model = make_adapter(tiny_model, tmp_path / "a2", seed=5)
    lora_id = spread_service.add_lora("files", tmp_path / "a2")
    shipped = shipped_copies(lora_id)
    assert len(shipped) == 2, f"one private copy per replica node, found {shipped}"
    assert all((Path(d) / "adapter_model.safetensors").is_file() for d in shipped)
    gaps = _adapter_gaps(spread_service, peft_model, "files")
    assert max(gaps.values()) < 1e-4, f"adapter log-probs off by {gaps}"
    spread_service.remove_lora("files")
    assert not shipped_copies(lora_id), "removed: the replicas' copies are gone"


def test_auto_broadcasts_to_replicas_on_other_nodes_exactly(spread_service, trainer):
    with WeightSyncScheme(spread_service) as scheme:
        assert scheme.transport == "broadcast", scheme.reason
        assert "other hosts" in scheme.reason
        perturb(trainer, seed=1)
        report = scheme.push(trainer, version=1)
        assert_replicas_match(spread_service, trainer, "1")
    logger.info("broadcast across nodes: %.3fs, pause %s", report.seconds, report.pause_s)


def test_storage_in_a_shared_directory_reaches_every_node_exactly(
    spread_service, trainer, tmp_path
):
    scheme = WeightSyncScheme(spread_service, storage_dir=tmp_path / "shared")
    assert scheme.transport == "storage" and "shared directory" in scheme.reason
    perturb(trainer, seed=2)
    report = scheme.push(trainer, version=2)
    assert_replicas_match(spread_service, trainer, "2")
    logger.info("storage across nodes: %.3fs, pause %s", report.seconds, report.pause_s)
    # Left open: the service keeps it as its weights provider, which brings the replicas
    # restarted or added after the node loss below to version 2.
    assert spread_service.weights_provider is scheme


def test_demo_trains_with_its_replicas_on_other_nodes(spread_service, loopback, tmp_path):
    """The CLI joins the cluster: the trainer on the head, the replicas spread over the
    worker nodes; every step's weights cross nodes by gloo broadcast and arrive exactly."""
    steps = 8
    proc = subprocess.run(
        [sys.executable, "-m", "torchrl_vllm_ext.cli", "demo", "--steps", str(steps),
         "--ray-address", loopback.address, "--placement", "spread",
         "--cpus-per-replica", "0.5", "--output", str(tmp_path), "--no-progress"],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, **LoopbackCluster.env()}, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "metrics.json").read_text())["summary"]
    assert summary["transport"] == "broadcast"
    assert summary["max_abs_kl_to_engine"] < 1e-4, "trainer and engine on the same weights"
    log = (tmp_path / "torchrl-vllm.log").read_text()
    assert log.count("pushed version") == steps
    assert spread_service.num_replicas == 2, "the other service kept serving"


def test_node_loss_mid_batch_loses_nothing_and_new_replicas_serve_the_current_version(
    spread_service, loopback, trainer
):
    svc = spread_service
    victim_ip = WORKERS[1]
    (victim,) = [rid for rid, ip in nodes_of(svc).items() if ip == victim_ip]
    batch = [[7, 8, 9, 10 + i % 50, 11 + i % 50] for i in range(480)]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(svc.generate_request_data, batch, LONG, routing="round_robin")
        wait_until(
            lambda: any(s.running > 0 for s in svc.stats() if s.replica_id == victim),
            60,
            what="the victim replica running requests",
        )
        lost_at = time.perf_counter()
        loopback.kill_raylet(victim_ip)
        data = fut.result(timeout=300)
        batch_done = time.perf_counter() - lost_at
    assert [d.prompt_token_ids.tolist() for d in data] == batch, "every prompt answered, in order"
    assert all(len(d.samples[0].token_ids) == 200 for d in data)
    assert victim not in {d.replica_id for d in data}, "the lost node's share ran elsewhere"
    assert any(d.replica_id == victim and d.node_ip == victim_ip for d in svc.deaths())

    def back():
        return any(r.replica_id == victim and r.node != victim_ip for r in svc.replicas())

    wait_until(back, timeout=240, interval=0.2, what="the lost replica restarted elsewhere")
    serving_again = time.perf_counter() - lost_at
    assert set(nodes_of(svc).values()) == {WORKERS[0]}
    added = svc.add_replicas(1)
    assert nodes_of(svc)[added[0]] == WORKERS[0]
    assert Counter(nodes_of(svc).values()) == {WORKERS[0]: 3}
    assert_replicas_match(svc, trainer, "2")  # restarted and added: the current version
    logger.info(
        "node loss: batch done %.1fs after, full capacity again %.1fs after",
        batch_done,
        serving_again,
    )

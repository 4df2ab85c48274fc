"""Weight sync across Ray nodes, and the time from losing a node to serving again.

A real Ray cluster of three nodes on loopback addresses (``LoopbackCluster``): the
driver (the trainer) on the head, one replica on each of two worker nodes, so every
replica is on another node than the trainer, as on a real cluster.

* storage (a directory every node sees) vs broadcast (gloo): push time and the longest
  generation pause, medians over ``--rounds``, the two alternating first each round;
* node loss: SIGKILL one worker node's raylet while a batch runs; seconds until the
  service has its replica count back (restarted on the live node at the current
  weights) and until the batch is complete (the lost share re-run on the other node).

    python benchmarks/bench_multinode.py [--rounds 5]

Prints one JSON object. The wire is loopback: the figures show the path's overheads
(staging, verification, group, pause), not a network's bandwidth.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import logging
import os
import statistics
import tempfile
import time

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

WORKERS = ("127.0.0.2", "127.0.0.3")


def push_rounds(schemes: dict, trainer, rounds: int) -> dict:
    """Push through each scheme once per round, alternating which goes first."""
    reports = {name: [] for name in schemes}
    names = list(schemes)
    for i in range(rounds):
        for name in names if i % 2 == 0 else names[::-1]:
            reports[name].append(schemes[name].push(trainer, version=f"{name}-{i}"))
    return {
        name: {
            "push_s": round(statistics.median(r.seconds for r in rs), 3),
            "pause_s": round(statistics.median(max(r.pause_s.values()) for r in rs), 3),
            "phases_s": {
                k: round(statistics.median(r.phases[k] for r in rs), 3) for k in rs[0].phases
            },
        }
        for name, rs in reports.items()
    }


def node_loss(svc, cluster, victim_ip: str, prompts: int, tokens: int) -> dict:
    """Seconds from SIGKILL of ``victim_ip``'s raylet to the replicas back / the batch done."""
    (victim,) = [r for r in svc.replica_ids if svc.replica_info(r).node_ip == victim_ip]
    batch = [[7, 8, 9, 10 + i % 50, 11 + i % 50] for i in range(prompts)]
    params = {"max_tokens": tokens, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(svc.generate_request_data, batch, params, routing="round_robin")
        while not any(s.running > 0 for s in svc.stats() if s.replica_id == victim):
            time.sleep(0.05)
        lost_at = time.perf_counter()
        cluster.kill_raylet(victim_ip)
        while not (any(r.replica_id == victim and r.node != victim_ip for r in svc.replicas())):
            time.sleep(0.1)
        back = time.perf_counter() - lost_at
        data = fut.result(timeout=600)
        batch_done = time.perf_counter() - lost_at
    assert len(data) == len(batch) and all(len(d.samples[0].token_ids) == tokens for d in data)
    return {
        "replicas_back_after_loss_s": round(back, 2),
        "batch_done_after_loss_s": round(batch_done, 2),
        # > 0: the batch was too short to still run when Ray noticed the loss.
        "served_by_lost_replica": sum(d.replica_id == victim for d in data),
    }


def main(args) -> dict:
    import ray
    from transformers import AutoModelForCausalLM

    from torchrl_vllm_ext import VLLMService, WeightSyncScheme
    from torchrl_vllm_ext.testing import make_tiny_model
    from torchrl_vllm_ext.testing.loopback_cluster import LoopbackCluster, NodeSpec
    from torchrl_vllm_ext.weight_sync.transports import registry

    model_dir = make_tiny_model(hidden_size=args.hidden, num_layers=args.layers, seed=0)
    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32")
    nbytes = sum(p.numel() * p.element_size() for p in trainer.parameters())
    os.environ.update(LoopbackCluster.env())
    cluster = LoopbackCluster([NodeSpec(ip, 2, {"rollout": 2}) for ip in WORKERS]).start()
    try:
        with (
            VLLMService.launch(
                model_dir,
                num_replicas=2,
                ray_address=cluster.address,
                placement="spread",
                replica_resources={"rollout": 0.01},
                cpus_per_replica=1.0,
                dtype="float32",
                max_model_len=256,
                enforce_eager=True,
                health_check_interval=1.0,
            ) as svc,
            tempfile.TemporaryDirectory() as shared,
        ):
            schemes = {  # storage over the shared directory; broadcast (gloo) to the nodes
                t: WeightSyncScheme(svc, t, storage_dir=shared if t == "storage" else None)
                for t in registry.names(cpu=True, composite=False)
            }
            reasons = {name: s.reason for name, s in schemes.items()}
            for name, scheme in schemes.items():
                scheme.push(trainer, version=f"{name}-warm")  # slots, group
            pushes = push_rounds(schemes, trainer, args.rounds)
            schemes["broadcast"].close()  # storage stays the provider for restarts
            loss = node_loss(svc, cluster, WORKERS[1], args.loss_prompts, args.loss_tokens)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.stop()
    return {
        "benchmark": "multinode",
        "nodes": 1 + len(WORKERS),
        "model_mb": round(nbytes / 1e6, 1),
        "auto_transport_reason": reasons["broadcast"],
        **{f"{name}_{k}": v for name, figures in pushes.items() for k, v in figures.items()},
        "broadcast_over_storage_push": round(
            pushes["broadcast"]["push_s"] / pushes["storage"]["push_s"], 2
        ),
        **loss,
        "processes_left": len(cluster.processes()),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=640)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--loss-prompts", type=int, default=96, help="batch during the node loss")
    parser.add_argument("--loss-tokens", type=int, default=64)
    logging.basicConfig(level=logging.WARNING)
    print(json.dumps(main(parser.parse_args()), indent=2))

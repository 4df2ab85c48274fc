"""Pushes from a trainer sharded with FSDP2 over 2 and 4 gloo ranks, beside a 1-process push
of the same model through the same scheme, in the same run.

Model: a random Qwen2 of ~350 MB fp32 (hidden 640, 24 layers; ``--hidden``/``--layers``),
served by two CPU replicas. This process is rank 0 (it holds the scheme and, for the
baseline, the whole model); ranks 1.. are spawned. For each world size and transport
(storage: every rank writes its blocks into the slot; broadcast: a streamed gather over
gloo), ``--repeats`` rounds alternate which goes first, the sharded push or the baseline.

Per system: push wall time (rank 0, from the call to every replica serving; median),
the longest replica pause (median), the phases of the last push, and the peak private
resident memory each rank gained during its push (``RssAnon`` sampled every 0.5 ms:
:func:`torchrl_vllm_ext.testing.sharded.peak_anon_bytes`; an upper bound, since memory
malloc keeps after a free counts until reused) beside the model's and a shard's bytes.
The baseline's peak is what the 1-process push allocates beyond the model it already holds.
Broadcast buckets: ``--bucket-mb`` (32), the same for both systems.

    python benchmarks/bench_sharded.py [--worlds 2 4] [--repeats 3]

Prints one JSON object (last line).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import multiprocessing
import statistics
import time

import torch
import torch.distributed as dist
from devices import CPU_PUSH_SERVICE

from torchrl_vllm_ext.weight_sync.sharded.routes import SHARDED_TRANSPORTS as TRANSPORTS

logger = logging.getLogger("bench_sharded")


def follower(rank: int, world: int, port: int, model_dir: str, repeats: int, results) -> None:
    """Rank ``rank``: its shards, then ``1 + repeats`` pushes per transport (the first
    warms up), each one's peak private memory put in ``results``."""
    from torchrl_vllm_ext import ShardedWeightSync
    from torchrl_vllm_ext.testing.sharded import init_gloo, load, peak_anon_bytes, shard

    torch.set_num_threads(1)
    init_gloo(rank, world, port)
    model = shard(load(model_dir))
    try:
        for transport in TRANSPORTS:
            with ShardedWeightSync(None) as sync:
                for i in range(1 + repeats):
                    _, peak = peak_anon_bytes(lambda: sync.push(model))
                    if i:
                        results.put((world, transport, rank, peak))
    finally:
        dist.destroy_process_group()


def rounds(svc, model_dir: str, world: int, full, repeats: int, results, bucket_bytes: int) -> dict:
    """Rank 0's side of one world size: per transport, sharded and baseline pushes."""
    from torchrl_vllm_ext import ShardedWeightSync, WeightSyncScheme
    from torchrl_vllm_ext.testing.sharded import load, peak_anon_bytes, shard

    sharded = shard(load(model_dir))
    out = {}
    for transport in TRANSPORTS:
        runs: dict[str, list] = {"sharded": [], "baseline": []}
        with WeightSyncScheme(svc, transport=transport, bucket_bytes=bucket_bytes) as scheme:
            with ShardedWeightSync(scheme) as sync:
                checked = sync.push(sharded, version=f"{transport}-{world}-warm")  # value check
                scheme.push(full, version=f"{transport}-{world}-warm-base")
                for i in range(repeats):
                    order = ("sharded", "baseline") if i % 2 == 0 else ("baseline", "sharded")
                    for system in order:
                        version = f"{transport}-{world}-{i}-{system}"
                        if system == "sharded":
                            push = functools.partial(sync.push, sharded, version)
                        else:
                            push = functools.partial(scheme.push, full, version)
                        t0 = time.perf_counter()
                        report, peak = peak_anon_bytes(push)
                        runs[system].append((time.perf_counter() - t0, report, peak))
        peaks = {0: [r[2] for r in runs["sharded"]]}
        for _ in range((world - 1) * repeats):
            w, t, rank, peak = results.get(timeout=600)
            assert (w, t) == (world, transport), (w, t, world, transport)
            peaks.setdefault(rank, []).append(peak)
        out[transport] = summary(runs, peaks, checked)
    return out


def summary(runs: dict, peaks: dict, checked) -> dict:
    def system(items) -> dict:
        return {
            "push_s": statistics.median(t for t, _, _ in items),
            "pause_s": statistics.median(max(r.pause_s.values()) for _, r, _ in items),
            "phases": {k: round(v, 4) for k, v in items[-1][1].phases.items()},
        }

    sharded, baseline = system(runs["sharded"]), system(runs["baseline"])
    sharded["peak_mb_per_rank"] = {r: round(max(p) / 1e6, 1) for r, p in sorted(peaks.items())}
    baseline["peak_mb"] = round(max(p for _, _, p in runs["baseline"]) / 1e6, 1)
    return {
        "sharded": sharded,
        "baseline_1_process": baseline,
        "push_ratio": sharded["push_s"] / baseline["push_s"],
        "pause_ratio": sharded["pause_s"] / baseline["pause_s"],
        "probe_gap": max(checked.probe_gap.values(), default=None),
    }


def main(args) -> dict:
    from torchrl_vllm_ext import VLLMService
    from torchrl_vllm_ext.listening import free_port
    from torchrl_vllm_ext.testing import make_tiny_model
    from torchrl_vllm_ext.testing.sharded import init_gloo, load

    model_dir = str(make_tiny_model(hidden_size=args.hidden, num_layers=args.layers, seed=0))
    full = load(model_dir)
    nbytes = sum(p.numel() * p.element_size() for p in full.parameters())
    bucket_bytes = args.bucket_mb << 20
    out = {
        "benchmark": "sharded_push",
        "model_mb": round(nbytes / 1e6, 1),
        "bucket_mb": args.bucket_mb,
        "worlds": {},
    }
    ctx = multiprocessing.get_context("spawn")
    with VLLMService.launch(model_dir, **CPU_PUSH_SERVICE, dtype="float32") as svc:
        for world in args.worlds:
            results = ctx.Queue()
            port = free_port("127.0.0.1")
            procs = [
                ctx.Process(
                    target=follower, args=(r, world, port, model_dir, args.repeats, results)
                )
                for r in range(1, world)
            ]
            for p in procs:
                p.start()
            init_gloo(0, world, port)
            try:
                out["worlds"][world] = {
                    "shard_mb": round(nbytes / world / 1e6, 1),
                    **rounds(svc, model_dir, world, full, args.repeats, results, bucket_bytes),
                }
            finally:
                for p in procs:
                    p.join(timeout=120)
                    if p.is_alive():
                        p.kill()
                dist.destroy_process_group()
            logger.info("world %d: %s", world, json.dumps(out["worlds"][world]))
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=640)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--bucket-mb", type=int, default=32, help="the broadcast's buckets")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    print(json.dumps(main(args)))

"""Replica start: one replica alone against two sharing a GPU, in one run.

1. ``VLLMService.launch`` of one replica (``gpus_per_replica=--share``): vLLM profiles the
   GPU and sizes its KV cache; then it is shut down;
2. the launch of two replicas sharing the GPU: the first profiles it alone, the second
   starts as soon as the first logged its KV-cache size, with that size pinned
   (``engine/driver/start_order.py``).

Each launch is timed from the call to every replica serving; the ratio two / one is the
figure of merit (target <= 1.3; before the start order, two took 2x one: 190 s against
~95 s on an H200). Also recorded: the pinned size, when the first replica reported it,
and each replica's KV-cache size. The one-replica launch runs first, so vLLM's compile
cache is warm for the pair (as it was for the second of the two sequential starts before).

    python benchmarks/bench_start.py [--share 0.5]

On a machine without a GPU the replicas share no GPU: both start at once, no order (the
figures then say only what two CPU replicas cost). Prints one JSON object last.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time

from devices import GPU_MAX_MODEL_LEN, device_name, on_gpu

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

TARGET = 1.3


def launch(model: str, replicas: int, kwargs: dict) -> tuple[float, dict]:
    """Seconds to launch ``replicas`` replicas, and what they reported; then shut down."""
    from torchrl_vllm_ext import VLLMService

    t0 = time.perf_counter()
    svc = VLLMService.launch(model, num_replicas=replicas, health_check_interval=0, **kwargs)
    seconds = time.perf_counter() - t0
    try:
        pins = {
            f"{devices}@{node}": {
                "bytes": pin.nbytes,
                "by": pin.measured_by,
                "after_s": pin.after_s,
            }
            for (node, devices), pin in svc.pool.launcher.start_gates.order.pins.items()
        }
        kv = {rid: svc.replica_info(rid).kv_cache_bytes for rid in svc.replica_ids}
        out = svc.generate_request_batch([[5, 6, 7]] * 4, {"max_tokens": 4, "ignore_eos": True})
        assert int(out.sample_lengths.sum()) == 16, "every replica serves"
    finally:
        svc.shutdown()
    return seconds, {"kv_cache_bytes": kv, "pins": pins}


def main(args) -> dict:
    from torchrl_vllm_ext.engine.driver import cluster
    from torchrl_vllm_ext.testing import make_tiny_model

    gpu = on_gpu()
    if gpu:
        model = str(make_tiny_model(dtype="bfloat16", seed=0))
        kwargs = {"gpus_per_replica": args.share, "dtype": "bfloat16"}
    else:
        model = str(make_tiny_model(seed=0))
        kwargs = {"cpus_per_replica": 0.5, "kv_cache_memory_bytes": 64 << 20}
    kwargs["max_model_len"] = GPU_MAX_MODEL_LEN
    owns_ray = cluster.ensure_ray()  # one cluster for both launches: not timed
    try:
        one_s, one = launch(model, 1, kwargs)
        two_s, two = launch(model, 2, kwargs)
    finally:
        if owns_ray:
            import ray

            ray.shutdown()
    return {
        "benchmark": "start",
        "device": device_name(),
        "model": "tiny qwen2 (make_tiny_model)" + (", bf16, CUDA graphs" if gpu else ""),
        "gpus_per_replica": args.share if gpu else None,
        "one_replica_s": round(one_s, 1),
        "two_sharing_s": round(two_s, 1),
        "ratio_two_vs_one": round(two_s / one_s, 3),
        "target_ratio": TARGET,
        "one_replica": one,
        "two_sharing": two,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--share", type=float, default=0.5, help="gpus_per_replica of every replica"
    )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for noisy in ("ray", "vllm", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    print(json.dumps(main(parser.parse_args()), indent=2))

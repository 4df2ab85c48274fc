"""Service throughput against raw in-process vLLM ``AsyncLLM``, on the same prompts, in one run.

Both engines are up at once and the timed calls alternate, the order reversed every round
(raw, service / service, raw), so drift of a shared, noisy machine hits both alike;
medians and the per-round (paired) ratio are reported. On CPU each call starts after the
other engine went idle: vLLM's workers busy-poll for 1 s after their last step, and Ray
runs its workers at nice 15, so a just-finished in-process engine would otherwise steal
the cores from the replica (no gap on a GPU machine's cores).

    python benchmarks/bench_generate.py [--prompts 64 --max-tokens 32 --rounds 7]

On a GPU (CUDA and a GPU build of vLLM): 256 prompts x 256 tokens, 5 rounds, bf16 with CUDA
graphs; both engines start at once, each with the same KV-cache size (given: no profile
to disturb) in its own fifth of the GPU (``devices.py``).

Prints one JSON object; ``ratio_service_1_replica`` is the figure of merit (target >= 0.95).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import time

import numpy as np
from devices import GPU_SHARE, apply_gpu_sizes, device_name, gpu_engine_kwargs, gpu_service_kwargs
from devices import on_gpu as _on_gpu

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

IDLE_S = 1.5  # > vLLM's 1 s busy-poll window after a step


def make_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 500, size=int(rng.integers(8, 24))).tolist() for _ in range(n)]


async def raw_round(engine, prompts, params, tag: str) -> int:
    async def one(i, p):
        final = None
        async for out in engine.generate({"prompt_token_ids": p}, params, f"{tag}-{i}"):
            final = out
        return final

    outs = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return sum(len(c.token_ids) for o in outs for c in o.outputs)


async def service_round(svc, prompts, params) -> int:
    data = await svc.agenerate_request_data(prompts, params)
    return sum(len(s.token_ids) for d in data for s in d.samples)


async def timed(coro) -> tuple[int, float]:
    start = time.perf_counter()
    tokens = await coro
    return tokens, time.perf_counter() - start


async def main(args) -> dict:
    from torchrl_vllm_ext import VLLMService
    from torchrl_vllm_ext._compat import CPU_KV_CACHE_BYTES_DEFAULT, vllm_engine_api
    from torchrl_vllm_ext.engine.validation import make_sampling_params
    from torchrl_vllm_ext.testing import make_tiny_model

    vllm = vllm_engine_api()
    AsyncLLM, AsyncEngineArgs = vllm.AsyncLLM, vllm.AsyncEngineArgs
    on_gpu = _on_gpu()
    if on_gpu:
        model = str(make_tiny_model(dtype="bfloat16", seed=0))
        engine_kwargs = {**gpu_engine_kwargs(), "enforce_eager": args.enforce_eager}
        raw_kwargs = {**engine_kwargs, "gpu_memory_utilization": GPU_SHARE}
        svc_kwargs = {**gpu_service_kwargs(), "enforce_eager": args.enforce_eager}
    else:
        model = str(make_tiny_model(seed=0))
        engine_kwargs = {
            "max_model_len": 512,
            "kv_cache_memory_bytes": CPU_KV_CACHE_BYTES_DEFAULT,
            "enforce_eager": args.enforce_eager,
        }
        raw_kwargs = engine_kwargs
        svc_kwargs = {
            "cpus_per_replica": float(os.cpu_count()),
            "health_check_interval": 0,
            **engine_kwargs,
        }
    prompts = make_prompts(args.prompts)
    params = make_sampling_params(
        {"max_tokens": args.max_tokens, "ignore_eos": True, "temperature": 1.0}
    )

    t0 = time.perf_counter()
    launching = None
    if on_gpu:  # both at once: the service starts in a thread while AsyncLLM blocks this one
        from torchrl_vllm_ext.engine.driver import cluster

        cluster.ensure_ray()  # from this thread (Ray's signal handlers); the service joins it
        launching = asyncio.get_running_loop().run_in_executor(
            None, lambda: VLLMService.launch(model, num_replicas=1, **svc_kwargs)
        )
    try:
        raw = AsyncLLM.from_engine_args(
            AsyncEngineArgs(
                model=model, disable_log_stats=True, enable_log_requests=False, **raw_kwargs
            )
        )
    except BaseException:
        if launching is not None:
            (await launching).shutdown()
        raise
    if launching is not None:
        svc = await launching
    else:
        svc = VLLMService.launch(model, num_replicas=1, **svc_kwargs)
    start_s = time.perf_counter() - t0
    try:
        for w in range(2):  # warm-up both
            await raw_round(raw, prompts, params, f"warm{w}")
            await service_round(svc, prompts, params)
        raw_tps, svc_tps = [], []
        idle = 0.0 if on_gpu else IDLE_S  # 16 cores: an idle engine's poll steals none
        for r in range(args.rounds):
            for name in ("raw", "service") if r % 2 == 0 else ("service", "raw"):
                await asyncio.sleep(idle)
                if name == "raw":
                    tokens, dt = await timed(raw_round(raw, prompts, params, f"r{r}"))
                    raw_tps.append(tokens / dt)
                else:
                    tokens, dt = await timed(service_round(svc, prompts, params))
                    svc_tps.append(tokens / dt)
    finally:
        svc.shutdown()
        raw.shutdown()
        if on_gpu:  # this script started Ray
            import ray

            ray.shutdown()
    raw_med, svc_med = statistics.median(raw_tps), statistics.median(svc_tps)
    return {
        "benchmark": "generate",
        "device": device_name(),
        "model": "tiny qwen2 (make_tiny_model)" + (", bf16, CUDA graphs" if on_gpu else ""),
        "start_s": round(start_s, 1),
        "prompts": args.prompts,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "raw_asyncllm_tokens_per_s": round(raw_med, 1),
        "service_1_replica_tokens_per_s": round(svc_med, 1),
        "ratio_service_1_replica": round(svc_med / raw_med, 3),
        "paired_ratio_service_1_replica": round(
            statistics.median(s / r for s, r in zip(svc_tps, raw_tps, strict=True)), 3
        ),
        "raw_rounds": [round(x, 1) for x in raw_tps],
        "service_rounds": [round(x, 1) for x in svc_tps],
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--enforce-eager", action="store_true")
    logging.basicConfig(level=logging.WARNING)
    args = parser.parse_args()
    if _on_gpu():
        apply_gpu_sizes(args, parser)
    print(json.dumps(asyncio.run(main(args)), indent=2))

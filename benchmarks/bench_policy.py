"""``VLLMPolicy(td)`` throughput against its baselines, on the same prompts, in one run.

Systems, all on the same tiny model and prompts, timed in alternating rounds:

- ``raw_vllm``: in-process ``vllm.LLM.generate`` on token prompts (sampled-token log-probs on,
  as the policy returns them);
- ``torchrl_wrapper``: TorchRL's ``vLLMWrapper`` (tokens mode, its defaults: prompt log-probs
  and detokenisation on) over that ``LLM``;
- ``service``: ``VLLMService.generate_request_data`` (one replica owning the machine's cores), with
  the policy's parameters (no detokenisation), so the ratio isolates the policy's own cost;
- ``policy``: ``VLLMPolicy(td)`` over that service, TorchRL layout out (``pad_output=False``);
- ``torchrl_wrapper_on_service``: TorchRL's ``vLLMWrapper`` given that service as its engine
  (the drop-in: TorchRL's Ray-actor path, ``service.generate.remote``);
- ``raw_asyncllm`` (on a GPU only): vLLM's ``AsyncLLM`` with its engine-core process, the
  engine a GPU replica drives, fed the batch as concurrent requests.

On a GPU (CUDA and a GPU build of vLLM) the defaults become 256 prompts x 256 tokens, 5
rounds, bf16 with CUDA graphs; every engine is up at once with the same KV-cache size (2
GiB, given: they start in parallel) in its own fifth of the GPU (``devices.py``), the
service's one replica included. vLLM's engines run as GPU users run them (``vllm.LLM``
with its engine-core process).

The systems run back to back, in forward then reverse order on alternate rounds, so each
is measured on an equally warm machine. No system leaves work behind when it returns (every
engine here is in-process: no engine-core busy-poll; measured: 1-3% of a core in the second
after a call). An idle gap before each timed call only adds noise on these machines: the
same Python loop runs a median 30% slower right after 1.5 s idle than straight after other
work (``--idle S`` restores a gap). Medians are reported, and the per-round (paired) ratios.

    python benchmarks/bench_policy.py [--prompts 64 --max-tokens 32 --rounds 15 --idle 0]

Prints one JSON object. Targets (CPU): ``policy / raw_vllm >= 0.97`` and
``policy / torchrl_wrapper >= 1.15``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from devices import apply_gpu_sizes, device_name, gpu_engine_kwargs, gpu_service_kwargs, on_gpu

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
ON_GPU = on_gpu()
if not ON_GPU:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process LLM: fast start


def make_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 500, size=int(rng.integers(8, 24))).tolist() for _ in range(n)]


def prompts_td(prompts):
    import torch
    from tensordict import TensorDict, lazy_stack

    return lazy_stack([TensorDict({("tokens", "prompt"): torch.tensor(p)}) for p in prompts])


def response_tokens(td) -> int:
    return sum(len(r) for r in td.get(("tokens", "response"), as_list=True))


class RawAsyncLLM:
    """vLLM's ``AsyncLLM`` on an event loop of its own thread (GPU runs: the raw engine a
    GPU replica drives), a batch sent as concurrent requests."""

    def __init__(self, model: str, engine_kwargs: dict):
        from torchrl_vllm_ext._compat import vllm_engine_api
        from torchrl_vllm_ext.engine.driver.loop import LoopThread

        self._loop = LoopThread("raw-asyncllm")
        api = vllm_engine_api()

        async def build():
            args = api.AsyncEngineArgs(
                model=model, disable_log_stats=True, enable_log_requests=False, **engine_kwargs
            )
            return api.AsyncLLM.from_engine_args(args)

        try:
            self.llm = self._loop.run(build())
        except BaseException:
            self._loop.close()
            raise
        self._rounds = 0

    def generate(self, prompts, params) -> int:
        self._rounds += 1
        tag = f"r{self._rounds}"

        async def one(i, p):
            final = None
            async for out in self.llm.generate({"prompt_token_ids": p}, params, f"{tag}-{i}"):
                final = out
            return final

        async def batch():
            outs = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
            return sum(len(c.token_ids) for o in outs for c in o.outputs)

        return self._loop.run(batch())

    def shutdown(self) -> None:
        try:
            self.llm.shutdown()
        finally:
            self._loop.close()


def start_engines(model: str, engine_kwargs: dict, enforce_eager: bool):
    """``(llm, service, raw_asyncllm or None, start seconds)``: on a GPU all three start at
    once (each given its KV-cache size: no profile to disturb), on CPU one after the other
    as before (no AsyncLLM)."""
    from vllm import LLM

    from torchrl_vllm_ext import VLLMService
    from torchrl_vllm_ext.engine.driver import cluster

    t0 = time.perf_counter()
    if not ON_GPU:
        llm = LLM(model=model, disable_log_stats=True, **engine_kwargs)
        svc = VLLMService.launch(
            model,
            num_replicas=1,
            cpus_per_replica=float(os.cpu_count()),
            health_check_interval=0,
            **engine_kwargs,
        )
        return llm, svc, None, time.perf_counter() - t0
    from devices import GPU_SHARE

    cluster.ensure_ray()  # from this thread (Ray's signal handlers); the service joins it
    raw = {**engine_kwargs, "gpu_memory_utilization": GPU_SHARE, "enforce_eager": enforce_eager}
    with ThreadPoolExecutor(2) as pool:
        service = pool.submit(
            VLLMService.launch,
            model,
            num_replicas=1,
            enforce_eager=enforce_eager,
            **gpu_service_kwargs(),
        )
        asyncllm = pool.submit(RawAsyncLLM, model, raw)
        try:
            llm = LLM(model=model, disable_log_stats=True, **raw)
            svc, engine = service.result(), asyncllm.result()
        except BaseException:
            for future in (service, asyncllm):
                if future.exception() is None:  # waits for it: nothing half-started is left
                    future.result().shutdown()
            raise
    return llm, svc, engine, time.perf_counter() - t0


def main(args) -> dict:
    from torchrl.modules.llm.policies import vLLMWrapper
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from torchrl_vllm_ext import VLLMPolicy
    from torchrl_vllm_ext._compat import CPU_KV_CACHE_BYTES_DEFAULT
    from torchrl_vllm_ext.engine.validation import make_sampling_params
    from torchrl_vllm_ext.testing import make_tiny_model

    if ON_GPU:
        model = str(make_tiny_model(dtype="bfloat16", seed=0))
        engine_kwargs = gpu_engine_kwargs()
    else:
        model = str(make_tiny_model(seed=0))
        engine_kwargs = {
            "max_model_len": 512,
            "kv_cache_memory_bytes": CPU_KV_CACHE_BYTES_DEFAULT,
            "enforce_eager": args.enforce_eager,
        }
    sampling = {"max_tokens": args.max_tokens, "ignore_eos": True, "temperature": 1.0}
    prompts = make_prompts(args.prompts)
    tokenizer = AutoTokenizer.from_pretrained(model)

    llm, svc, async_llm, start_s = start_engines(model, engine_kwargs, args.enforce_eager)
    raw_params = SamplingParams(**sampling, logprobs=0, detokenize=False)
    # AsyncLLM as a replica asks it: flat log-probs, the final output of each request only
    async_params = make_sampling_params({**sampling, "detokenize": False})
    token_prompts = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    wrapper = vLLMWrapper(
        llm, tokenizer=tokenizer, input_mode="tokens", generate_kwargs=dict(sampling)
    )
    policy = VLLMPolicy(svc, input_mode="tokens", sampling_params=sampling)
    wrapper_on_service = vLLMWrapper(
        svc, tokenizer=tokenizer, input_mode="tokens", generate_kwargs=dict(sampling)
    )

    def raw_vllm(_td):
        outs = llm.generate(token_prompts, raw_params, use_tqdm=False)
        return sum(len(c.token_ids) for o in outs for c in o.outputs)

    service_params = {**sampling, "detokenize": False}  # what the policy asks in tokens mode

    def service(_td):
        data = svc.generate_request_data(prompts, service_params)
        return sum(len(s.token_ids) for d in data for s in d.samples)

    systems = {
        "raw_vllm": raw_vllm,
        "torchrl_wrapper": lambda td: response_tokens(wrapper(td)),
        "service": service,
        "policy": lambda td: response_tokens(policy(td)),
        "torchrl_wrapper_on_service": lambda td: response_tokens(wrapper_on_service(td)),
    }
    if async_llm is not None:
        systems["raw_asyncllm"] = lambda _td: async_llm.generate(prompts, async_params)
    failed: dict[str, str] = {}
    t_rounds = time.perf_counter()
    try:
        for _ in range(1 if ON_GPU else 2):  # warm-up every path
            for name, fn in list(systems.items()):
                try:
                    fn(prompts_td(prompts))
                except Exception as e:
                    if not ON_GPU:
                        raise
                    # One GPU lease runs this once: a system that fails (TorchRL's wrapper
                    # on this vLLM, say) is reported, the others are still measured.
                    failed[name] = f"{type(e).__name__}: {e}"[:300]
                    del systems[name]
        tps: dict[str, list[float]] = {name: [] for name in systems}
        for r in range(args.rounds):
            order = list(systems) if r % 2 == 0 else list(reversed(systems))
            for name in order:
                td = prompts_td(prompts)  # the caller's input, built outside the timing
                if args.idle:
                    time.sleep(args.idle)
                start = time.perf_counter()
                tokens = systems[name](td)
                tps[name].append(tokens / (time.perf_counter() - start))
    finally:
        rounds_s = time.perf_counter() - t_rounds
        svc.shutdown()
        if async_llm is not None:
            async_llm.shutdown()
        if ON_GPU:  # this script started Ray (start_engines); vLLM's LLM goes at exit
            import ray

            ray.shutdown()
    med = {name: statistics.median(v) for name, v in tps.items()}
    baselines = ("raw_vllm", "service", "torchrl_wrapper", "torchrl_wrapper_on_service")
    bases = [b for b in (*baselines, "raw_asyncllm") if b in med and "policy" in med]

    def ratio(a: str, b: str) -> float | None:
        return round(med[a] / med[b], 3) if a in med and b in med else None

    return {
        "benchmark": "policy",
        "device": device_name(),
        "model": "tiny qwen2 (make_tiny_model)" + (", bf16, CUDA graphs" if ON_GPU else ""),
        "start_s": round(start_s, 1),
        "rounds_s": round(rounds_s, 1),
        "prompts": args.prompts,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "idle_s": args.idle,
        **{f"{name}_tokens_per_s": round(v, 1) for name, v in med.items()},
        "ratio_policy_vs_raw_vllm": ratio("policy", "raw_vllm"),
        "ratio_policy_vs_service": ratio("policy", "service"),
        "ratio_policy_vs_torchrl_wrapper": ratio("policy", "torchrl_wrapper"),
        "ratio_torchrl_wrapper_vs_raw_vllm": ratio("torchrl_wrapper", "raw_vllm"),
        "ratio_policy_vs_torchrl_wrapper_on_service": ratio("policy", "torchrl_wrapper_on_service"),
        **({"ratio_service_vs_raw_asyncllm": ratio("service", "raw_asyncllm")} if ON_GPU else {}),
        **({"failed_systems": failed} if failed else {}),
        # Per-round ratios (the systems of a round run within seconds of each other): less
        # exposed to the drift of a shared machine than ratios of medians.
        **{
            f"paired_median_policy_vs_{base}": round(
                statistics.median(p / b for p, b in zip(tps["policy"], tps[base], strict=True)), 3
            )
            for base in bases
        },
        "rounds_tokens_per_s": {name: [round(x, 1) for x in v] for name, v in tps.items()},
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument(
        "--idle", type=float, default=0.0, help="seconds idle before each timed call"
    )
    parser.add_argument("--enforce-eager", action="store_true")
    logging.basicConfig(level=logging.WARNING)
    args = parser.parse_args()
    if ON_GPU:
        apply_gpu_sizes(args, parser)
    print(json.dumps(main(args), indent=2))

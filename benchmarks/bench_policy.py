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
  (the drop-in: TorchRL's Ray-actor path, ``service.generate.remote``).

The systems run back to back, in forward then reverse order on alternate rounds, so each
is measured on an equally warm machine. No system leaves work behind when it returns (every
engine here is in-process: no engine-core busy-poll; measured: 1-3% of a core in the second
after a call). An idle gap before each timed call only adds noise on these machines: the
same Python loop runs a median 30% slower right after 1.5 s idle than straight after other
work (``--idle S`` restores a gap). Medians are reported, and the per-round (paired) ratios.

    python benchmarks/bench_policy.py [--prompts 64 --max-tokens 32 --rounds 15 --idle 0]

Prints one JSON object. Targets: ``policy / raw_vllm >= 0.97`` and
``policy / torchrl_wrapper >= 1.15``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time

import numpy as np

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
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


def main(args) -> dict:
    from torchrl.modules.llm.policies import vLLMWrapper
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from torchrl_vllm_ext import VLLMPolicy, VLLMService
    from torchrl_vllm_ext._compat import CPU_KV_CACHE_BYTES_DEFAULT
    from torchrl_vllm_ext.testing import make_tiny_model

    model = str(make_tiny_model(seed=0))
    engine_kwargs = {
        "max_model_len": 512,
        "kv_cache_memory_bytes": CPU_KV_CACHE_BYTES_DEFAULT,
        "enforce_eager": args.enforce_eager,
    }
    sampling = {"max_tokens": args.max_tokens, "ignore_eos": True, "temperature": 1.0}
    prompts = make_prompts(args.prompts)
    tokenizer = AutoTokenizer.from_pretrained(model)

    llm = LLM(model=model, disable_log_stats=True, **engine_kwargs)
    svc = VLLMService.launch(
        model,
        num_replicas=1,
        cpus_per_replica=float(os.cpu_count()),
        health_check_interval=0,
        **engine_kwargs,
    )
    raw_params = SamplingParams(**sampling, logprobs=0, detokenize=False)
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
    tps: dict[str, list[float]] = {name: [] for name in systems}
    try:
        for _ in range(2):  # warm-up every path
            for fn in systems.values():
                fn(prompts_td(prompts))
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
        svc.shutdown()  # the in-process LLM goes with the process
    med = {name: statistics.median(v) for name, v in tps.items()}
    return {
        "benchmark": "policy",
        "model": "tiny qwen2 (make_tiny_model)",
        "prompts": args.prompts,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "idle_s": args.idle,
        **{f"{name}_tokens_per_s": round(v, 1) for name, v in med.items()},
        "ratio_policy_vs_raw_vllm": round(med["policy"] / med["raw_vllm"], 3),
        "ratio_policy_vs_service": round(med["policy"] / med["service"], 3),
        "ratio_policy_vs_torchrl_wrapper": round(med["policy"] / med["torchrl_wrapper"], 3),
        "ratio_torchrl_wrapper_vs_raw_vllm": round(med["torchrl_wrapper"] / med["raw_vllm"], 3),
        "ratio_policy_vs_torchrl_wrapper_on_service": round(
            med["policy"] / med["torchrl_wrapper_on_service"], 3
        ),
        # Per-round ratios (the systems of a round run within seconds of each other): less
        # exposed to the drift of a shared machine than ratios of medians.
        **{
            f"paired_median_policy_vs_{base}": round(
                statistics.median(p / b for p, b in zip(tps["policy"], tps[base], strict=True)), 3
            )
            for base in ("raw_vllm", "service", "torchrl_wrapper", "torchrl_wrapper_on_service")
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
    print(json.dumps(main(parser.parse_args()), indent=2))

"""The package's own ceiling: the tokens/s it carries from engine outputs to TorchRL's layout
when the engine answers at once (a CPU guard for what GPU token rates would expose).

The replicas drive :class:`~torchrl_vllm_ext.testing.instant.InstantEngine` instead of
vLLM's (``engine_cls``): each request is answered at once with precomputed tokens and
log-probs, as finished vLLM ``RequestOutput``s. Everything else is the real path: Ray
actors started by ``VLLMService.launch``, validation and routing, the prompts crossing Ray
as columns, the replica's ``generate`` (per-request ids, seeds, cache salts,
``pack_outputs``), the ``RequestBatch`` crossing back, the merge, and ``VLLMPolicy``'s
conversion. Left out: vLLM's scheduler, forward passes, sampling, output processor and
detokenisation, which a GPU run adds on top (``bench_policy.py`` on a GPU).

Systems, timed in alternating rounds on the same prompts, no idle gap between calls:

- ``stand_in``: the stand-in's answer plus ``pack_outputs``, in this process (what a
  replica does per batch, without Ray or the service): the reference the others divide;
- ``service``: ``service.generate_request_batch`` (the columnar result, no objects);
- ``policy``: ``VLLMPolicy(td)``, tokens in, TorchRL's layout out (``pad_output=False``);
- ``policy_padded``: the same with ``pad_output=True``.

    python benchmarks/bench_ceiling.py [--prompts 256 --max-tokens 256 --rounds 10 --replicas 1]

Prints one JSON object last: medians, the per-round (paired) ratios to ``stand_in`` and
``service``. No target: a slowdown of the package's layer shows as a lower ceiling.
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

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def make_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 500, size=int(rng.integers(8, 24))).tolist() for _ in range(n)]


def prompts_td(prompts):
    import torch
    from tensordict import TensorDict, lazy_stack

    return lazy_stack([TensorDict({("tokens", "prompt"): torch.tensor(p)}) for p in prompts])


def response_tokens(td) -> int:
    return sum(len(r) for r in td.get(("tokens", "response"), as_list=True))


def stand_in(model: str, max_model_len: int):
    """``fn(prompts, sampling) -> tokens``: the stand-in engine plus ``pack_outputs`` here."""
    from types import SimpleNamespace

    from torchrl_vllm_ext.engine.outputs import pack_outputs
    from torchrl_vllm_ext.engine.validation import make_sampling_params
    from torchrl_vllm_ext.testing.instant import InstantEngine

    engine = asyncio.run(
        InstantEngine.start(SimpleNamespace(model=model, max_model_len=max_model_len))
    )

    def run(prompts, sampling) -> int:
        params = make_sampling_params(sampling)
        inputs = [{"prompt_token_ids": p, "cache_salt": "e0"} for p in prompts]
        ids = [f"s-{i}" for i in range(len(prompts))]
        outs = asyncio.run(engine.generate(inputs, [params] * len(prompts), ids))
        return int(pack_outputs(outs, 0, "0", "0").sample_lengths.sum())

    return run


def main(args) -> dict:
    from torchrl_vllm_ext import VLLMPolicy, VLLMService
    from torchrl_vllm_ext.testing import make_tiny_model
    from torchrl_vllm_ext.testing.instant import INSTANT_ENGINE

    model = str(make_tiny_model(seed=0))
    max_model_len = 1024
    sampling = {"max_tokens": args.max_tokens, "ignore_eos": True, "temperature": 1.0}
    prompts = make_prompts(args.prompts)
    local = stand_in(model, max_model_len)
    t0 = time.perf_counter()
    svc = VLLMService.launch(
        model,
        num_replicas=args.replicas,
        cpus_per_replica=args.cpus_per_replica,
        engine_cls=INSTANT_ENGINE,
        health_check_interval=0,
        max_model_len=max_model_len,
    )
    launch_s = time.perf_counter() - t0
    try:
        policy = VLLMPolicy(svc, input_mode="tokens", sampling_params=sampling)
        padded = VLLMPolicy(svc, input_mode="tokens", sampling_params=sampling, pad_output=True)

        def service(_td) -> int:
            return int(svc.generate_request_batch(prompts, sampling).sample_lengths.sum())

        systems = {
            "stand_in": lambda _td: local(prompts, sampling),
            "service": service,
            "policy": lambda td: response_tokens(policy(td)),
            # every sample has max_tokens tokens (ignore_eos): no padding inside the count
            "policy_padded": lambda td: padded(td).get(("tokens", "response")).numel(),
        }
        tps: dict[str, list[float]] = {name: [] for name in systems}
        # warm-up every path; each must carry every token
        tokens_per_call = {name: int(fn(prompts_td(prompts))) for name, fn in systems.items()}
        for r in range(args.rounds):
            order = list(systems) if r % 2 == 0 else list(reversed(systems))
            for name in order:
                td = prompts_td(prompts)  # the caller's input, built outside the timing
                start = time.perf_counter()
                tokens = systems[name](td)
                tps[name].append(tokens / (time.perf_counter() - start))
    finally:
        svc.shutdown()
    med = {name: statistics.median(v) for name, v in tps.items()}

    def paired(a: str, b: str) -> float:
        return round(statistics.median(x / y for x, y in zip(tps[a], tps[b], strict=True)), 3)

    return {
        "benchmark": "ceiling",
        "engine": "InstantEngine (answers at once: no vLLM scheduling, model or sampling)",
        "includes": "launch, validation, routing, Ray both ways, the replica's generate and "
        "pack_outputs, merge, VLLMPolicy conversion",
        "excludes": "vLLM's scheduler, forward passes, sampling, output processor, detokenisation",
        "prompts": args.prompts,
        "max_tokens": args.max_tokens,
        "replicas": args.replicas,
        "rounds": args.rounds,
        "launch_s": round(launch_s, 1),
        "tokens_per_call": tokens_per_call,
        **{f"{name}_tokens_per_s": round(v, 1) for name, v in med.items()},
        **{f"paired_{a}_vs_stand_in": paired(a, "stand_in") for a in systems if a != "stand_in"},
        "paired_policy_vs_service": paired("policy", "service"),
        "paired_policy_padded_vs_service": paired("policy_padded", "service"),
        "rounds_tokens_per_s": {name: [round(x, 1) for x in v] for name, v in tps.items()},
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--cpus-per-replica", type=float, default=1.0)
    return p


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    print(json.dumps(main(parser().parse_args()), indent=2))

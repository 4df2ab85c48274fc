"""Prefix-cache hits of multi-turn chats: session-sticky routing against round robin.

``--sessions`` chats of ``--turns`` turns run side by side on two replicas, a turn of
every chat per ``generate_request_batch`` call (as a collector steps a batch of envs): turn 1 is a
distinct random prompt, turn ``k + 1`` is turn ``k``'s prompt and reply plus a few new
"user" tokens. For turns 2 and later, the hit rate is the share of prompt tokens that
vLLM served from its prefix cache (``RequestOutput.num_cached_tokens``), with
``routing=("session", "least_outstanding")`` (each turn goes to the replica that served
the previous one), ``"least_outstanding"`` and ``"round_robin"``. They run in a rotating
order each repeat, on fresh prompts; medians are reported. vLLM-CPU caches 128-token
blocks, hence the long turns. An odd number of chats keeps round robin from pinning
every chat to one replica by accident (the cursor moves by the batch size).

    python benchmarks/bench_multiturn.py [--sessions 31] [--turns 4] [--repeats 3]

Prints one JSON object.
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

ROUTINGS = {
    "session": ("session", "least_outstanding"),
    "least_outstanding": ("least_outstanding",),
    "round_robin": ("round_robin",),
}


def run_chats(svc, routing, args, rng: np.random.Generator) -> dict:
    """One run of every chat; hit rate and seconds of turns 2+."""
    params = {"max_tokens": args.reply_tokens, "ignore_eos": True, "temperature": 1.0}
    prompts = [rng.integers(5, 400, args.prompt_tokens).tolist() for _ in range(args.sessions)]
    cached = total = 0
    seconds = 0.0
    for turn in range(args.turns):
        start = time.perf_counter()
        out = svc.generate_request_batch(prompts, params, routing=routing)
        if turn > 0:
            seconds += time.perf_counter() - start
            cached += int(out.cached_tokens.sum())
            total += int(out.prompt_lengths.sum())
        replies = np.split(out.token_ids, np.cumsum(out.sample_lengths)[:-1])
        prompts = [
            p + r.tolist() + rng.integers(5, 400, args.user_tokens).tolist()
            for p, r in zip(prompts, replies, strict=True)
        ]
    return {"hit_rate": cached / total, "turn_s": seconds / (args.turns - 1)}


def main(args) -> dict:
    from torchrl_vllm_ext import VLLMService
    from torchrl_vllm_ext.testing import make_tiny_model

    rng = np.random.default_rng(0)
    runs: dict[str, list[dict]] = {name: [] for name in ROUTINGS}
    with VLLMService.launch(
        make_tiny_model(seed=0),
        num_replicas=2,
        cpus_per_replica=1.0,
        dtype="float32",
        max_model_len=1024,
        enforce_eager=True,
        health_check_interval=0,
    ) as svc:
        for i in range(args.repeats):
            names = list(ROUTINGS)
            for name in names[i % len(names) :] + names[: i % len(names)]:
                runs[name].append(run_chats(svc, ROUTINGS[name], args, rng))

    def med(name, key):
        return round(statistics.median(r[key] for r in runs[name]), 3)

    return {
        "task": (
            f"{args.sessions} chats x {args.turns} turns on 2 replicas; prompt "
            f"{args.prompt_tokens} + per turn {args.reply_tokens} reply + {args.user_tokens} user tokens"
        ),
        "repeats": args.repeats,
        **{f"{name}_hit_rate_turn2plus": med(name, "hit_rate") for name in ROUTINGS},
        **{f"{name}_turn_s": med(name, "turn_s") for name in ROUTINGS},
        "session_over_round_robin_turn_time": round(
            med("session", "turn_s") / med("round_robin", "turn_s"), 3
        ),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=31)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--reply-tokens", type=int, default=64)
    parser.add_argument("--user-tokens", type=int, default=32)
    logging.basicConfig(level=logging.WARNING)
    print(json.dumps(main(parser.parse_args()), indent=2))

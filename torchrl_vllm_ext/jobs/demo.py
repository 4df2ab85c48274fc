"""``torchrl-vllm demo``: the GRPO main job (see :func:`torchrl_vllm_ext.grpo.run.run_grpo`).

With no flags: builds the tiny random model, starts a local Ray cluster with two vLLM
replicas and trains the model with GRPO on TokenCountEnv, pushing the weights to the
replicas after every step; writes ``reward_curve.png``, ``metrics.json`` and
``rollouts/`` (a memmapped TensorDict) to ``--output``.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

logger = logging.getLogger(__name__)


def add_parser(sub) -> argparse.ArgumentParser:
    from torchrl_vllm_ext.grpo.config import GRPOConfig

    d = GRPOConfig()
    p = sub.add_parser(
        "demo",
        help="train a model with GRPO on vLLM replicas (the main job)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default=None, help="local HF causal LM (default: tiny random)")
    p.add_argument("--output", type=Path, default=d.output, help=f"(default {d.output})")
    p.add_argument("--steps", type=int, default=d.steps, help=f"GRPO steps ({d.steps})")
    p.add_argument("--group-size", type=int, default=d.group_size, help="samples per prompt")
    p.add_argument("--prompts", type=int, default=d.prompts_per_step, help="prompts per step")
    p.add_argument("--replicas", type=int, default=d.replicas)
    p.add_argument("--transport", choices=("auto", "storage", "broadcast"), default=d.transport)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--dtype", default=d.dtype, choices=("float32", "bfloat16", "float16"))
    p.add_argument("--high", type=int, default=d.high, help="one past the alphabet's last id")
    p.add_argument("--cpus-per-replica", type=float, default=d.cpus_per_replica)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from torchrl_vllm_ext.grpo.config import GRPOConfig
    from torchrl_vllm_ext.grpo.report import breakdown_table
    from torchrl_vllm_ext.grpo.run import run_grpo

    cfg = GRPOConfig(
        model=args.model,
        output=args.output,
        steps=args.steps,
        prompts_per_step=args.prompts,
        group_size=args.group_size,
        replicas=args.replicas,
        transport=args.transport,
        lr=args.lr,
        seed=args.seed,
        dtype=args.dtype,
        high=args.high,
        cpus_per_replica=args.cpus_per_replica,
    )
    result = run_grpo(cfg, progress=not args.no_progress)
    s = result["summary"]
    reached = (
        f"step {s['target_reached_step']} ({s['target_reached_s']:.0f} s)"
        if s["target_reached_step"] is not None
        else "not reached"
    )
    print(
        f"\nreward: {s['reward_start']:.3f} (step 0; random policy "
        f"{s['random_policy_reward']:.3f}) -> {s['reward_end']:.3f} (last 10); "
        f"{s['target_reward']:.0%} of max: {reached}; replicas up in {s['startup_s']:.0f} s, "
        f"training {s['train_wall_s']:.0f} s; max |KL(trainer, engine)| on fresh samples "
        f"{s['max_abs_kl_to_engine']:.1e}\n"
    )
    print(breakdown_table(s))
    print()
    print(json.dumps({"summary": s, "files": result["files"]}, indent=2))
    return 0

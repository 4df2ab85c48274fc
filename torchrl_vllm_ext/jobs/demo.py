"""torchrl-vllm demo: train a model with GRPO on vLLM replicas (the main job).

With no flags: builds a tiny random model, starts a local Ray cluster with two vLLM
replicas and trains the model with GRPO on a token-counting task, pushing the weights to
the replicas after every step. Writes reward_curve.png, metrics.json and rollouts/ (a
memory-mapped TensorDict) to --output.
"""

from __future__ import annotations

import argparse
import logging

from torchrl_vllm_ext.engine.placement import PLACEMENTS
from torchrl_vllm_ext.grpo.config import STALE_POLICIES
from torchrl_vllm_ext.losses.correction import MODES
from torchrl_vllm_ext.weight_sync.transports import registry

logger = logging.getLogger(__name__)


# Config fields the command line sets, and their flags.
FLAGS = {
    "model": "--model",
    "output": "--output",
    "steps": "--steps",
    "group_size": "--group-size",
    "prompts_per_step": "--prompts",
    "replicas": "--replicas",
    "trainer_ranks": "--trainer-ranks",
    "transport": "--transport",
    "delta": "--delta",
    "lr": "--lr",
    "entropy_coeff": "--entropy-coeff",
    "kl_coef": "--kl-coef",
    "lora_rank": "--lora-rank",
    "ref_replicas": "--ref-replicas",
    "seed": "--seed",
    "dtype": "--dtype",
    "replica_dtype": "--replica-dtype",
    "rollout_correction": "--rollout-correction",
    "is_clip": "--is-clip",
    "is_clip_low": "--is-clip-low",
    "high": "--high",
    "cpus_per_replica": "--cpus-per-replica",
    "ray_address": "--ray-address",
    "placement": "--placement",
    "async_mode": "--async",
    "max_policy_lag": "--max-policy-lag",
    "in_flight_updates": "--in-flight-updates",
    "stale_policy": "--stale-policy",
}
DTYPES = ("float32", "bfloat16", "float16")
CHOICES = {
    "transport": registry.names(cpu=True),
    "delta": ("auto", "on", "off"),
    "dtype": DTYPES,
    "replica_dtype": DTYPES,
    "rollout_correction": MODES,
    "placement": PLACEMENTS,
    "stale_policy": STALE_POLICIES,
}


def add_parser(sub) -> argparse.ArgumentParser:
    from torchrl_vllm_ext.grpo.config import GRPOConfig
    from torchrl_vllm_ext.jobs.flags import add_config_flags

    p = sub.add_parser(
        "demo",
        help="train a model with GRPO on vLLM replicas (the main job)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_flags(p, GRPOConfig, FLAGS, CHOICES)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from torchrl_vllm_ext.grpo.config import GRPOConfig
    from torchrl_vllm_ext.grpo.report import breakdown_table, mismatch_table
    from torchrl_vllm_ext.grpo.run import run_grpo
    from torchrl_vllm_ext.jobs.flags import config_from_args
    from torchrl_vllm_ext.jobs.logs import job_log_file

    cfg = config_from_args(GRPOConfig, args, FLAGS)
    if not args.verbose:
        cfg.log_file = job_log_file(cfg.output)
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
        f"training {s['train_wall_s']:.0f} s; max |KL(trainer, engine)| on "
        f"{'samples up to the lag behind' if cfg.async_mode else 'fresh samples'} "
        f"{s['max_abs_kl_to_engine']:.1e}\n"
    )
    if cfg.async_mode:
        print(
            f"async, lag {cfg.max_policy_lag} ({cfg.stale_policy}, pushes "
            f"{'in flight' if cfg.in_flight_updates else 'between generations'}): median wall "
            f"step {s['median_wall_step_s']:.3f} s (the phases below overlap); idle: trainer "
            f"{s['trainer_idle_ratio']:.0%}, rollout {s['rollout_idle_ratio']:.0%}; versions "
            f"behind {s['staleness_mean']:.2f} mean, {s['staleness_max']} max; partial "
            f"{s['partial_ratio']:.0%}; stale tokens left out {s['stale_masked_tokens']}"
        )
    if "median_ref_s" in s:
        print(
            f"KL to the reference: {s['kl_to_ref_start']:.3f} -> {s['kl_to_ref_end']:.3f}; "
            f"reference scoring {s['median_ref_s']:.3f} s per step "
            f"({s['ref_share_of_step']:.0%} of the step, inside generate)"
        )
    print(breakdown_table(s))
    if "sync_sent_share_total" in s:
        print(
            f"weight pushes sent {s['sync_sent_share_total']:.1%} of the pushed bytes "
            f"({s['sync_delta_pushes']} of {len(result['steps'])} pushes were deltas; "
            "full pushes of 16-bit replicas send half: the served dtype)"
        )
    if "mismatch" in s:
        print()
        print(mismatch_table(s))
    files = result["files"]
    print(
        f"\nwrote {files['reward_curve']}, {files['metrics']} (every figure), {files['rollouts']}"
    )
    if cfg.log_file is not None:
        print(f"log (vLLM, Ray, the replicas, every weight push): {cfg.log_file}")
    return 0

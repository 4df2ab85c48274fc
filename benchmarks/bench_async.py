"""Asynchronous GRPO against the synchronous job: the demo on the same seed and steps.

Runs ``torchrl-vllm demo`` (each run its own process, Ray cluster and two replicas) as
``sync`` and as ``--async --max-policy-lag K`` for each K of ``--lags``, in alternating
order, ``--rounds`` times, and reports per system the medians over the rounds of: the
training wall clock (replicas' start excluded), the reward at the end (mean of the last
10 steps), the wall clock to 80% reward (None when not reached), the trainer and rollout
idle ratios, the staleness (mean / max versions behind), the median wall step and the
fleet's tokens per second; ``wall_ratio_sync_over_<system>`` is the sync run's training
wall clock over that system's (above 1: faster than sync).

Where the time goes: the synchronous run's median phases (``generate``, ``score``,
``train``, ``sync``) and its median wall step; the trainer's side of it is the wall step
less the generation (scoring, update, push and the loop's own work). On separate hardware
for the rollout side and the trainer (a GPU split) the asynchronous step is
``max(generate, trainer side)`` against the synchronous wall step:
``expected_split_speedup`` is that ratio from the measured phases. On a machine whose cores the trainer and the replicas share,
the overlap is bounded by those cores; the measured ratio says how much.

    python benchmarks/bench_async.py [--steps 100] [--rounds 2] [--lags 1,2]

Prints one JSON object last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run_demo(out: Path, steps: int, seed: int, extra: list[str]) -> dict:
    """One demo run in its own process; its metrics.json."""
    args = [sys.executable, "-m", "torchrl_vllm_ext.cli", "demo", "--steps", str(steps),
            "--seed", str(seed), "--output", str(out), "--no-progress", *extra]  # fmt: skip
    start = time.perf_counter()
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed:\n{done.stderr[-3000:]}")
    metrics = json.loads((out / "metrics.json").read_text())
    metrics["process_s"] = time.perf_counter() - start
    return metrics


def figures(metrics: dict) -> dict:
    """The figures of one run."""
    s = metrics["summary"]
    return {
        "train_wall_s": s["train_wall_s"],
        "reward_end": s["reward_end"],
        "target_reached_step": s["target_reached_step"],
        "target_reached_s": s["target_reached_s"],
        "trainer_idle_ratio": s["trainer_idle_ratio"],
        "rollout_idle_ratio": s["rollout_idle_ratio"],
        "staleness_mean": s["staleness_mean"],
        "staleness_max": s["staleness_max"],
        "stale_samples": s["stale_samples"],
        "median_wall_step_s": s["median_wall_step_s"],
        "median_fleet_tokens_per_s": s["median_fleet_tokens_per_s"],
        "median_breakdown_s": s["median_breakdown_s"],
    }


def median_of(runs: list[dict]) -> dict:
    """Medians over the rounds (None where a run did not reach the target)."""
    out = {}
    for key, value in runs[0].items():
        if key == "median_breakdown_s":
            out[key] = {p: statistics.median(r[key][p] for r in runs) for p in value}
            continue
        values = [r[key] for r in runs]
        reached = [v for v in values if v is not None]
        out[key] = statistics.median(reached) if len(reached) == len(values) else None
        if key.startswith("target") and reached and len(reached) < len(values):
            out[f"{key}_reached_in"] = f"{len(reached)} of {len(values)} rounds"
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lags", default="1,2", help="max policy lags of the async runs")
    parser.add_argument(
        "--in-flight-updates", action="store_true", help="async pushes land mid-generation"
    )
    args = parser.parse_args()
    systems = {"sync": []}
    for lag in (int(k) for k in args.lags.split(",")):
        extra = ["--async", "--max-policy-lag", str(lag)]
        systems[f"async_lag{lag}"] = extra + (
            ["--in-flight-updates"] if args.in_flight_updates else []
        )
    runs: dict[str, list[dict]] = {name: [] for name in systems}
    order = list(systems)
    with tempfile.TemporaryDirectory(prefix="bench-async-") as tmp:
        for r in range(args.rounds):
            for name in order if r % 2 == 0 else order[::-1]:  # alternate which goes first
                out = Path(tmp) / f"{name}-{r}"
                metrics = run_demo(out, args.steps, args.seed, systems[name])
                runs[name].append(figures(metrics))
                print(f"round {r} {name}: {json.dumps(runs[name][-1])}", file=sys.stderr)
    result = {name: median_of(values) for name, values in runs.items()}
    sync = result["sync"]
    phases = sync["median_breakdown_s"]
    # The trainer's side of a synchronous step: everything but the generation (its
    # scoring, update and push, and the loop's own work: recording, metrics).
    step = sync["median_wall_step_s"]
    trainer_side = step - phases["generate"]
    summary = {
        "steps": args.steps,
        "rounds": args.rounds,
        "seed": args.seed,
        "in_flight_updates": args.in_flight_updates,
        "sync_phases_s": phases,
        "sync_trainer_side_s": trainer_side,
        "expected_split_speedup": step / max(phases["generate"], trainer_side),
    }
    for name, fig in result.items():
        if name != "sync":
            summary[f"wall_ratio_sync_over_{name}"] = sync["train_wall_s"] / fig["train_wall_s"]
            summary[f"trainer_idle_{name}_vs_sync"] = (
                fig["trainer_idle_ratio"],
                sync["trainer_idle_ratio"],
            )
    print(json.dumps({"systems": result, **summary}, indent=2))


if __name__ == "__main__":
    main()

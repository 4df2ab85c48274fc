"""What a GRPO run leaves behind: summary figures, the step-time breakdown, the reward plot
(with the trainer-engine mismatch of every batch beside it)."""

from __future__ import annotations

import statistics
from pathlib import Path

from torchrl_vllm_ext.grpo.async_metrics import plot_idle

PHASES = ("generate", "score", "train", "sync")
PHASE_HELP = {
    "generate": "collector: vLLM sampling on the replicas + env reward",
    "score": "trainer log-probs of the samples (GRPOLoss forward)",
    "train": "backward + Adam step",
    "sync": "push the weights to every replica (WeightSyncScheme)",
}
MISMATCH_FIGURES = (
    "kl_k3",
    "logp_abs_diff_mean",
    "logp_abs_diff_max",
    "chi2_token",
    "chi2_seq",
    "is_ratio_min",
    "is_ratio_max",
    "ess",
    "clipped_fraction",
    "masked_fraction",
)
"""The mismatch figures the summary gives at the start, middle and end of a run."""
LOG_FLOOR = 1e-12
"""Mismatch values below this are drawn at it (a log axis has no 0: fp32 replicas often
match the trainer exactly)."""


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to ``window`` values.

    Examples:
        >>> moving_average([0.0, 1.0, 2.0, 3.0], 2)
        [0.0, 0.5, 1.5, 2.5]
    """
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def summarize(steps: list[dict], *, target: float, random_reward: float, window: int = 10) -> dict:
    """Reward at start and end, time to the target, and the median step-time breakdown.

    ``steps`` are the per-step metrics of the run (``reward``, ``elapsed_s`` and one
    ``<phase>_s`` per phase).
    """
    rewards = [s["reward"] for s in steps]
    smooth = moving_average(rewards, window)
    reached = next((i for i, r in enumerate(smooth) if i + 1 >= window and r >= target), None)
    breakdown = {p: statistics.median(s[f"{p}_s"] for s in steps) for p in PHASES}
    step_s = sum(breakdown.values())
    return {
        "random_policy_reward": random_reward,
        "reward_start": rewards[0],  # step 0 samples the untrained model
        "reward_end": statistics.fmean(rewards[-window:]),
        "reward_best_moving_avg": max(smooth[window - 1 :] or smooth),
        "target_reward": target,
        "target_reached_step": reached,
        "target_reached_s": None if reached is None else steps[reached]["elapsed_s"],
        "train_wall_s": steps[-1]["elapsed_s"],
        "median_step_s": step_s,
        "median_breakdown_s": breakdown,
        "median_tokens_per_s": statistics.median(s["tokens_per_s"] for s in steps),
        "max_abs_kl_to_engine": max(abs(s["kl_to_engine"]) for s in steps),
        **sync_summary(steps),
        **reference_summary(steps, step_s),
        **mismatch_summary(steps, step_s, window=window),
    }


def sync_summary(steps: list[dict]) -> dict:
    """What the pushes moved: the share of the pushed bytes sent (a bf16 full push of fp32
    weights sends 0.5; a delta push far less) and how many pushes were deltas."""
    shares = [s["sync_sent_share"] for s in steps if "sync_sent_share" in s]
    if not shares:
        return {}
    return {
        "sync_sent_share_median": statistics.median(shares),
        "sync_sent_share_total": statistics.fmean(shares),
        "sync_delta_pushes": sum(bool(s.get("sync_delta")) for s in steps),
    }


def reference_summary(steps: list[dict], step_s: float) -> dict:
    """With a reference model: its scoring time per step (and share of the median step)
    and the KL to it at the start and the end."""
    if not all("ref_s" in s and "kl_to_ref" in s for s in steps):
        return {}
    ref_s = statistics.median(s["ref_s"] for s in steps)
    return {
        "median_ref_s": ref_s,
        "ref_share_of_step": ref_s / step_s if step_s else 0.0,
        "kl_to_ref_start": steps[0]["kl_to_ref"],
        "kl_to_ref_end": statistics.fmean(s["kl_to_ref"] for s in steps[-10:]),
    }


def mismatch_summary(steps: list[dict], step_s: float, *, window: int = 10) -> dict:
    """The trainer-engine mismatch at the start, middle and end of the run (each the mean
    over ``window`` steps of the per-batch figure), and what measuring it cost per step
    (``mismatch_s``, the loss's metrics and weights; its median share of the median step).

    Examples:
        >>> steps = [{"mismatch_s": 0.001, **{f"mismatch_{k}": float(i) for k in
        ...          MISMATCH_FIGURES}} for i in range(30)]
        >>> out = mismatch_summary(steps, step_s=0.2)
        >>> out["mismatch"]["kl_k3"], round(out["mismatch_share_of_step"], 4)
        ({'start': 4.5, 'middle': 14.5, 'end': 24.5}, 0.005)
    """
    if not steps or not all("mismatch_s" in s for s in steps):
        return {}
    mid = max(0, len(steps) // 2 - window // 2)
    spans = {"start": steps[:window], "middle": steps[mid : mid + window], "end": steps[-window:]}
    figures = {
        name: {
            span: statistics.fmean(s[f"mismatch_{name}"] for s in chunk)
            for span, chunk in spans.items()
        }
        for name in MISMATCH_FIGURES
        if all(f"mismatch_{name}" in s for s in steps)
    }
    cost = statistics.median(s["mismatch_s"] for s in steps)
    return {
        "mismatch": figures,
        "median_mismatch_s": cost,
        "mismatch_share_of_step": cost / step_s if step_s else 0.0,
    }


def mismatch_postfix(metrics: dict) -> dict[str, str]:
    """The progress bar's mismatch entries for one step: k3 KL, and the fraction the
    correction clipped or masked when it did any.

    Examples:
        >>> mismatch_postfix({"mismatch_kl_k3": 2e-4, "mismatch_clipped_fraction": 0.01,
        ...                   "mismatch_masked_fraction": 0.0})
        {'kl3': '2.0e-04', 'clip': '1.0%'}
    """
    if "mismatch_kl_k3" not in metrics:
        return {}
    out = {"kl3": f"{metrics['mismatch_kl_k3']:.1e}"}
    for name, short in (("clipped_fraction", "clip"), ("masked_fraction", "mask")):
        value = metrics.get(f"mismatch_{name}", 0.0)
        if value:
            out[short] = f"{value:.1%}"
    return out


TERMINAL_MISMATCH = ("kl_k3", "logp_abs_diff_max", "clipped_fraction", "masked_fraction")
"""The mismatch figures the terminal shows (every one is in metrics.json, per step)."""


def mismatch_table(summary: dict) -> str:
    """Two printable lines: the main mismatch figures at the start, middle and end of the
    run, and what measuring them cost."""
    figures = summary["mismatch"]
    shown = [
        f"{name} " + " / ".join(f"{v:.1e}" for v in figures[name].values())
        for name in TERMINAL_MISMATCH
        if name in figures
    ]
    return (
        "mismatch, start / middle / end: " + "; ".join(shown) + "\n"
        f"measured in {summary['median_mismatch_s'] * 1e3:.2f} ms per step "
        f"({summary['mismatch_share_of_step']:.2%} of the median step); every figure per step "
        "in metrics.json"
    )


def breakdown_table(summary: dict) -> str:
    """A printable table of the median GRPO step: one line per phase, its share and meaning."""
    parts = summary["median_breakdown_s"]
    total = sum(parts.values()) or 1.0
    lines = [f"{'phase':<9}{'median s':>10}{'share':>8}  what"]
    for p in PHASES:
        lines.append(f"{p:<9}{parts[p]:>10.3f}{parts[p] / total:>8.0%}  {PHASE_HELP[p]}")
    lines.append(f"{'step':<9}{total:>10.3f}{1:>8.0%}")
    return "\n".join(lines)


def plot_run(steps: list[dict], summary: dict, path: Path, *, window: int = 10) -> Path:
    """Reward per step (raw and moving average, random level, target), the mismatch and
    the idle ratios and staleness when the steps carry them, and step times."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and CI
    import matplotlib.pyplot as plt

    x = [s["step"] for s in steps]
    rewards = [s["reward"] for s in steps]
    panels = [("reward", 2.0)]
    if all("mismatch_kl_k3" in s for s in steps):
        panels.append(("mismatch", 1.2))
    if all("trainer_idle_ratio" in s for s in steps):
        panels.append(("idle", 1.0))
    panels.append(("time", 1.0))
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(8, 2.5 + 2.2 * (len(panels) - 1)), sharex=True,
        gridspec_kw={"height_ratios": [h for _, h in panels]},
    )  # fmt: skip
    axis = dict(zip([name for name, _ in panels], axes, strict=True))
    top, bottom = axis["reward"], axis["time"]
    if "mismatch" in axis:
        plot_mismatch(axis["mismatch"], steps)
    if "idle" in axis:
        plot_idle(axis["idle"], steps)
    top.plot(x, rewards, color="tab:blue", alpha=0.35, label="reward (batch mean)")
    top.plot(x, moving_average(rewards, window), color="tab:blue", label=f"{window}-step mean")
    top.axhline(summary["random_policy_reward"], color="grey", ls=":", label="random policy")
    top.axhline(summary["target_reward"], color="tab:green", ls="--", label="target")
    top.set_ylim(0, 1.05)
    top.set_ylabel("reward")
    top.set_title("GRPO on vLLM replicas: TokenCountEnv")
    handles = top.get_legend_handles_labels()[0]
    if all("entropy" in s for s in steps):
        # Entropy near 0 while the reward is below 1 is a stall: a group's samples agree.
        right = top.twinx()
        (line,) = right.plot(
            x, [s["entropy"] for s in steps], color="tab:purple", lw=0.8, alpha=0.7,
            label="sampling entropy (right)",
        )  # fmt: skip
        right.set_ylim(bottom=0)
        right.set_ylabel("entropy of the samples (nats)")
        handles.append(line)
    top.legend(handles=handles, loc="lower right")
    # Step 0 pays one-time costs when there are any (first calls, a GPU's graph capture):
    # it is drawn apart, as a note, so the later steps' phases keep a readable scale.
    warm, later = steps[0], steps[1:] or steps[:1]
    lx = [s["step"] for s in later]
    bottom_acc = [0.0] * len(later)
    for phase in PHASES:
        values = [s[f"{phase}_s"] for s in later]
        top_edge = [a + v for a, v in zip(bottom_acc, values, strict=True)]
        bottom.fill_between(lx, bottom_acc, top_edge, step="mid", alpha=0.6, label=phase)
        bottom_acc = top_edge
    bottom.set_ylim(0, 1.15 * max(bottom_acc) or 1.0)
    warm_s = sum(warm[f"{p}_s"] for p in PHASES)
    bottom.set_title(
        f"step time; step 0 (first step, not drawn): {warm_s:.2f} s", fontsize="small", loc="left"
    )
    bottom.set_ylabel("step time (s)")
    bottom.set_xlabel("GRPO step")
    bottom.legend(loc="upper right", ncol=4, fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_mismatch(axis, steps: list[dict]) -> None:
    """The trainer-engine mismatch per step on ``axis`` (log scale) and, on a right axis,
    the fraction of tokens the correction clipped or masked."""
    x = [s["step"] for s in steps]
    for name, label, color in (
        ("kl_k3", "k3 KL(engine || trainer)", "tab:red"),
        ("logp_abs_diff_mean", "mean |log p - log q|", "tab:orange"),
    ):
        values = [max(s[f"mismatch_{name}"], LOG_FLOOR) for s in steps]
        axis.plot(x, values, color=color, lw=0.9, label=label)
    axis.set_yscale("log")
    axis.set_ylabel("trainer-engine mismatch")
    axis.set_title(
        f"mismatch per batch (values below {LOG_FLOOR:.0e} drawn at it)",
        fontsize="small",
        loc="left",
    )
    handles = axis.get_legend_handles_labels()[0]
    corrected = [
        s.get("mismatch_clipped_fraction", 0.0) + s.get("mismatch_masked_fraction", 0.0)
        for s in steps
    ]
    if any(corrected):
        right = axis.twinx()
        (line,) = right.plot(
            x, corrected, color="tab:grey", lw=0.8, ls="--", label="clipped or masked (right)"
        )
        right.set_ylim(bottom=0)
        right.set_ylabel("fraction of tokens")
        handles.append(line)
    axis.legend(handles=handles, loc="upper right", fontsize="small")


__all__ = [
    "MISMATCH_FIGURES",
    "PHASES",
    "breakdown_table",
    "mismatch_postfix",
    "mismatch_summary",
    "mismatch_table",
    "moving_average",
    "plot_mismatch",
    "plot_run",
    "summarize",
]

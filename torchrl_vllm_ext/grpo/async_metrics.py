"""The asynchronous job's figures: idle ratios, staleness, partial rollouts (every step).

Every step of ``torchrl-vllm demo`` (synchronous or ``--async``) carries the keys of
:data:`STEP_KEYS` in ``metrics.json``; docs/guide/async.md names their verl equivalents.
"""

from __future__ import annotations

import statistics

import torch
from tensordict import TensorDictBase

from torchrl_vllm_ext.collectors.partial import (
    StaleTokens,
    has_token_versions,
    sample_token_versions,
)
from torchrl_vllm_ext.collectors.staleness import sample_versions
from torchrl_vllm_ext.wrappers.layout import END_VERSION_KEY, VERSION_KEY

STEP_KEYS = (
    "step_s",
    "trainer_idle_s",
    "trainer_idle_ratio",
    "rollout_idle_ratio",
    "staleness_mean",
    "staleness_max",
    "stale_samples",
    "stale_dropped",
    "stale_masked_tokens",
    "partial_ratio",
    "max_partial_span",
    "fleet_tokens_per_s",
)
"""The per-step keys of both modes (metrics.json): see :func:`batch_staleness` and
:func:`idle_figures`."""


def batch_staleness(
    batch: TensorDictBase, consumed_version: int, stale: StaleTokens | None = None
) -> dict:
    """How old the samples of one consumed batch are, against the trainer's version
    (``stale``: what the bound left out of the loss; None: nothing).

    - ``staleness_mean`` / ``staleness_max``: ``consumed_version`` minus the version each
      sample's request was admitted at (versions behind, the oldest weights that touched it);
    - ``stale_samples``: samples trained on that older weights made (behind >= 1), within
      the bound, with at least one token left for the loss (verl's
      ``stale_samples_processed``);
    - ``stale_dropped`` / ``stale_masked_tokens``: samples with every token past the bound,
      and response tokens past it, left out of the loss (:func:`exclude_stale_tokens`);
    - ``partial_ratio``: share of samples a push fell inside: tokens of more than one
      version (verl's ``partial_ratio``);
    - ``max_partial_span``: the most versions one sample spanned (its newest token's
      version minus its oldest; verl's ``max_partial_span``).

    Both read each token's version (``("vllm", "token_weight_version")``) when the rows
    carry it, else the start and end versions (a sample that finished before a push then
    counts as spanning it).

    Examples:
        >>> from tensordict import TensorDict, NonTensorStack
        >>> td = TensorDict(batch_size=[3])
        >>> _ = td.set(("vllm", "weight_version"), NonTensorStack("4", "3", "2"))
        >>> _ = td.set(("vllm", "weight_version_end"), NonTensorStack("4", "4", "2"))
        >>> import torch
        >>> stale = StaleTokens(samples=1, tokens=4, kept_tokens=8, per_sample=torch.tensor([0, 0, 4]))
        >>> out = batch_staleness(td, 4, stale)
        >>> out["staleness_max"], out["stale_samples"], out["partial_ratio"], out["max_partial_span"]
        (2, 1, 0.3333333333333333, 1)
        >>> _ = td.set(("vllm", "token_weight_version"), torch.tensor(
        ...     [[4, 4, 4], [3, 4, -1], [2, 2, 2]]))
        >>> out = batch_staleness(td, 4, stale)
        >>> out["partial_ratio"], out["max_partial_span"]
        (0.3333333333333333, 1)
    """
    start = sample_versions(batch, VERSION_KEY).reshape(-1)
    behind = int(consumed_version) - start
    span = _spans(batch, start)
    dropped, masked = (0, 0) if stale is None else (stale.samples, stale.tokens)
    return {
        "staleness_mean": int(behind.sum()) / behind.numel(),
        "staleness_max": int(behind.max()),
        # A sample left out whole is past the bound, so behind by at least 1.
        "stale_samples": int((behind >= 1).sum()) - dropped,
        "stale_dropped": dropped,
        "stale_masked_tokens": masked,
        "partial_ratio": int((span > 0).sum()) / span.numel(),
        "max_partial_span": int(span.max()),
    }


def _spans(batch: TensorDictBase, start: torch.Tensor) -> torch.Tensor:
    """Versions each sample spans: its newest token's minus its oldest (per-token key),
    else its end version minus its start."""
    if has_token_versions(batch):
        rows = sample_token_versions(batch)
        return torch.tensor(
            [int(r.max() - r.min()) if r.numel() else 0 for r in rows], dtype=torch.int64
        )
    if batch.get(END_VERSION_KEY, None) is None:
        return torch.zeros_like(start)
    return sample_versions(batch, END_VERSION_KEY).reshape(-1) - start


def idle_figures(
    *, step_s: float, trainer_idle_s: float, rollout_busy_s: float, tokens: int
) -> dict:
    """A step's idle ratios and the fleet's throughput over its wall time ``step_s``.

    ``trainer_idle_s``: the trainer waited for its batch (verl's ``trainer/idle_ratio`` is
    its share); ``rollout_busy_s``: the rollout side generated, inside this step's wall
    time (``rollout_idle_ratio`` = the rest, verl's ``rollouter/idle_ratio``); ``tokens``:
    response tokens of the step's batch (``fleet_tokens_per_s`` = tokens per wall second).

    Examples:
        >>> idle_figures(step_s=2.0, trainer_idle_s=0.5, rollout_busy_s=1.5, tokens=100)
        {'step_s': 2.0, 'trainer_idle_s': 0.5, 'trainer_idle_ratio': 0.25, 'rollout_idle_ratio': 0.25, 'fleet_tokens_per_s': 50.0}
    """
    step_s = max(step_s, 1e-9)
    return {
        "step_s": step_s,
        "trainer_idle_s": trainer_idle_s,
        "trainer_idle_ratio": min(1.0, trainer_idle_s / step_s),
        "rollout_idle_ratio": min(1.0, max(0.0, 1.0 - rollout_busy_s / step_s)),
        "fleet_tokens_per_s": tokens / step_s,
    }


def async_summary(steps: list[dict]) -> dict:
    """The run's idle and staleness figures: the means of the idle ratios and of the
    staleness over the steps after the first (step 0 waits for the first batch in either
    mode), the largest staleness and span, the totals of the stale counts, the median
    wall step and fleet throughput. Empty when the steps lack the keys."""
    if not steps or not all(k in s for s in steps for k in STEP_KEYS):
        return {}
    later = steps[1:] or steps

    def mean(key):
        return statistics.fmean(s[key] for s in later)

    return {
        "trainer_idle_ratio": mean("trainer_idle_ratio"),
        "rollout_idle_ratio": mean("rollout_idle_ratio"),
        "staleness_mean": mean("staleness_mean"),
        "staleness_max": max(s["staleness_max"] for s in steps),
        "stale_samples": sum(s["stale_samples"] for s in steps),
        "stale_dropped": sum(s["stale_dropped"] for s in steps),
        "stale_masked_tokens": sum(s["stale_masked_tokens"] for s in steps),
        "partial_ratio": mean("partial_ratio"),
        "max_partial_span": max(s["max_partial_span"] for s in steps),
        "median_wall_step_s": statistics.median(s["step_s"] for s in later),
        "median_fleet_tokens_per_s": statistics.median(s["fleet_tokens_per_s"] for s in later),
    }


def idle_postfix(metrics: dict) -> dict[str, str]:
    """The progress bar's idle and staleness entries for one step.

    Examples:
        >>> idle_postfix({"trainer_idle_ratio": 0.25, "rollout_idle_ratio": 0.5,
        ...               "staleness_mean": 0.9, "staleness_max": 1})
        {'idle_tr': '25%', 'idle_ro': '50%', 'stale': '0.9/1'}
    """
    if "trainer_idle_ratio" not in metrics:
        return {}
    return {
        "idle_tr": f"{metrics['trainer_idle_ratio']:.0%}",
        "idle_ro": f"{metrics['rollout_idle_ratio']:.0%}",
        "stale": f"{metrics['staleness_mean']:.1f}/{metrics['staleness_max']}",
    }


def plot_idle(axis, steps: list[dict]) -> None:
    """The idle ratios per step on ``axis`` (0-1) and the mean staleness on a right axis."""
    x = [s["step"] for s in steps]
    axis.plot(x, [s["trainer_idle_ratio"] for s in steps], lw=0.9, label="trainer idle")
    axis.plot(x, [s["rollout_idle_ratio"] for s in steps], lw=0.9, label="rollout idle")
    axis.set_ylim(0, 1.05)
    axis.set_ylabel("idle share of the step")
    handles = axis.get_legend_handles_labels()[0]
    right = axis.twinx()
    (line,) = right.plot(
        x, [s["staleness_mean"] for s in steps], color="tab:grey", lw=0.8, ls="--",
        label="versions behind, mean (right)",
    )  # fmt: skip
    right.set_ylim(bottom=0, top=max(1.0, max(s["staleness_max"] for s in steps)) + 0.2)
    right.set_ylabel("versions behind")
    handles.append(line)
    axis.legend(handles=handles, loc="upper right", fontsize="small", ncol=3)


__all__ = [
    "STEP_KEYS",
    "async_summary",
    "batch_staleness",
    "idle_figures",
    "idle_postfix",
    "plot_idle",
]

"""AsyncLoop: the asynchronous GRPO loop (``torchrl-vllm demo --async``).

The rollout side never waits for the trainer beyond the staleness bound:

1. a producer thread (:class:`~torchrl_vllm_ext.collectors.RolloutQueue`) runs TorchRL's
   ``LLMCollector`` batch after batch into a queue; with ``stale_policy="wait"`` a
   :class:`~torchrl_vllm_ext.collectors.StalenessGate` holds it before a batch that would
   start more than ``max_policy_lag`` versions ahead of the trainer;
2. the trainer takes the next batch in order, leaves the tokens past the bound out of
   the loss (their engine log-prob NaN: :func:`~torchrl_vllm_ext.collectors.exclude_stale_tokens`),
   takes one GRPO step with the rollout correction against the engine's log-probs, and
   records every row with its version span and the version it was consumed at;
3. it pushes the new weights: in flight (pause mode ``keep``: generations in progress go
   on with the new weights, a sample then spans versions) or once the generations in
   flight finish (``wait``), while the producer keeps collecting.

Every step's metrics carry the idle ratios and staleness of
:mod:`~torchrl_vllm_ext.grpo.async_metrics`.
"""

from __future__ import annotations

import contextlib
import logging
import time

from torchrl_vllm_ext.collectors.partial import exclude_stale_tokens
from torchrl_vllm_ext.collectors.rollout_queue import RolloutQueue
from torchrl_vllm_ext.collectors.staleness import StalenessGate
from torchrl_vllm_ext.grpo.async_metrics import batch_staleness, idle_figures, idle_postfix
from torchrl_vllm_ext.grpo.config import GRPOConfig
from torchrl_vllm_ext.grpo.report import mismatch_postfix

logger = logging.getLogger(__name__)


class AsyncLoop:
    """Train on batch ``b`` while the replicas generate batch ``b + 1`` (see the module).

    The same attributes as the synchronous loop of :mod:`~torchrl_vllm_ext.grpo.run`
    (``collector``, ``updater``, ``reference``, ``push_guard``), set by the job.
    """

    def __init__(self, cfg: GRPOConfig, trainer, recorder, model, scheme):
        self.cfg, self.trainer, self.recorder = cfg, trainer, recorder
        self.model, self.scheme = model, scheme
        self.collector = self.updater = self.reference = None
        self.push_guard = contextlib.nullcontext
        self.skipped = 0
        """Batches with no token left inside the bound (``drop``): not trained on."""

    def version(self) -> int:
        """The trainer's version: the collector's ``policy_version`` (0 before the first
        push, then the version every replica serves once a push returns; the engine's
        labels agree with it)."""
        return int(self.collector.policy_version)

    def rollouts(self) -> RolloutQueue:
        """The producer over the collector, gated with ``stale_policy="wait"``.

        With ``drop`` the queue alone bounds how far the producer runs ahead
        (``max_policy_lag`` batches waiting, one more in progress), so the bound only
        trims the edges.
        """
        gate = None
        if self.cfg.stale_policy == "wait":
            gate = StalenessGate(self.version, self.cfg.max_policy_lag)
        return RolloutQueue(
            iter(self.collector), maxsize=max(1, self.cfg.max_policy_lag), gate=gate
        )

    def run(self, progress: bool, on_step) -> list[dict]:
        from tqdm.auto import tqdm

        steps: list[dict] = []
        bar = tqdm(range(self.cfg.steps), desc="GRPO async", disable=not progress, unit="step")
        train_start = time.perf_counter()
        rollouts = self.rollouts()
        try:
            with rollouts:
                for step in bar:
                    metrics = self.step(step, rollouts)
                    metrics["elapsed_s"] = time.perf_counter() - train_start
                    steps.append(metrics)
                    bar.set_postfix(
                        reward=f"{metrics['reward']:.2f}",
                        tok_s=f"{metrics['fleet_tokens_per_s']:.0f}",
                        **idle_postfix(metrics),
                        **mismatch_postfix(metrics),
                    )
                    if on_step is not None:
                        on_step(metrics)
        finally:
            bar.close()
            self.collector.shutdown()
        return steps

    def step(self, step: int, rollouts: RolloutQueue) -> dict:
        """Wait for the next batch in order, train on it, record it, push."""
        t0 = time.perf_counter()
        busy0 = rollouts.clock.seconds()
        while True:
            item = rollouts.get()
            batch = item.batch.reshape(-1)  # one row per sample, as the trainer reads it
            consumed = self.version()
            stale = exclude_stale_tokens(batch, consumed, self.cfg.max_policy_lag)
            if stale.kept_tokens:
                break
            # Every token past the bound (drop): nothing to learn from; the next one.
            self.skipped += 1
            logger.info("batch %d: every token past the bound, skipped", item.index)
        idle_s = time.perf_counter() - t0
        metrics = self.trainer.step(batch)
        self.recorder.record(step, batch, consumed_version=consumed, stale_tokens=stale.per_sample)
        t1 = time.perf_counter()
        with self.push_guard():
            self.collector.update_policy_weights_(self.model)
        sync_s = time.perf_counter() - t1
        report = self.updater.last_report
        if self.reference is not None:
            metrics["ref_s"] = self.reference.seconds
        tokens = self.cfg.rows_per_step * self.cfg.answer_len
        metrics.update(
            step=step,
            generate_s=item.generate_s,
            gate_wait_s=item.gate_wait_s,
            sync_s=sync_s,
            sync_pause_s=max(report.pause_s.values(), default=0.0),
            sync_sent_share=getattr(report, "sent_share", 1.0),
            sync_delta=getattr(report, "base", None) is not None,
            tokens_per_s=tokens / item.generate_s,
            weight_version=self.version(),
            consumed_version=consumed,
            batch_index=item.index,
            skipped_batches=self.skipped,
            **batch_staleness(batch, consumed, stale),
            **idle_figures(
                step_s=time.perf_counter() - t0,
                trainer_idle_s=idle_s,
                rollout_busy_s=rollouts.clock.seconds() - busy0,
                tokens=tokens,
            ),
        )
        return metrics


__all__ = ["AsyncLoop"]

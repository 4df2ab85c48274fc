"""How far the trainer's log-probs of the sampled tokens are from the engine's, per batch.

The engine (vLLM) sampled every token and reported its log-prob ``log q``; the trainer
scores the same tokens, ``log p``. Per valid token ``r = p / q`` (``log r = log p - log q``);
per sequence ``rho = prod r`` over its valid tokens. Every metric is a plain function of
``log r`` and the token mask, so it can be checked by hand (tests/unit/test_rollout_correction.py);
what each one means and which figures are normal: docs/guide/mismatch.md.
"""

from __future__ import annotations

import torch

SAFE_LOG_RATIO = 20.0
"""``|log r|`` (and ``|log rho|``) are clamped to this before ``exp``: a ratio of e^20 already
says everything, and the sums and squares stay finite in float32."""

METRICS = (
    "logp_abs_diff_mean",
    "logp_abs_diff_max",
    "kl_k1",
    "kl_k3",
    "chi2_token",
    "chi2_seq",
    "is_ratio_min",
    "is_ratio_mean",
    "is_ratio_max",
    "ess",
    "tokens",
)
"""The keys :func:`mismatch_metrics` returns, in order."""


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over ``mask`` (NaN when nothing is valid: there is no figure)."""
    count = mask.sum()
    total = torch.where(mask, values, torch.zeros_like(values)).sum()
    return total / count if count > 0 else total.new_tensor(float("nan"))


def _masked_extreme(values: torch.Tensor, mask: torch.Tensor, largest: bool) -> torch.Tensor:
    if not mask.any():
        return values.new_tensor(float("nan"))
    return values[mask].max() if largest else values[mask].min()


def sequence_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``log rho`` per row: the sum of ``log r`` over its valid tokens (0 for a row with none).

    Examples:
        >>> sequence_log_ratio(torch.tensor([[0.1, 0.2], [0.3, 9.0]]),
        ...                    torch.tensor([[True, True], [True, False]]))
        tensor([0.3000, 0.3000])
    """
    return torch.where(mask, log_ratio, torch.zeros_like(log_ratio)).sum(-1)


@torch.no_grad()
def mismatch_metrics(
    trainer_log_probs: torch.Tensor, engine_log_probs: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Scalar mismatch figures of one batch; tokens outside ``mask`` count nowhere.

    Args:
        trainer_log_probs: ``(..., T)`` log-probs of the sampled tokens under the trainer.
        engine_log_probs: ``(..., T)`` the engine's log-probs of the same tokens.
        mask: ``(..., T)`` bool, the tokens that count (the response, not the padding).

    Returns:
        ``{name: 0-dim float64 tensor}`` for every :data:`METRICS` name:

        * ``logp_abs_diff_mean`` / ``_max``: mean and max of ``|log p - log q|``;
        * ``kl_k1``: mean of ``log q - log p``, the plain estimate of KL(engine || trainer)
          from the engine's samples (may be negative on a small batch);
        * ``kl_k3``: mean of ``r - 1 - log r`` (>= 0 per token), the low-variance estimate
          of the same KL;
        * ``chi2_token``: mean of ``r^2`` minus 1; ``chi2_seq``: mean of ``rho^2`` minus 1
          over the rows with a valid token (the variance an importance weight adds);
        * ``is_ratio_min`` / ``_mean`` / ``_max``: of ``r``;
        * ``ess``: ``(sum r)^2 / (n sum r^2)``, the effective sample size of the token
          weights as a fraction of the ``n`` tokens (1: all equal);
        * ``tokens``: ``n``, the valid tokens.

        With no valid token every figure but ``tokens`` is NaN (no figure, not 0).

    Examples:
        >>> m = mismatch_metrics(torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.0, -2.0]]),
        ...                      torch.tensor([[True, True]]))
        >>> float(m["kl_k3"]), float(m["ess"])
        (0.0, 1.0)
    """
    return log_ratio_metrics(trainer_log_probs.float() - engine_log_probs.float(), mask)


@torch.no_grad()
def log_ratio_metrics(log_ratio: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """:func:`mismatch_metrics` from ``log r = log p - log q`` directly."""
    mask = mask.to(torch.bool)
    # float64: fp32 replicas differ from the trainer by ~1e-7 per token, where float32's
    # r - 1 - log r is all rounding (and comes out negative).
    log_ratio = log_ratio.double().clamp(-SAFE_LOG_RATIO, SAFE_LOG_RATIO)
    log_ratio = torch.where(mask, log_ratio, torch.zeros_like(log_ratio))
    ratio = log_ratio.exp()
    rows = mask.reshape(-1, mask.shape[-1]).any(-1)
    seq_log = sequence_log_ratio(log_ratio, mask).reshape(-1).clamp(-SAFE_LOG_RATIO, SAFE_LOG_RATIO)
    ratio_sum = torch.where(mask, ratio, torch.zeros_like(ratio)).sum()
    square_sum = torch.where(mask, ratio.square(), torch.zeros_like(ratio)).sum()
    count = mask.sum()
    return {
        "logp_abs_diff_mean": _masked_mean(log_ratio.abs(), mask),
        "logp_abs_diff_max": _masked_extreme(log_ratio.abs(), mask, largest=True),
        "kl_k1": _masked_mean(-log_ratio, mask),
        "kl_k3": _masked_mean(torch.expm1(log_ratio) - log_ratio, mask),
        "chi2_token": _masked_mean(torch.expm1(2 * log_ratio), mask),
        "chi2_seq": _masked_mean(torch.expm1(2 * seq_log), rows),
        "is_ratio_min": _masked_extreme(ratio, mask, largest=False),
        "is_ratio_mean": _masked_mean(ratio, mask),
        "is_ratio_max": _masked_extreme(ratio, mask, largest=True),
        "ess": ratio_sum.square() / (count * square_sum)
        if count > 0
        else ratio_sum.new_tensor(float("nan")),
        "tokens": count.to(torch.float64),
    }


__all__ = [
    "METRICS",
    "SAFE_LOG_RATIO",
    "log_ratio_metrics",
    "mismatch_metrics",
    "sequence_log_ratio",
]

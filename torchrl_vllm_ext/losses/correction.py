"""The rollout correction: importance weights that undo the trainer-engine mismatch.

Tokens were sampled from the engine's ``q``; the gradient wants them from the trainer's
``p``. The weight ``r = p / q`` (token) or ``rho = prod r`` (sequence) corrects for it,
bounded so that a few tokens cannot dominate a batch:

============================  =====================================================
mode                          weight of a valid token
============================  =====================================================
``token_truncate`` (TIS)      ``clamp(r, low, clip)``
``token_mask`` (IcePop)       ``r`` if ``low <= r <= clip``, else 0
``sequence_truncate``         ``clamp(rho, low, clip)``, on every token of the row
``sequence_mask``             ``rho`` if ``low <= rho <= clip``, else 0 (whole row)
============================  =====================================================

``low=None`` means no lower bound (one-sided, as TIS is usually run); a lower bound
makes the mask two-sided (IcePop's ``[0.5, 2]``). Weights are constants of the loss
(no gradient flows through them) and 0 on tokens outside the mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torchrl_vllm_ext.errors import ConfigurationError
from torchrl_vllm_ext.losses.mismatch import SAFE_LOG_RATIO, sequence_log_ratio

MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
"""The correction modes, token or sequence level, truncated or masked."""


@dataclass(frozen=True)
class CorrectionWeights:
    """What a correction did to one batch (tensors shaped like its log-probs, ``(..., T)``)."""

    weights: torch.Tensor
    """The importance weight of each token (0 outside the mask and where masked)."""
    clipped: torch.Tensor
    """Bool: valid tokens whose weight a truncation bound changed."""
    masked: torch.Tensor
    """Bool: valid tokens a mask bound zeroed."""

    def fractions(self, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """``clipped_fraction`` and ``masked_fraction`` of the valid tokens, and
        ``weight_mean`` (NaN when no token is valid)."""
        count = mask.sum()
        nan = self.weights.new_tensor(float("nan"))

        def share(values):
            return values.float().sum() / count if count > 0 else nan

        return {
            "clipped_fraction": share(self.clipped & mask),
            "masked_fraction": share(self.masked & mask),
            "weight_mean": share(torch.where(mask, self.weights, 0.0)),
        }


@dataclass(frozen=True)
class RolloutCorrection:
    """A correction mode and its bounds; :meth:`weights` applies it to one batch.

    Args:
        mode: one of :data:`MODES`.
        clip: the upper bound ``C`` of the ratio (TIS uses 2.0; verl reports FP8 rollouts
            match bf16 with token TIS at 2).
        low: the lower bound (two-sided, IcePop); None: none.

    Examples:
        >>> corr = RolloutCorrection("token_truncate", clip=2.0)
        >>> log_r = torch.tensor([[0.0, 1.0, -1.0]])  # r = 1, e, 1/e
        >>> corr.weights(log_r, torch.ones(1, 3, dtype=torch.bool)).weights
        tensor([[1.0000, 2.0000, 0.3679]])
    """

    mode: str
    clip: float = 2.0
    low: float | None = None

    def __post_init__(self):
        if self.mode not in MODES:
            raise ConfigurationError(
                f"rollout correction mode {self.mode!r} is not one of {MODES}; None turns "
                "the correction off (the mismatch metrics are still reported)."
            )
        if not self.clip > 0:
            raise ConfigurationError(f"is_clip={self.clip!r} must be > 0 (TIS uses 2.0).")
        if self.low is not None and not 0 <= self.low < self.clip:
            raise ConfigurationError(
                f"is_clip_low={self.low!r} must be in [0, is_clip={self.clip!r}) "
                "(IcePop masks outside [0.5, 2.0]); None: no lower bound."
            )

    @property
    def sequence_level(self) -> bool:
        return self.mode.startswith("sequence")

    @property
    def masks(self) -> bool:
        return self.mode.endswith("mask")

    @torch.no_grad()
    def weights(self, log_ratio: torch.Tensor, mask: torch.Tensor) -> CorrectionWeights:
        """The weights of a batch whose valid tokens (``mask``) have ``log r = log_ratio``."""
        mask = mask.to(torch.bool)
        log_ratio = torch.where(mask, log_ratio.float(), 0.0)
        if self.sequence_level:
            level = sequence_log_ratio(log_ratio, mask).unsqueeze(-1).expand_as(log_ratio)
        else:
            level = log_ratio
        ratio = level.clamp(-SAFE_LOG_RATIO, SAFE_LOG_RATIO).exp()
        low = 0.0 if self.low is None else self.low
        outside = (ratio > self.clip) | (ratio < low)
        none = torch.zeros_like(mask)
        if self.masks:
            weights, clipped, masked = torch.where(outside, 0.0, ratio), none, outside & mask
        else:
            weights, clipped, masked = ratio.clamp(low, self.clip), outside & mask, none
        return CorrectionWeights(torch.where(mask, weights, 0.0), clipped, masked)


__all__ = ["MODES", "CorrectionWeights", "RolloutCorrection"]

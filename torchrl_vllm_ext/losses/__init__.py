"""Losses beside TorchRL's: trainer-engine mismatch metrics and the rollout correction
(truncated / masked importance sampling) inside TorchRL's ``GRPOLoss``."""

from torchrl_vllm_ext.losses.correction import MODES, CorrectionWeights, RolloutCorrection
from torchrl_vllm_ext.losses.grpo import CorrectedGRPOLoss, CorrectedGRPOLossOutput
from torchrl_vllm_ext.losses.mismatch import METRICS, mismatch_metrics

__all__ = [
    "METRICS",
    "MODES",
    "CorrectedGRPOLoss",
    "CorrectedGRPOLossOutput",
    "CorrectionWeights",
    "RolloutCorrection",
    "mismatch_metrics",
]

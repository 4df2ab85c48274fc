"""Losses beside TorchRL's: trainer-engine mismatch metrics and the rollout correction
(truncated / masked importance sampling) inside TorchRL's ``GRPOLoss``.

The metrics and the correction are plain torch; the loss imports TorchRL, so it is
loaded on first use (the command line reads :data:`MODES` without TorchRL).
"""

from __future__ import annotations

import importlib

from torchrl_vllm_ext.losses.correction import MODES, CorrectionWeights, RolloutCorrection
from torchrl_vllm_ext.losses.mismatch import METRICS, mismatch_metrics

_LAZY = {"CorrectedGRPOLoss", "CorrectedGRPOLossOutput"}

__all__ = [
    "METRICS",
    "MODES",
    "CorrectedGRPOLoss",
    "CorrectedGRPOLossOutput",
    "CorrectionWeights",
    "RolloutCorrection",
    "mismatch_metrics",
]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module("torchrl_vllm_ext.losses.grpo"), name)
    raise AttributeError(f"module 'torchrl_vllm_ext.losses' has no attribute {name!r}")

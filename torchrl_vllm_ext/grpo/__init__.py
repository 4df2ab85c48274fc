"""GRPO on vLLM replicas with TorchRL objects: the main job and the tutorial's building blocks."""

from torchrl_vllm_ext.grpo.config import GRPOConfig
from torchrl_vllm_ext.grpo.trainer import GRPOTrainer, group_advantage, restrict_vocabulary

__all__ = ["GRPOConfig", "GRPOTrainer", "group_advantage", "restrict_vocabulary"]

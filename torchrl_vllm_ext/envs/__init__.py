"""Toy token-level tasks with verifiable rewards, as TorchRL envs (no network)."""

from torchrl_vllm_ext.envs.copy_tokens import TokenCopyEnv, copy_reward

__all__ = ["TokenCopyEnv", "copy_reward"]

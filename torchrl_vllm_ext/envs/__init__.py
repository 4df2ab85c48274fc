"""Toy token-level tasks with verifiable rewards, as TorchRL envs (no network)."""

from torchrl_vllm_ext.envs.copy_tokens import TokenCopyEnv, copy_reward
from torchrl_vllm_ext.envs.count_tokens import TokenCountEnv, count_reward
from torchrl_vllm_ext.envs.token_task import TokenTaskEnv

__all__ = ["TokenCopyEnv", "TokenCountEnv", "TokenTaskEnv", "copy_reward", "count_reward"]

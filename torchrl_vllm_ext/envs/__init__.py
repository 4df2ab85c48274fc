"""TorchRL envs and env transforms: toy token tasks with verifiable rewards, and a
scripted multi-turn chat on TorchRL's ChatEnv (no network)."""

from torchrl_vllm_ext.envs.copy_tokens import TokenCopyEnv, copy_reward
from torchrl_vllm_ext.envs.count_tokens import TokenCountEnv, count_reward
from torchrl_vllm_ext.envs.scripted_chat import ScriptedChat
from torchrl_vllm_ext.envs.token_task import TokenTaskEnv

__all__ = [
    "ScriptedChat",
    "TokenCopyEnv",
    "TokenCountEnv",
    "TokenTaskEnv",
    "copy_reward",
    "count_reward",
]

"""TensorDict in / TensorDict out: the policy module and its conversions."""

from torchrl_vllm_ext.wrappers.policy import VLLMPolicy

__all__ = ["VLLMPolicy"]

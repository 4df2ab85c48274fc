"""TorchRL env transforms served by vLLM replicas."""

from torchrl_vllm_ext.transforms.reference import ReferenceKL, sequence_kl

__all__ = ["ReferenceKL", "sequence_kl"]

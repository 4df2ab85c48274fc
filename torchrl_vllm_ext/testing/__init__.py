"""Helpers for tests, tutorials and benchmarks: tiny local models, no hub access."""

from torchrl_vllm_ext.testing.tiny_model import default_cache_dir, make_tiny_model

__all__ = ["default_cache_dir", "make_tiny_model"]

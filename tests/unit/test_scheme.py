"""The scheme's push logic on stand-ins (no vLLM, no Ray): commit vs rollback, partial loads,
restarted replicas. The real transports run in tests/integration/test_weight_sync.py."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from torchrl_vllm_ext.engine.config import ServiceConfig
from torchrl_vllm_ext.engine.fleet import ReplicaView
from torchrl_vllm_ext.errors import ConfigurationError, WeightSyncError
from torchrl_vllm_ext.messages import ReplicaInfo
from torchrl_vllm_ext.testing.stand_in_pool import StandInPool
from torchrl_vllm_ext.weight_sync.delivery import Delivery
from torchrl_vllm_ext.weight_sync.scheme import WeightSyncScheme
from torchrl_vllm_ext.weight_sync.transports.protocol import (
    Prepared,
    Transport,
    TransportOptions,
    WorkerCall,
    calls_for,
)
from torchrl_vllm_ext.weight_sync.verify import TimedReference, model_logprobs, reference

WEIGHTS = {"model.w": torch.ones(2, 2)}


class Remote:
    """``handle.method.remote(...)`` returning an awaitable, like a Ray actor method."""

    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        async def call():
            return self.fn(*args)

        return call()


class Replica:
    def __init__(self, rid, fail_load=False, probe_offset=0.0, dtype="float32"):
        self.rid, self.fail_load, self.version = rid, fail_load, "0"
        self.probe_offset = probe_offset  # a load that left the served weights wrong
        self.dtype = dtype  # the dtype it serves (and computes) in
        self.update_weights = Remote(self._update)
        self.probe_logprobs = Remote(self._probe)
        self.set_weight_version = Remote(self._set)
        self.reset_prefix_cache = Remote(lambda: True)

    def _update(self, method, args, version, pause_mode):
        if self.fail_load:
            raise WeightSyncError(f"replica {self.rid}: worker call {method!r} failed: boom")
        self.version = version
        return {"pause_s": 0.01, "pausing_s": 0.0, "load_s": 0.005}

    def _set(self, version):
        self.version = version

    def _probe(self, ids):
        served = getattr(torch, self.dtype)
        return [v + self.probe_offset for v in model_logprobs(Trainer(), ids, served)]


class Trainer(torch.nn.Module):
    """A stand-in trainer model with WEIGHTS' names; its logits a fixed function of the ids."""

    def __init__(self):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.w = torch.nn.Parameter(torch.ones(2, 2))

    def forward(self, input_ids):
        w = self.model.w  # computed in its dtype: 16-bit rounds the logits
        scale = (input_ids[..., None] % 5 + 1).to(w.dtype)
        return SimpleNamespace(logits=torch.arange(64, dtype=w.dtype) * 0.01 * scale * w.mean())


def view(replica: Replica) -> ReplicaView:
    info = ReplicaInfo(replica.rid, 0, "127.0.0.1", 256, 100, 4096, dtype=replica.dtype)
    return ReplicaView(replica.rid, replica, info)


class Service:
    """The service surface a scheme uses, over a real pool of stand-in actors."""

    def __init__(self, model_dir, replicas):
        self.config = ServiceConfig(model=str(model_dir), engine_kwargs={"dtype": "float32"})
        self.pool = StandInPool(ServiceConfig(model=str(model_dir)), "test")
        for r in replicas:
            self.pool.adopt(view(r))
        self.replicas = {r.rid: r for r in replicas}
        self.uses_gpu = False

    @property
    def weights_provider(self):
        return self.pool.provider

    def set_weights_provider(self, provider):
        self.pool.set_provider(provider)

    def run(self, coro):
        return asyncio.run(coro)


class FakeTransport(Transport):
    name = "fake"

    def __init__(self, service):
        super().__init__(service, TransportOptions())
        self.events = []

    async def prepare(self, tensors, version, replicas, packed=None):
        self.events.append(("prepare", version, [r.replica_id for r in replicas]))
        return Prepared(calls_for(replicas, WorkerCall("load_it", (version,))))

    async def commit(self, version):
        self.events.append(("commit", version))

    async def rollback(self, version):
        self.events.append(("rollback", version))

    async def bring_up(self, replica, version, packed=None):
        self.events.append(("bring_up", replica.replica_id, version))


@pytest.fixture
def model_dir(tmp_path):
    save_file(WEIGHTS, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text('{"vocab_size": 64}')
    return tmp_path


def scheme_for(model_dir, replicas, rollout="parallel", verify=False):
    service = Service(model_dir, replicas)
    scheme = WeightSyncScheme(service, transport="storage", rollout=rollout, verify=verify)
    scheme.transport_impl.close()
    scheme.transport_impl = FakeTransport(service)
    return service, scheme


def test_a_push_commits_records_the_version_and_becomes_the_provider(model_dir):
    service, scheme = scheme_for(model_dir, [Replica(0), Replica(1)])
    report = scheme.push(WEIGHTS, version=3)
    assert report.version == "3" and set(report.pause_s) == {0, 1}
    assert scheme.transport_impl.events == [("prepare", "3", [0, 1]), ("commit", "3")]
    assert scheme.version == "3" and service.weights_provider is scheme
    assert {r.version for r in service.replicas.values()} == {"3"}


def test_a_load_that_fails_everywhere_rolls_back(model_dir):
    service, scheme = scheme_for(model_dir, [Replica(0, fail_load=True), Replica(1, True)])
    with pytest.raises(WeightSyncError, match="no replica loaded it"):
        scheme.push(WEIGHTS, version=1)
    assert scheme.transport_impl.events[-1] == ("rollback", "1")
    assert scheme.version is None and service.weights_provider is None


def test_a_partial_load_keeps_what_loaded_and_says_which(model_dir):
    # One replica loads, the other fails: the published weights must stay the new ones,
    # since replica 0 serves them (rolling them back would make restarts disagree).
    service, scheme = scheme_for(model_dir, [Replica(0), Replica(1, fail_load=True)])
    with pytest.raises(WeightSyncError, match=r"replicas \[0\] loaded it"):
        scheme.push(WEIGHTS, version=2)
    assert ("rollback", "2") not in scheme.transport_impl.events
    assert scheme.transport_impl.events[-1] == ("commit", "2")
    assert scheme.version == "2" and service.weights_provider is scheme


def test_rolling_stops_at_the_first_failed_replica(model_dir):
    replicas = [Replica(0), Replica(1, fail_load=True), Replica(2)]
    _service, scheme = scheme_for(model_dir, replicas, rollout="rolling")
    with pytest.raises(WeightSyncError, match="failed on replica 1"):
        scheme.push(WEIGHTS, version=4)
    assert [r.version for r in replicas] == ["4", "0", "0"]


def test_bad_weights_touch_no_replica(model_dir):
    _service, scheme = scheme_for(model_dir, [Replica(0)])
    with pytest.raises(WeightSyncError, match="NaN"):
        scheme.push({"model.w": torch.full((2, 2), float("nan"))}, version=5)
    with pytest.raises(WeightSyncError, match="missing"):
        scheme.push({}, version=5)
    assert scheme.transport_impl.events == []


def test_a_restarted_replica_is_brought_to_the_live_version(model_dir):
    _service, scheme = scheme_for(model_dir, [Replica(0)])
    fresh = Replica(7)
    assert asyncio.run(scheme.bring_up(view(fresh))) is None
    assert fresh.version == "0", "nothing pushed yet: nothing to bring"
    scheme.push(WEIGHTS, version=6)
    assert asyncio.run(scheme.bring_up(view(fresh))) == "6", "the pool admits it by this"
    assert ("bring_up", 7, "6") in scheme.transport_impl.events and fresh.version == "6"
    scheme.close()
    assert asyncio.run(scheme.bring_up(view(Replica(8)))) is None, "closed: loads nothing"


def test_verification_by_value_passes_exact_replicas_and_records_the_gap(model_dir):
    _service, scheme = scheme_for(model_dir, [Replica(0), Replica(1)], verify=True)
    report = scheme.push(Trainer(), version=4)
    assert report.probe_gap == {0: 0.0, 1: 0.0} and "reference" in report.phases
    assert scheme.version == "4"


def test_a_push_made_ready_elsewhere_reports_its_steps_first_and_its_whole_time(model_dir):
    # A sharded trainer's ranks: they agreed and scored the reference 2 s ago; the scheme
    # transfers (publishes), loads and checks, and its report covers the whole push.
    _service, scheme = scheme_for(model_dir, [Replica(0), Replica(1)], verify=True)
    expected = reference(Trainer(), scheme.arrival.probe, "float32")
    ranks = {"agree": 0.5, "reference": 0.25}
    reached = []

    async def prepare(ready):
        reached.extend(r.replica_id for r in ready)
        call = WorkerCall("load_it", ("9",))
        return Prepared(calls_for(ready, call), phases={"publish": 0.125})

    start = time.perf_counter() - 2.0
    push = Delivery("9", 16, prepare, TimedReference(expected, 0.25), ranks, start)
    report = asyncio.run(scheme.apush_prepared(push))
    assert list(report.phases)[:3] == ["agree", "reference", "publish"]
    assert report.phases["reference"] == 0.25 and {"apply", "verify"} <= set(report.phases)
    assert report.seconds >= 2.0 and report.nbytes == 16
    assert ranks == {"agree": 0.5, "reference": 0.25}, "the caller's phases are its own"
    assert report.probe_gap == {0: 0.0, 1: 0.0} and reached == [0, 1]
    assert scheme.last_report is report and scheme.version == "9"


@pytest.mark.parametrize("offset", [0.5, float("nan")])
def test_a_replica_whose_probe_differs_fails_the_push_and_is_restarted(model_dir, offset):
    # Replica 1 reports the version, but serves something else: only its probe says so.
    service, scheme = scheme_for(
        model_dir, [Replica(0), Replica(1, probe_offset=offset)], verify=True
    )
    restarted = []
    service.pool.restart_untrusted = lambda view, error, what: restarted.append(
        (view.replica_id, error)
    )
    with pytest.raises(
        WeightSyncError, match=r"replica 1 .*probe sequence differ.*replicas \[0\] loaded it"
    ):
        scheme.push(Trainer(), version=5)
    assert [rid for rid, _ in restarted] == [1]
    assert scheme.transport_impl.events[-1] == ("commit", "5")  # replica 0 serves it, verified


def test_a_push_whose_every_replica_fails_the_probe_rolls_back(model_dir):
    service, scheme = scheme_for(model_dir, [Replica(0, probe_offset=1.0)], verify=True)
    service.pool.restart_untrusted = lambda view, error, what: None
    with pytest.raises(WeightSyncError, match="probe sequence differ"):
        scheme.push(Trainer(), version=6)
    assert scheme.transport_impl.events[-1] == ("rollback", "6") and scheme.version is None


def test_a_16_bit_replica_is_judged_against_the_push_s_own_rounding_noise(model_dir):
    # A bfloat16 replica sits a rounding away from the float32 trainer: more than
    # float32's 1e-3, within 3x what the trainer itself shows in bfloat16.
    replicas = [Replica(0, dtype="bfloat16"), Replica(1, dtype="bfloat16")]
    _service, scheme = scheme_for(model_dir, replicas, verify=True)
    report = scheme.push(Trainer(), version=4)
    assert report.probe_noise > 1e-3 and report.probe_limit == 3 * report.probe_noise
    assert 1e-3 < max(report.probe_gap.values()) <= report.probe_limit
    # The same trainer in bfloat16: its reference is still computed in float32.
    assert scheme.push(Trainer().to(torch.bfloat16), version=5).probe_gap[0] > 1e-3


def test_a_16_bit_replica_that_missed_weights_still_fails(model_dir):
    replicas = [Replica(0, dtype="bfloat16", probe_offset=0.5)]
    service, scheme = scheme_for(model_dir, replicas, verify=True)
    service.pool.restart_untrusted = lambda view, error, what: None
    with pytest.raises(WeightSyncError, match=r"by 0.49.* on average \(limit .*rounding noise"):
        scheme.push(Trainer(), version=6)


def test_a_float32_replica_keeps_the_fixed_limit_and_verify_tol_overrides(model_dir):
    _service, scheme = scheme_for(model_dir, [Replica(0)], verify=True)
    report = scheme.push(Trainer(), version=1)
    assert (report.probe_limit, report.probe_noise) == (1e-3, 0.0)
    scheme.verify_tol = 0.25
    assert scheme.push(Trainer(), version=2).probe_limit == 0.25
    with pytest.raises(ConfigurationError, match="verify_tol=0"):
        WeightSyncScheme(_service, transport="storage", verify_tol=0)


def test_by_default_only_the_first_successful_push_is_verified(model_dir):
    _service, scheme = scheme_for(model_dir, [Replica(0)], verify="first")
    assert scheme.push(Trainer(), version=7).probe_gap == {0: 0.0}
    assert scheme.push(Trainer(), version=8).probe_gap == {}
    with pytest.raises(ConfigurationError, match="verify='sometimes'"):
        scheme_for(model_dir, [Replica(0)], verify="sometimes")


def test_a_trainer_model_the_check_cannot_run_fails_before_any_load(model_dir):
    class NotALanguageModel(Trainer):
        def forward(self, input_ids):
            raise TypeError("forward() takes a TensorDict")

    service, scheme = scheme_for(model_dir, [Replica(0)], verify="always")
    with pytest.raises(WeightSyncError, match="verify='never'"):
        scheme.push(NotALanguageModel(), version=9)
    assert service.replicas[0].version == "0"
    assert scheme.transport_impl.events[-1] == ("rollback", "9")

"""Weight sync on live replicas: after every push the replicas' log-probs equal the trainer's."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from torchrl_vllm_ext import ConfigurationError, VLLMService, WeightSyncError, WeightSyncScheme

from ..helpers import (
    CPU_TRANSPORTS,
    CPUS_PER_REPLICA,
    ENGINE_KWARGS,
    assert_replicas_match,
    hf_token_logprobs,
    perturb,
    replica_logprobs,
    wait_restarted,
    wait_until,
)


@pytest.fixture(scope="module")
def original(trainer):
    return {k: v.clone() for k, v in trainer.state_dict().items()}


@pytest.fixture(scope="module")
def schemes(service, original):
    schemes = {t: WeightSyncScheme(service, transport=t) for t in CPU_TRANSPORTS}
    yield schemes
    schemes["storage"].push(original, version="0")  # later tests expect the checkpoint's weights
    for scheme in schemes.values():
        scheme.close()


@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
def test_ten_pushes_in_a_row_stay_exact(service, trainer, schemes, transport):
    scheme = schemes[transport]
    for i in range(10):
        perturb(trainer, seed=100 * (transport == "broadcast") + i)
        version = f"{transport}-{i}"
        report = scheme.push(trainer, version=version)
        assert report.version == version and report.transport == transport
        assert set(report.pause_s) == set(service.replica_ids)
        assert_replicas_match(service, trainer, version)
    assert scheme.version == service.weight_version == version


@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ("nan", "contains NaN or inf"),
        ("missing", "is missing"),
        ("shape", "has shape"),
        ("extra", "is not in the served checkpoint"),
    ],
)
def test_bad_push_changes_nothing(service, trainer, schemes, transport, bad, match):
    scheme = schemes[transport]
    before = service.weight_version
    sd = {k: v.clone() for k, v in trainer.state_dict().items()}
    if bad == "nan":
        sd["model.layers.1.self_attn.q_proj.weight"][3, 3] = float("nan")
    elif bad == "missing":
        del sd["model.layers.0.mlp.down_proj.weight"]
    elif bad == "shape":
        sd["model.norm.weight"] = torch.ones(3)
    else:
        sd["model.layers.9.mlp.up_proj.weight"] = torch.ones(2, 2)
    with pytest.raises(WeightSyncError, match=match):
        scheme.push(sd, version="never")
    assert_replicas_match(service, trainer, before)


def test_rolling_storage_rollout_updates_one_replica_at_a_time(service, trainer, schemes):
    with WeightSyncScheme(service, transport="storage", rollout="rolling") as rolling:
        for i in range(3):
            perturb(trainer, seed=300 + i)
            report = rolling.push(trainer, version=f"rolling-{i}")
            assert set(report.pause_s) == set(service.replica_ids)
            assert_replicas_match(service, trainer, f"rolling-{i}")
    with pytest.raises(ConfigurationError, match="rolling"):
        WeightSyncScheme(service, transport="broadcast", rollout="rolling")


def test_auto_picks_storage_on_one_host_and_says_why(service):
    with WeightSyncScheme(service) as scheme:
        assert scheme.transport == "storage"
        assert "share host" in scheme.reason


def test_push_async_returns_a_future(service, trainer, schemes):
    perturb(trainer, seed=999)
    fut = schemes["storage"].push_async(trainer, version="async-1")
    assert fut.result(timeout=120).version == "async-1"
    assert_replicas_match(service, trainer, "async-1")


def test_prefix_cache_never_serves_entries_from_old_weights(service, trainer, schemes):
    # 200 tokens span a full 128-token CPU KV block, so the prefix cache holds it.
    prompt = [(7 * i) % 500 + 3 for i in range(200)]
    greedy = {"max_tokens": 8, "temperature": 0.0}
    service.generate_request_data([prompt] * 4, greedy, routing="round_robin")  # warm the cache
    perturb(trainer, seed=4242)
    schemes["storage"].push(trainer, version="cache-1")
    for d in service.generate_request_data([prompt] * 4, greedy, routing="round_robin"):
        s = d.samples[0]
        ref = hf_token_logprobs(trainer, prompt + s.token_ids.tolist())[len(prompt) - 1 :]
        assert (torch.tensor(s.logprobs) - ref).abs().max().item() < 1e-4


# Slow (a restart each, ~15 s). By default a restart brought to the live weights over
# storage, checked exactly, and the next push after it run in
# tests/reliability/test_replica_kills.py::test_sigkill_during_weight_sync_keeps_replicas_consistent
# and test_death_policy.py::test_a_push_during_a_death_completes_on_the_others_and_the_restart_gets_it
# (and here in test_version_labels.py's held replica, brought up by a storage push); over
# broadcast (a gloo group re-formed for the restarted member, checked exactly, and the
# next push through it) in test_a_planned_push_mixes_routes_commits_one_version_and_brings_up_restarts
# below and test_delta.py::test_broadcast_deltas_through_a_rollback_and_a_restart_equal_a_full_push.
@pytest.mark.slow
@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
def test_restarted_replica_is_brought_to_current_weights(service, trainer, schemes, transport):
    perturb(trainer, seed=77 + len(transport))
    version = f"before-crash-{transport}"
    schemes[transport].push(trainer, version=version)
    victim = service.replica_ids[0]
    old_pid = service.replica_info(victim).pid
    os.kill(old_pid, signal.SIGKILL)
    wait_until(
        lambda: any(r.replica_id == victim and r.info.pid != old_pid for r in service.replicas()),
        timeout=300,
        interval=1.0,
        what="the killed replica to restart",
    )
    assert_replicas_match(service, trainer, version)
    # The broadcast group is re-formed for the new member on the next push.
    perturb(trainer, seed=5)
    schemes[transport].push(trainer, version=f"after-crash-{transport}")
    assert_replicas_match(service, trainer, f"after-crash-{transport}")


def launch_tp2(tiny_model) -> VLLMService:
    """One replica of two tensor-parallel workers (the slice tests' own service)."""
    return VLLMService.launch(
        tiny_model,
        num_replicas=1,
        tensor_parallel_size=2,
        cpus_per_replica=CPUS_PER_REPLICA,
        health_check_interval=0,
        **ENGINE_KWARGS,
    )


def assert_each_worker_got_its_share(workers, transport: str) -> None:
    """Each TP worker received exactly what it keeps of the sliced tensors (ratio 1.0) and
    the others whole, each named with why."""
    for rank, w in enumerate(workers):
        print(
            f"tp2 {transport} rank {rank}: pushed {w.nbytes}, received {w.received}, "
            f"kept {w.kept}, sliced {w.sliced_received}/{w.sliced_kept}, "
            f"whole {len(w.whole)}: {sorted(set(w.whole.values()))}"
        )
        assert w.sliced_ratio == 1.0, w
        assert w.received == w.kept < w.nbytes, w
        assert w.whole and all(w.whole.values()), w  # the norms, by name and why


def test_tensor_parallel_replica_workers_read_only_their_slices(tiny_model, ray_cluster, trainer):
    """Storage on a TP=2 replica: the first push of a layout is read whole (the load plan is
    traced); from the next one each worker reads only its slices of the tensors its plan
    cuts (received / kept = 1.0 on them), the others whole, by name; the replica serves
    the trainer's log-probs, bitwise those of a whole-tensor push (broadcast hands each
    worker every tensor whole) of the same weights."""
    with launch_tp2(tiny_model) as tp2:
        storage = WeightSyncScheme(tp2, transport="storage")
        broadcast = WeightSyncScheme(tp2, transport="broadcast", per_worker_sends=False)
        with storage, broadcast:
            perturb(trainer, seed=1)
            before = {k: v.clone() for k, v in trainer.state_dict().items()}
            (traced,) = storage.push(before, version="tp2-trace").reads.values()
            assert [w.received for w in traced] == [w.nbytes for w in traced]  # no plan yet

            perturb(trainer, seed=2)
            weights = {k: v.clone() for k, v in trainer.state_dict().items()}
            report = storage.push(weights, version="tp2-slices")
            assert_replicas_match(tp2, trainer, "tp2-slices")
            sliced = replica_logprobs(tp2)
            (workers,) = report.reads.values()
            assert_each_worker_got_its_share(workers, "storage")
            assert sum(w.kept for w in workers) >= report.nbytes  # the replicated ones twice
            assert 0.5 < report.kept_share < 1.0

            # The same weights pushed whole: bitwise the same served log-probs.
            broadcast.push(before, version="tp2-whole-before")
            (whole,) = broadcast.push(weights, version="tp2-whole").reads.values()
            assert [w.received for w in whole] == [w.nbytes for w in whole]
            for rid, (logprobs, version) in replica_logprobs(tp2).items():
                assert version == "tp2-whole"
                assert torch.equal(logprobs, sliced[rid][0])


def test_tensor_parallel_replica_workers_are_sent_only_their_slices_by_broadcast(
    tiny_model, ray_cluster, trainer
):
    """Broadcast on a TP=2 replica (gloo): the first push of a layout goes to every worker
    whole (the load plans are traced); from the next one each worker is sent, point to
    point, only its slices of the tensors its plan cuts (received / kept = 1.0 on them)
    and the others whole, by name; the replica serves the trainer's log-probs, bitwise
    those of a whole-tensor broadcast of the same weights."""
    with launch_tp2(tiny_model) as tp2:
        perturb(trainer, seed=11)
        before = {k: v.clone() for k, v in trainer.state_dict().items()}
        perturb(trainer, seed=12)
        weights = {k: v.clone() for k, v in trainer.state_dict().items()}
        with WeightSyncScheme(tp2, transport="broadcast", per_worker_sends=True) as scheme:
            traced = scheme.push(before, version="bc-trace")
            assert traced.sends == "broadcast", traced.sends_why
            assert "no load plan of this layout" in traced.sends_why
            assert [w.received for w in traced.reads[tp2.replica_ids[0]]] == [traced.nbytes] * 2

            report = scheme.push(weights, version="bc-slices")
            assert report.sends == "per-worker", report.sends_why
            assert_replicas_match(tp2, trainer, "bc-slices")
            sliced = replica_logprobs(tp2)
            (workers,) = report.reads.values()
            assert_each_worker_got_its_share(workers, "broadcast")
            assert report.sent_bytes == sum(w.received for w in workers)
            assert report.sent_bytes < 2 * report.nbytes  # what a broadcast to both moves
            print(f"tp2 broadcast: sent {report.sent_bytes} of {report.nbytes} x 2 workers")

        # The same weights broadcast whole to every worker: bitwise the same log-probs.
        with WeightSyncScheme(tp2, transport="broadcast", per_worker_sends=False) as whole:
            whole.push(before, version="bc-whole-before")
            report = whole.push(weights, version="bc-whole")
            assert report.sends == "broadcast" and "per_worker_sends=False" in report.sends_why
            (received,) = report.reads.values()
            assert [w.received for w in received] == [w.nbytes for w in received]
            for rid, (logprobs, version) in replica_logprobs(tp2).items():
                assert version == "bc-whole"
                assert torch.equal(logprobs, sliced[rid][0])


def test_a_push_while_paused_leaves_the_replicas_paused_and_checks_them_at_resume(
    service, trainer, original
):
    """update_weights resumes only what it paused: a push during ``service.pause()`` loads
    every replica, which stays paused (kept requests do not run), and its value check,
    which needs a serving replica, runs at ``resume()``."""
    with WeightSyncScheme(service, transport="storage", verify="first") as scheme:
        service.pause("keep")
        try:
            perturb(trainer, seed=7)
            report = scheme.push(trainer, version="while-paused")
            assert report.probe_deferred == sorted(service.replica_ids)
            assert report.probe_gap == {} and scheme.verified_pushes == 0
            assert all(s.paused for s in service.stats()), "the push resumed a paused replica"
            assert set(service.weight_versions().values()) == {"while-paused"}
        finally:
            service.resume()
        assert scheme.verified_pushes == 1, "resume() ran the deferred value check"
        assert_replicas_match(service, trainer, "while-paused")
        scheme.push(original, version="0")  # later tests expect the checkpoint's weights


def test_a_planned_push_mixes_routes_commits_one_version_and_brings_up_restarts(
    service, trainer, original
):
    """``auto`` on GPUs plans a route per replica (weight_sync/transports/auto/plan.py: IPC, NCCL layers,
    storage, gloo). The mechanics on CPU: one push whose replicas take two routes
    (storage and a gloo broadcast) commits one version; a replica restarted afterwards is
    brought up through its route from the committed buckets."""
    from torchrl_vllm_ext.weight_sync.transports.auto.plan import ReplicaPlan, TransportPlan
    from torchrl_vllm_ext.weight_sync.transports.auto.sender import PlannedTransport
    from torchrl_vllm_ext.weight_sync.transports.protocol import TransportOptions

    first = service.replica_ids[0]

    scheme = WeightSyncScheme(service, transport="storage")
    scheme.transport_impl.close()
    options = TransportOptions(bucket_bytes=1 << 20, deadline=scheme.deadline)

    class ByIdTransport(PlannedTransport):  # CPU replicas through a mixed plan
        def _plan(self, places):
            return TransportPlan(
                tuple(ReplicaPlan(r, "storage" if r == first else "gloo") for r in sorted(places))
            )

    scheme.transport_impl = ByIdTransport(service.pool, options)
    with scheme:
        perturb(trainer, seed=11)
        report = scheme.push(trainer, version="planned-1")
        assert report.transport == "gloo+storage"
        other = [r for r in service.replica_ids if r != first]
        assert scheme.reason == f"storage: replicas [{first}]; gloo: replicas {other}"
        assert set(report.pause_s) == set(service.replica_ids)
        assert_replicas_match(service, trainer, "planned-1")
        victim = other[0]
        old_pid = service.replica_info(victim).pid
        os.kill(old_pid, signal.SIGKILL)  # its restart loads planned-1 over gloo
        wait_restarted(service, victim, old_pid)
        assert_replicas_match(service, trainer, "planned-1")
        # The next push reaches it through its route (the gloo group re-formed for the new
        # process); later tests expect the checkpoint's weights.
        scheme.push(original, version="0")
        trainer.load_state_dict(original)
        assert_replicas_match(service, trainer, "0")

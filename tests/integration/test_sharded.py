"""Pushes from a trainer sharded with FSDP2 over 2 gloo ranks: this process is rank 0 (it
holds the scheme), a spawned process rank 1 (:func:`torchrl_vllm_ext.testing.sharded.follow`).

After every push, over storage (each rank writes its blocks into the slot) and over gloo
(a streamed gather), the replicas' log-probs equal the unsharded model's; TorchRL's
collector on rank 0 pushes through ``WeightSyncUpdater(sync)`` and its samples carry the
version. No rank allocates the whole model during a push. A rank with bad input, one that
never arrives and one killed mid-write fail the push on every surviving rank, naming it;
the replicas keep their version.
"""

from __future__ import annotations

import time
import warnings

import pytest

from torchrl_vllm_ext import (
    Deadline,
    ShardedPushError,
    ShardedWeightSync,
    TokenCopyEnv,
    VLLMPolicy,
    WeightSyncScheme,
    WeightSyncUpdater,
)
from torchrl_vllm_ext.testing.sharded import load, peak_torch_bytes, shard

from ..helpers import CPU_TRANSPORTS, assert_replicas_match, sharded_world

SEEDS = (11, 12)
RESULT_WAIT_S = 120
DEADLINE = Deadline(fixed_s=10.0)
"""Each step of a push waits this long for every rank."""
MISSED = Deadline(fixed_s=3.0)
"""Rank 0's deadline for a push that rank 1 misses (absent or killed): only rank 0 waits
it out, and it alone names the rank."""


def model_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def collector_on(service, sync):
    from torchrl.collectors.llm import LLMCollector

    policy = VLLMPolicy(service, input_mode="tokens", sampling_params={"max_tokens": 4})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # legacy weight_updater path
        return LLMCollector(
            TokenCopyEnv(batch_size=(2,), prompt_len=4, seed=0),
            policy=policy,
            dialog_turns_per_batch=2,
            weight_updater=WeightSyncUpdater(sync),
            track_policy_version=True,
        )


@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
def test_pushes_from_two_fsdp2_ranks(service, tiny_model, restore_checkpoint, transport):
    steps = [{"seed": s} for s in SEEDS]
    steps += [{"seed": 13, "nan": True}, {"seed": 14, "shape": True}, {"skip": True}]
    full = model_bytes(load(tiny_model))
    with sharded_world(tiny_model, steps) as (results, _):
        # small buckets: the gather streams several (and the embedding alone is one)
        scheme = WeightSyncScheme(service, transport=transport, bucket_bytes=full // 8)
        with scheme, ShardedWeightSync(scheme, deadline=DEADLINE) as sync:
            collector = collector_on(service, sync)
            batches = iter(collector)
            next(batches)
            for version, seed in enumerate(SEEDS, start=1):
                model = shard(load(tiny_model, seed))
                _, peak = peak_torch_bytes(lambda m=model: collector.update_policy_weights_(m))
                assert collector.policy_version == version
                status, served, peak1 = results.get(timeout=RESULT_WAIT_S)
                assert (status, served) == ("ok", str(version))
                assert sync.version == sync.last_report.version == str(version)
                assert bool(sync.last_report.probe_gap) == (version == 1)  # verify="first"
                # fp32 replicas equal the unsharded model
                assert_replicas_match(service, load(tiny_model, seed), str(version))
                # No rank held the whole model: storage writes from the shards themselves.
                # (Pushes without the value check: its collective forward peaks as FSDP2's
                # forward does. The streamed gather's bound is tests/unit/test_sharded_memory:
                # the profiler misses the frees of collectives' outputs.)
                if transport == "storage" and not sync.last_report.probe_gap:
                    assert peak < full / 8 and peak1 < full / 8, (peak, peak1, full)
                batch = next(batches)
                assert set(batch.get(("vllm", "weight_version")).flatten().tolist()) == {
                    str(version)
                }
            live = service.weight_version
            bad_input_fails_everywhere(sync, tiny_model, results)
            absent_rank_is_named(sync, tiny_model)
            assert set(service.weight_versions().values()) == {live}
            collector.shutdown()


def bad_input_fails_everywhere(sync, tiny_model, results) -> None:
    """Rank 1 holds a NaN, then pushes another layout: the same typed error on both ranks,
    naming rank 1, before any replica is touched."""
    for match in ("NaN or inf", "other than rank 0's"):
        with pytest.raises(ShardedPushError, match=match) as caught:
            sync.push(shard(load(tiny_model, 13)))
        assert caught.value.ranks == (1,)
        status, kind, message, ranks = results.get(timeout=RESULT_WAIT_S)
        assert (status, kind, message, tuple(ranks)) == (
            "error",
            "ShardedPushError",
            str(caught.value),
            (1,),
        )


def absent_rank_is_named(sync, tiny_model) -> None:
    """Rank 1 never calls the push: rank 0 names it within the deadline."""
    sync.deadline = MISSED
    t0 = time.monotonic()
    with pytest.raises(ShardedPushError, match=r"rank\(s\) \[1\] did not reach") as caught:
        sync.push(shard(load(tiny_model, 15)))
    assert caught.value.ranks == (1,)
    assert time.monotonic() - t0 < MISSED.fixed_s + 5


def test_a_rank_killed_mid_write_leaves_the_replicas_on_the_last_version(
    service, tiny_model, restore_checkpoint
):
    steps = [{"seed": 21}, {"seed": 22, "die": True}]
    with sharded_world(tiny_model, steps) as (results, procs):
        with WeightSyncScheme(service, transport="storage", verify="first") as scheme:
            root = scheme.storage_dir
            with ShardedWeightSync(scheme, deadline=DEADLINE) as sync:
                version = sync.push(shard(load(tiny_model, 21))).version
                assert results.get(timeout=RESULT_WAIT_S)[:2] == ("ok", version)
                sync.deadline = MISSED  # rank 1 waits in this push already: it dies mid-write
                t0 = time.monotonic()
                with pytest.raises(ShardedPushError, match=r"rank\(s\) \[1\]") as caught:
                    sync.push(shard(load(tiny_model, 22)))
                assert caught.value.ranks == (1,)
                assert time.monotonic() - t0 < MISSED.fixed_s + 5
                procs[0].join(timeout=30)
                assert procs[0].exitcode == 3  # it died where the test made it
                assert_replicas_match(service, load(tiny_model, 21), version)
        assert not root.exists()  # the slots went with the scheme


def test_a_bf16_replica_takes_a_sharded_push_by_the_value_check(bf16_service, tiny_model):
    """16-bit replicas: the collective forward's reference in float32 and under autocast
    (the push's rounding noise) decides, as for a 1-process push."""
    with sharded_world(tiny_model, [{"seed": 31}]) as (results, _):
        with WeightSyncScheme(bf16_service, transport="storage", verify="always") as scheme:
            with ShardedWeightSync(scheme, deadline=DEADLINE) as sync:
                report = sync.push(shard(load(tiny_model, 31)), version="31")
                assert results.get(timeout=RESULT_WAIT_S)[:2] == ("ok", "31")
                assert report.probe_noise > 0 and report.probe_gap  # checked in bfloat16
                assert max(report.probe_gap.values()) <= report.probe_limit
                assert_replicas_match(bf16_service, load(tiny_model, 31), "31", dtype="bfloat16")
                scheme.push(load(tiny_model), version="0")  # the checkpoint back, for others

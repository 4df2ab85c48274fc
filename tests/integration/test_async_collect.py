"""Async collection into a TorchRL replay buffer while a slow trainer pushes weights.

The collector is TorchRL's LLMCollector running free (``start()``) through
:class:`~torchrl_vllm_ext.AsyncCollection`; the trainer reads the buffer, sleeps (a slow
training step), perturbs its weights and pushes them with ``pause_mode="keep"``. Every
sample the trainer reads is at most ``max_policy_lag`` versions old. Separately, a long
generation in flight across ``keep`` pushes finishes and says so in its version tags (one
push, two pushes: a version per token span), and a request that finished before a push in
the same replica call keeps its own version.
"""

from __future__ import annotations

import concurrent.futures
import time

import numpy as np
import pytest
import torch
from tensordict import TensorDict, lazy_stack

from torchrl_vllm_ext import AsyncCollection, TokenCopyEnv, VLLMPolicy, WeightSyncScheme
from torchrl_vllm_ext.collectors import (
    mask_stale_tokens,
    sample_versions,
    token_spans,
    version_runs,
)

from ..helpers import wait_until

ENV_BATCH = 4
STEPS = 3
TRAIN_S = 0.4  # the deliberately slow training step

pytestmark = pytest.mark.usefixtures("restore_checkpoint")


def perturb(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


def stored(rb):
    """Every row the buffer holds, bypassing its transforms (what the filter has not seen)."""
    return rb.storage.get(list(range(len(rb.storage))))


def fresh_batch(rb):
    """``(sample,)`` once a sample keeps a row (the filter may drop them all), else None.

    A 1-tuple: ``wait_until`` tests truthiness, which a TensorDict refuses.
    """
    if not len(rb):
        return None
    batch = rb.sample()
    return (batch,) if batch.batch_size.numel() else None


def make_collection(service, scheme, rb, staleness: str, lag: int) -> AsyncCollection:
    policy = VLLMPolicy(
        service, input_mode="tokens", sampling_params={"max_tokens": 4, "temperature": 1.0}
    )
    return AsyncCollection(
        TokenCopyEnv(batch_size=(ENV_BATCH,), prompt_len=4, seed=0),
        policy,
        scheme,
        rb,
        dialog_turns_per_batch=ENV_BATCH,
        max_policy_lag=lag,
        staleness=staleness,
    )


def test_wait_holds_collection_back_and_bound_holds(service, trainer):
    from torchrl.data import LazyStackStorage, ReplayBuffer

    lag = 1
    rb = ReplayBuffer(storage=LazyStackStorage(1024))
    with WeightSyncScheme(service, transport="storage", pause_mode="keep") as scheme:
        collection = make_collection(service, scheme, rb, "wait", lag)
        with collection:
            for step in range(STEPS):
                # FIFO, one batch per version: batch ``step`` is trained at version ``step``.
                need = ENV_BATCH * (step + 1)
                wait_until(lambda n=need: len(rb) >= n, timeout=60, what=f"{need} rows")
                batch = stored(rb)[need - ENV_BATCH : need]
                versions = sample_versions(batch)
                assert (collection.current_version() - versions <= lag).all(), versions
                time.sleep(TRAIN_S)  # slow trainer: the collector has to wait for it
                perturb(trainer, seed=step)
                report = collection.update_policy_weights_(trainer)
                assert report.version == str(step + 1)
        gate = collection.gate
        # Held back, never more than ``lag`` batches ahead, and nothing thrown away.
        assert gate.waited_s > TRAIN_S
        assert gate.started <= STEPS + 1 + lag + 1
        assert collection.dropped == 0
        rows = stored(rb)
        assert len(rows) == ENV_BATCH * gate.started
        assert rows.get(("next", "reward")).shape[-2:] == (1, 1)


def test_drop_filters_every_sample_to_the_bound(service, trainer):
    from torchrl.data import LazyStackStorage, ReplayBuffer

    lag = 0
    rb = ReplayBuffer(storage=LazyStackStorage(4096), batch_size=8)
    with WeightSyncScheme(service, transport="storage", pause_mode="keep") as scheme:
        collection = make_collection(service, scheme, rb, "drop", lag)
        with collection:
            for step in range(STEPS):
                now = collection.current_version()
                batch = wait_until(lambda: fresh_batch(rb), timeout=60, what="fresh samples")[0]
                versions = sample_versions(batch)
                assert (now - versions <= lag).all(), (now, versions)
                time.sleep(TRAIN_S)  # the collector keeps generating meanwhile
                perturb(trainer, seed=100 + step)
                collection.update_policy_weights_(trainer)
            now = collection.current_version()
        # The buffer does hold rows older than the bound; sampling never returns them.
        rows = stored(rb)
        assert (now - sample_versions(rows) > lag).any()
        assert (now - sample_versions(rb.sample(64)) <= lag).all()
        assert collection.dropped > 0


def test_keep_sync_mid_generation_tags_start_and_end(service, trainer):
    policy = VLLMPolicy(
        service,
        input_mode="tokens",
        sampling_params={"max_tokens": 240, "ignore_eos": True, "temperature": 1.0},
    )
    prompts = lazy_stack(
        [TensorDict({("tokens", "prompt"): torch.tensor([5 + i, 6, 7, 8])}) for i in range(2)]
    )
    with (
        WeightSyncScheme(service, transport="storage", pause_mode="keep") as scheme,
        concurrent.futures.ThreadPoolExecutor(1) as pool,
    ):
        scheme.push(trainer, version=1)
        fut = pool.submit(policy, prompts)
        wait_until(lambda: any(s.running for s in service.stats()), 30, what="generation")
        perturb(trainer, seed=7)
        scheme.push(trainer, version=2)
        out = fut.result(timeout=120)
    assert out.get(("vllm", "finish_reason")).tolist() == ["length", "length"]
    assert all(len(r) == 240 for r in out.get(("tokens", "response"), as_list=True))
    starts = out.get(("vllm", "weight_version")).tolist()
    ends = out.get(("vllm", "weight_version_end")).tolist()
    spanning = [(s, e) for s, e in zip(starts, ends, strict=True) if s != e]
    assert spanning and set(spanning) == {("1", "2")}, (starts, ends)
    # Where the new weights took over: tokens before it came from version 1.
    end_from = out.get(("vllm", "weight_version_end_from")).tolist()
    for s, e, k in zip(starts, ends, end_from, strict=True):
        assert (0 < k < 240) if s != e else k == 0, (s, e, k)
    # On-policy for version 2: the version-1 tokens leave the loss, the rest stay.
    mask_stale_tokens(out, current_version=2, max_policy_lag=0)
    kept = [int(m.sum()) for m in out.get(("masks", "all_assistant_mask"), as_list=True)]
    expected = [240 - k if s != e else (240 if s == "2" else 0)
                for s, e, k in zip(starts, ends, end_from, strict=True)]  # fmt: skip
    assert kept == expected


def kv_usage(service, replica_id: int) -> float:
    """The share of a replica's KV-cache blocks in use: it grows as its generations make
    tokens (a block per 16 tokens), the progress signal the tests below push on."""
    return next(s.kv_cache_usage for s in service.stats() if s.replica_id == replica_id)


def serving_replica(service) -> int:
    """The one replica with a request in flight (once there is one)."""
    busy = wait_until(
        lambda: [s.replica_id for s in service.stats() if s.running], 30, what="generation"
    )
    assert len(busy) == 1, busy
    return busy[0]


def generated_more(service, replica_id: int, fut) -> float:
    """Wait until the replica's generation made a new KV block (tokens made since the
    call) and return the usage then; fails if the generation ended first."""
    before = kv_usage(service, replica_id)
    wait_until(lambda: fut.done() or kv_usage(service, replica_id) > before, 30, what="new tokens")
    assert not fut.done(), "the generation ended before the push: lengthen it"
    return kv_usage(service, replica_id)


def test_two_keep_pushes_inside_one_generation_give_three_spans(service, trainer):
    policy = VLLMPolicy(
        service,
        input_mode="tokens",
        sampling_params={"max_tokens": 240, "ignore_eos": True, "temperature": 1.0},
    )
    prompt = lazy_stack([TensorDict({("tokens", "prompt"): torch.tensor([9, 6, 7, 8])})])
    with (
        WeightSyncScheme(service, transport="storage", pause_mode="keep") as scheme,
        concurrent.futures.ThreadPoolExecutor(1) as pool,
    ):
        scheme.push(trainer, version=1)
        fut = pool.submit(policy, prompt)
        rid = serving_replica(service)
        for version in (2, 3):  # each only once the weights before made tokens
            generated_more(service, rid, fut)
            perturb(trainer, seed=version)
            scheme.push(trainer, version=version)
        out = fut.result(timeout=120)
    versions = out.get(("vllm", "token_weight_version"))[0]
    assert versions.shape == out.get(("tokens", "response"))[0].shape == (240,)
    spans = token_spans(1, 3, 0, 240, token_versions=versions)
    assert [s.first_version for s in spans] == [1, 2, 3], spans
    assert all(s.token_to > s.token_from for s in spans)
    # The three per-sample keys still say the first and last version and where it began.
    assert out.get(("vllm", "weight_version")).tolist() == ["1"]
    assert out.get(("vllm", "weight_version_end")).tolist() == ["3"]
    assert out.get(("vllm", "weight_version_end_from")).tolist() == [spans[2].token_from]
    # The bound reads each token's own version: with lag 1 at version 3 only version 1's
    # tokens leave the loss (the three keys alone would take out version 2's too).
    mask_stale_tokens(out, current_version=3, max_policy_lag=1)
    kept = int(out.get(("masks", "all_assistant_mask"))[0].sum())
    assert kept == 240 - spans[0].token_to


def test_a_request_finished_before_a_keep_push_keeps_its_version(service, trainer):
    # Two requests of one replica call: the short one finishes, the long one is still
    # running when the push lands; none of the short one's tokens is the push's.
    short = {"max_tokens": 3, "ignore_eos": True, "temperature": 1.0}
    long = {"max_tokens": 200, "ignore_eos": True, "temperature": 1.0}
    prompt = [11, 12, 13, 14, 15, 16, 17, 18]  # equal prompts: one replica (prefix routing)
    with (
        WeightSyncScheme(service, transport="storage", pause_mode="keep") as scheme,
        concurrent.futures.ThreadPoolExecutor(1) as pool,
    ):
        scheme.push(trainer, version=1)
        fut = pool.submit(
            service.generate_request_batch, [prompt, prompt], [short, long], routing="prefix"
        )
        rid = serving_replica(service)
        generated_more(service, rid, fut)  # the long one is past its 8th token: short done
        perturb(trainer, seed=11)
        scheme.push(trainer, version=2)
        batch = fut.result(timeout=120)
    assert batch.replica_ids.tolist() == [rid, rid]  # one call, so the bug's setting
    assert batch.sample_lengths.tolist() == [3, 200]
    versions = np.split(batch.token_versions(), [3])
    assert versions[0].tolist() == [1, 1, 1]
    runs = [v for v, _, _ in version_runs(versions[1])]
    assert runs == [1, 2], runs
    assert batch.versions_end == ["2", "2"]
    assert batch.end_version_from.tolist()[0] == 3  # every token before the end version's

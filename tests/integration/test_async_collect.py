"""Async collection into a TorchRL replay buffer while a slow trainer pushes weights.

The collector is TorchRL's LLMCollector running free (``start()``) through
:class:`~torchrl_vllm_ext.AsyncCollection`; the trainer reads the buffer, sleeps (a slow
training step), perturbs its weights and pushes them with ``pause_mode="keep"``. Every
sample the trainer reads is at most ``max_policy_lag`` versions old. Separately, a long
generation in flight across ``keep`` pushes finishes and says so in its version tags (one
push, two pushes: a version per token span), a request that finished before a push in
the same replica call keeps its own version, and one held by a pause through a push is
the new version's.
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
    exact_spans,
    mask_stale_tokens,
    sample_versions,
    version_runs,
)
from torchrl_vllm_ext.wrappers.convert import generated_padded, generated_rows

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


# ---------------------------------------------------------------------- version spans
# Requests of one replica call with different max_tokens finish one by one: the replica's
# running count falls as the generations make tokens, the progress signal these tests push
# on. At each step the service freezes generation (pause "keep", the cache kept), the push
# lands at a known point, and generation resumes: no timing race with the push's length.
HEAD = list(range(10, 42))  # the same first 32 tokens: prefix routing, one replica


def running(service) -> int:
    """Requests running on the busiest replica."""
    return max(s.running for s in service.stats())


def until_running(service, fut, n: int, what: str) -> None:
    """Wait until at most ``n`` requests run (the others finished), having seen more."""
    wait_until(lambda: fut.done() or running(service) > n, 30, what="the requests to start")
    wait_until(lambda: fut.done() or running(service) <= n, 60, interval=0.005, what=what)


def frozen_push(service, scheme, trainer, version: int, fut) -> None:
    """Freeze generation, push ``version`` into the requests in flight, resume."""
    service.pause("keep", clear_cache=False)
    try:
        assert not fut.done(), "the generation ended before the push: lengthen it"
        perturb(trainer, seed=version)
        scheme.push(trainer, version=version)
    finally:
        service.resume()


def runs_of(batch) -> list[list[int]]:
    """Each sample's run versions (one per span of equal versions)."""
    rows = np.split(batch.token_versions(), np.cumsum(batch.sample_lengths)[:-1])
    return [[v for v, _, _ in version_runs(r)] for r in rows]


def test_two_keep_pushes_inside_one_generation_give_three_spans(service, trainer):
    # long: pushes 2 and 3 land inside it; mid: push 3 after it finished; short: both.
    # (~3 ms a token on 2 cores: each finishes 100+ ms after the one before.)
    lengths = [220, 120, 40]
    params = [{"max_tokens": n, "ignore_eos": True, "temperature": 1.0} for n in lengths]
    prompts = [[*HEAD, 50 + i] for i in range(3)]
    with (
        WeightSyncScheme(service, transport="storage", pause_mode="keep") as scheme,
        concurrent.futures.ThreadPoolExecutor(1) as pool,
    ):
        scheme.push(trainer, version=1)
        fut = pool.submit(service.generate_request_batch, prompts, params, routing="prefix")
        until_running(service, fut, 2, "the short one to finish")
        frozen_push(service, scheme, trainer, 2, fut)
        until_running(service, fut, 1, "the mid one to finish")
        frozen_push(service, scheme, trainer, 3, fut)
        batch = fut.result(timeout=120)
    assert len(set(batch.replica_ids.tolist())) == 1  # one replica call
    assert batch.sample_lengths.tolist() == lengths
    assert runs_of(batch) == [[1, 2, 3], [1, 2], [1]]
    assert batch.versions_start == ["1"] * 3 and batch.versions_end == ["3"] * 3
    # The policy's layouts: one version per response token, padding -1.
    padded = generated_padded(batch, pad_token_id=0)
    versions = padded.get(("vllm", "token_weight_version"))
    assert versions.shape == padded.get(("tokens", "response")).shape
    assert (versions[2, 40:] == -1).all() and (versions[0] >= 1).all()
    rows = generated_rows(batch)
    assert [r.get(("vllm", "token_weight_version")).numel() for r in rows] == lengths
    spans = exact_spans(versions[0])
    assert [s.first_version for s in spans] == [1, 2, 3]
    assert spans[0].token_to >= 40 and spans[1].token_to >= 120
    # The three per-sample keys: the last switch of each; every token of the short one
    # (and of the mid one, for version 3) before it.
    assert padded.get(("vllm", "weight_version_end_from")).tolist() == [
        spans[2].token_from,
        120,
        40,
    ]
    # The bound reads each token's own version: with lag 1 at version 3 only version 1's
    # tokens leave the loss (the three keys alone would take out version 2's too).
    mask_stale_tokens(padded, current_version=3, max_policy_lag=1)
    kept = padded.get(("masks", "all_assistant_mask")).sum(-1).tolist()
    assert kept[0] == 220 - spans[0].token_to and kept[2] == 0


def test_a_request_finished_before_a_keep_push_keeps_its_version(service, trainer):
    # Two requests of one replica call: the short one finished, the long one still
    # running when the push lands; none of the short one's tokens is the push's.
    params = [{"max_tokens": n, "ignore_eos": True, "temperature": 1.0} for n in (40, 200)]
    prompt = [*HEAD, 60]
    with (
        WeightSyncScheme(service, transport="storage", pause_mode="keep") as scheme,
        concurrent.futures.ThreadPoolExecutor(1) as pool,
    ):
        scheme.push(trainer, version=1)
        fut = pool.submit(
            service.generate_request_batch, [prompt, prompt], params, routing="prefix"
        )
        until_running(service, fut, 1, "the short one to finish")
        frozen_push(service, scheme, trainer, 2, fut)
        batch = fut.result(timeout=120)
    assert len(set(batch.replica_ids.tolist())) == 1  # one call: the bug's setting
    assert batch.sample_lengths.tolist() == [40, 200]
    assert runs_of(batch) == [[1], [1, 2]]
    assert batch.versions_end == ["2", "2"]
    assert batch.end_version_from.tolist()[0] == 40  # every token before the end version's


def test_a_request_held_by_a_pause_through_a_push_is_the_new_versions(service, trainer):
    # Sent while the service is paused: admitted under version 1's label, held, started
    # after the push: every token is version 2's (recorded as a switch at token 0).
    params = {"max_tokens": 8, "ignore_eos": True, "temperature": 1.0}
    with (
        WeightSyncScheme(service, transport="storage", pause_mode="keep") as scheme,
        concurrent.futures.ThreadPoolExecutor(1) as pool,
    ):
        scheme.push(trainer, version=1)
        service.pause("keep", clear_cache=False)
        try:
            fut = pool.submit(service.generate_request_batch, [[*HEAD, 70]], params)
            wait_until(lambda: sum(s.outstanding for s in service.stats()), 30, what="held")
            perturb(trainer, seed=21)
            scheme.push(trainer, version=2)
        finally:
            service.resume()
        batch = fut.result(timeout=120)
    assert batch.versions_start == ["1"] and batch.versions_end == ["2"]
    assert batch.token_versions().tolist() == [2] * 8
    assert batch.end_version_from.tolist() == [0]

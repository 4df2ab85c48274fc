"""Async collection into a TorchRL replay buffer while a slow trainer pushes weights.

The collector is TorchRL's LLMCollector running free (``start()``) through
:class:`~torchrl_vllm_ext.AsyncCollection`; the trainer reads the buffer, sleeps (a slow
training step), perturbs its weights and pushes them with ``pause_mode="keep"``. Every
sample the trainer reads is at most ``max_policy_lag`` versions old. Separately, a long
generation in flight across a ``keep`` push finishes and says so in its version tags.
"""

from __future__ import annotations

import concurrent.futures
import time

import pytest
import torch
from tensordict import TensorDict, lazy_stack

from torchrl_vllm_ext import AsyncCollection, TokenCopyEnv, VLLMPolicy, WeightSyncScheme
from torchrl_vllm_ext.collectors import mask_stale_tokens, sample_versions

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

"""AsyncCollection without vLLM: a collector thread that dies says so to the trainer."""

from __future__ import annotations

import logging

import pytest
import torch
from tensordict import lazy_stack
from torchrl.data import LazyStackStorage, ReplayBuffer

from torchrl_vllm_ext import AsyncCollection, CollectionStoppedError, TokenCopyEnv

from ..helpers import wait_until


class CopierThatFails:
    """Copies each prompt (a rule-based policy), then raises on call ``fail_at`` (the
    collector makes call 1 as it is built, each batch one more)."""

    def __init__(self, fail_at: int):
        self.calls = 0
        self.fail_at = fail_at

    def __call__(self, td):
        self.calls += 1
        if self.calls == self.fail_at:
            raise ValueError(f"policy broke on call {self.calls}")
        rows = lazy_stack(list(td.unbind(0)))
        for row in rows.tensordicts:
            p = row["tokens", "prompt"]
            row.set(("tokens", "full"), torch.cat([p, p]))
            row.set_non_tensor(("vllm", "weight_version"), "0")  # as VLLMPolicy tags rows
        return rows


def make(policy, rb) -> AsyncCollection:
    # The scheme is never reached: the trainer's push is refused first.
    return AsyncCollection(
        TokenCopyEnv((2,), prompt_len=3), policy, object(), rb, dialog_turns_per_batch=2
    )


def test_a_dead_collector_thread_is_raised_to_the_trainer(caplog):
    policy = CopierThatFails(fail_at=4)
    rb = ReplayBuffer(storage=LazyStackStorage(64))
    collection = make(policy, rb)
    with caplog.at_level(logging.ERROR, "torchrl_vllm_ext.collectors.async_collection"):
        with pytest.raises(CollectionStoppedError, match="policy broke on call 4") as err:
            with collection:
                wait_until(lambda: collection.error is not None, 30, what="the thread to fail")
                assert len(rb) == 4  # two batches got in before the failure
                collection.update_policy_weights_({})
    assert isinstance(err.value.__cause__, ValueError)
    assert "the collector thread stopped: ValueError" in caplog.text
    assert not collection.collector.is_running()


def test_leaving_the_block_raises_what_stopped_the_thread():
    collection = make(CopierThatFails(fail_at=2), ReplayBuffer(storage=LazyStackStorage(8)))
    with pytest.raises(CollectionStoppedError, match="start a new AsyncCollection"):
        with collection:
            wait_until(lambda: collection.error is not None, 30, what="the thread to fail")
    # The trainer's own error goes first.
    collection = make(CopierThatFails(fail_at=2), ReplayBuffer(storage=LazyStackStorage(8)))
    with pytest.raises(KeyError):
        with collection:
            wait_until(lambda: collection.error is not None, 30, what="the thread to fail")
            raise KeyError("the trainer's")


def test_a_healthy_thread_checks_clean():
    rb = ReplayBuffer(storage=LazyStackStorage(64))
    with make(CopierThatFails(fail_at=10**9), rb) as collection:
        wait_until(lambda: len(rb) >= 4, 30, what="two batches")
        collection.check()
    assert collection.error is None

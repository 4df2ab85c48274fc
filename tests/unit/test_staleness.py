"""Staleness bound without vLLM: the replay-buffer filter and the collection gate."""

from __future__ import annotations

import threading

import pytest
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict, lazy_stack
from torchrl.data import LazyStackStorage, ReplayBuffer

from torchrl_vllm_ext.collectors import (
    StalenessFilter,
    StalenessGate,
    mask_stale_tokens,
    sample_versions,
    stale_prefix,
)
from torchrl_vllm_ext.errors import ConfigurationError


def rows(versions: list[str]) -> TensorDict:
    td = TensorDict({"x": torch.arange(len(versions))}, batch_size=[len(versions)])
    td.set(("vllm", "weight_version"), NonTensorStack(*versions))
    return td


def test_sample_versions_reads_engine_strings_and_torchrl_ints():
    assert sample_versions(rows(["2", "0", "7"])).tolist() == [2, 0, 7]
    shared = TensorDict(batch_size=[3])
    shared.set(("vllm", "weight_version"), NonTensorData("4", batch_size=[3]))
    assert sample_versions(shared).tolist() == [4, 4, 4]
    ints = TensorDict({("next", "policy_version"): torch.tensor([1, 2])}, batch_size=[2])
    assert sample_versions(ints, ("next", "policy_version")).tolist() == [1, 2]


def test_filter_drops_on_write_and_on_sample():
    version = [2]
    keep = StalenessFilter(lambda: version[0], max_policy_lag=1)
    rb = ReplayBuffer(storage=LazyStackStorage(32), transform=keep)
    rb.extend(rows(["0", "1", "2", "2"]))
    assert len(rb) == 3 and keep.dropped == 1
    version[0] = 3  # the trainer moved on while "1" sat in the buffer
    for _ in range(5):
        got = sample_versions(rb.sample(16))
        assert (3 - got <= 1).all() and got.numel() > 0
    assert keep.dropped > 1


def test_an_all_stale_write_adds_nothing_and_the_buffer_keeps_working():
    # A collector thread extends the buffer with a whole batch the trainer has moved past;
    # TorchRL's writer raises on an empty write, which would end the thread.
    version = [5]
    keep = StalenessFilter(lambda: version[0], max_policy_lag=0)
    rb = ReplayBuffer(storage=LazyStackStorage(32), batch_size=4)
    rb.append_transform(lambda td: td)  # a user's transform: the filter goes before it
    rb.insert_transform(0, keep)
    assert rb.extend(rows(["3", "4"])).numel() == 0
    assert len(rb) == 0 and keep.dropped == 2
    rb.extend(rows(["5", "4"]))
    assert len(rb) == 1 and keep.dropped == 3
    version[0] = 6  # everything stored is stale now: a sample comes back empty
    assert rb.sample().batch_size == (0,)


def test_rows_without_an_integer_version_say_what_to_do():
    with pytest.raises(ConfigurationError, match="Collect with VLLMPolicy"):
        sample_versions(TensorDict({"x": torch.arange(2)}, batch_size=[2]))
    with pytest.raises(ConfigurationError, match="needs integer versions"):
        sample_versions(rows(["3", "after-restore"]))


def test_filter_lag_zero_is_on_policy_only():
    keep = StalenessFilter(lambda: 5, max_policy_lag=0)
    assert keep.fresh(rows(["5", "4", "6"])).tolist() == [True, False, True]


@pytest.mark.parametrize("lag", [-1, 1.5, True, None])
def test_bad_lag_says_what_is_accepted(lag):
    with pytest.raises(ConfigurationError, match="int >= 0"):
        StalenessFilter(lambda: 0, max_policy_lag=lag)


def test_gate_lets_a_batch_run_at_most_lag_versions_ahead():
    version = [10]
    gate = StalenessGate(lambda: version[0], max_policy_lag=2)
    for _ in range(3):  # batches 0..2 start at once: 0, 1 and 2 versions ahead
        assert gate.ready()
        gate.admit()
    assert not gate.ready()
    version[0] = 11
    assert gate.ready()


def test_gate_holds_the_collector_until_the_trainer_pushes():
    version = [0]
    gate = StalenessGate(lambda: version[0], max_policy_lag=0, poll_s=0.005)
    gate.admit()  # batch 0 at version 0
    admitted = threading.Event()
    t = threading.Thread(target=lambda: (gate.admit(), admitted.set()))
    t.start()
    assert not admitted.wait(0.2), "batch 1 must wait for version 1"
    version[0] = 1
    assert admitted.wait(5.0)
    t.join()
    assert gate.started == 2 and gate.waited_s >= 0.2


def test_gate_close_releases_a_held_collector():
    gate = StalenessGate(lambda: 0, max_policy_lag=0, poll_s=0.005)
    gate.admit()
    t = threading.Thread(target=gate.admit)
    t.start()
    gate.close()
    t.join(timeout=5.0)
    assert not t.is_alive()


# ----------------------------------------------------------------------------- partial rollouts
def partial_rollout(ragged: bool):
    """Three samples of 4 response tokens after a 2-token prompt, pushed at version 2
    mid-generation: admitted at 1/1/2, finished at 2/1/2, end version from token 3/0/0."""
    mask = torch.tensor([False, False, True, True, True, True])
    if ragged:
        td = lazy_stack(
            [TensorDict({("masks", "all_assistant_mask"): mask.clone()}) for _ in range(3)]
        )
    else:
        td = TensorDict({("masks", "all_assistant_mask"): mask.repeat(3, 1)}, batch_size=[3])
    td.set(("vllm", "weight_version"), NonTensorStack("1", "1", "2"))
    td.set(("vllm", "weight_version_end"), NonTensorStack("2", "1", "2"))
    td.set(("vllm", "weight_version_end_from"), torch.tensor([3, 0, 0]))
    return td


@pytest.mark.parametrize("ragged", [False, True])
def test_mask_stale_tokens_keeps_the_fresh_part_of_a_partial_rollout(ragged):
    td = partial_rollout(ragged)
    assert stale_prefix(td, current_version=2, max_policy_lag=0).tolist() == [3, -1, 0]
    mask_stale_tokens(td, current_version=2, max_policy_lag=0)
    kept = [int(m.sum()) for m in td.get(("masks", "all_assistant_mask"), as_list=True)]
    assert kept == [1, 0, 4]  # 1 of 4 from version 2; all from version 1; all from 2
    td = partial_rollout(ragged)
    mask_stale_tokens(td, current_version=2, max_policy_lag=1)  # everything within the bound
    assert [int(m.sum()) for m in td.get(("masks", "all_assistant_mask"), as_list=True)] == [
        4,
        4,
        4,
    ]

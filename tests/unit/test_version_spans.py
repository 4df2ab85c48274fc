"""Per-token weight versions without vLLM: the replica's switch records (every switch, held
requests, samples finished before a push), the columnar batch that carries them, the
policy's ``("vllm", "token_weight_version")`` in both layouts, and the consumers that read
it (exact spans, exact stale masks, the partial-rollout figures, the rollout recorder)."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tensordict import NonTensorStack, TensorDict, lazy_stack

from torchrl_vllm_ext._compat.replica import tokens_so_far
from torchrl_vllm_ext.batches import EVERY_SAMPLE, RequestBatch
from torchrl_vllm_ext.collectors import (
    exact_spans,
    exclude_stale_tokens,
    mask_stale_tokens,
    stale_prefix,
    token_spans,
    version_runs,
)
from torchrl_vllm_ext.engine.outputs import pack_outputs
from torchrl_vllm_ext.engine.replica.served_weights import ServedWeights
from torchrl_vllm_ext.grpo.async_metrics import batch_staleness
from torchrl_vllm_ext.grpo.rollouts import RolloutRecorder
from torchrl_vllm_ext.messages import RequestData, SampleData
from torchrl_vllm_ext.wrappers.convert import generated_padded, generated_rows
from torchrl_vllm_ext.wrappers.layout import NO_TOKEN_VERSION, TOKEN_VERSION_KEY

from ..helpers import recorded_spans

MASK, LOG_PROBS = ("masks", "all_assistant_mask"), ("log_probs", "full")


# ---------------------------------------------------------------------- vLLM stand-ins
@dataclass
class Completion:  # the fields of vllm.CompletionOutput that pack_outputs reads
    index: int
    token_ids: list
    logprobs: object = None
    finish_reason: str = "length"
    stop_reason: object = None
    text: str = ""


@dataclass
class Output:  # the fields of vllm.RequestOutput that pack_outputs reads
    request_id: str
    outputs: list
    prompt_token_ids: list = field(default_factory=lambda: [1, 2])
    prompt_logprobs: object = None


def completions(*lengths: int) -> list[Completion]:
    return [Completion(i, list(range(10, 10 + n))) for i, n in enumerate(lengths)]


# ---------------------------------------------------------------------- replica side
def test_served_weights_keeps_every_switch_in_order_and_pops_per_request():
    weights = ServedWeights(replica_id=0, version="1")
    weights.switched({("a", 0): 3, ("a", 1): 5, ("b", EVERY_SAMPLE): 0}, "2")
    weights.switched({("a", 0): 7, ("b", 0): 2}, "3")
    assert weights.take_switches(["a"]) == {("a", 0): [("2", 3), ("3", 7)], ("a", 1): [("2", 5)]}
    assert weights.take_switches(["b", "c"]) == {
        ("b", EVERY_SAMPLE): [("2", 0)],
        ("b", 0): [("3", 2)],
    }
    assert weights.take_switches(["a", "b"]) is None


def test_two_keep_pushes_inside_one_sample_give_three_runs():
    weights = ServedWeights(replica_id=0, version="1")
    weights.switched({("r", 0): 4}, "2")
    weights.switched({("r", 0): 9}, "3")
    batch = pack_outputs([Output("r", completions(12))], 0, "1", "3", weights.take_switches(["r"]))
    versions = batch.token_versions()
    assert version_runs(versions) == [(1, 0, 4), (2, 4, 9), (3, 9, 12)]
    assert batch.end_version_from.tolist() == [9]


def test_a_request_held_through_a_push_is_made_by_the_new_version():
    weights = ServedWeights(replica_id=0, version="1")
    weights.switched({("held", EVERY_SAMPLE): 0}, "2")  # not started when "2" came in
    weights.switched({("held", 0): 3, ("held", 1): 1}, "3")
    batch = pack_outputs(
        [Output("held", completions(5, 2))], 0, "1", "3", weights.take_switches(["held"])
    )
    rows = np.split(batch.token_versions(), np.cumsum(batch.sample_lengths)[:-1])
    assert [r.tolist() for r in rows] == [[2, 2, 2, 3, 3], [2, 3]]


def test_a_sample_finished_before_a_push_keeps_its_old_version():
    # n=2: sample 0 had finished with 4 tokens (vLLM reports it by its final count)
    # when a keep push landed; sample 1 went on with the new weights.
    weights = ServedWeights(replica_id=0, version="1")
    weights.switched({("r", 0): 4, ("r", 1): 6}, "2")
    batch = pack_outputs(
        [Output("r", completions(4, 9))], 0, "1", "2", weights.take_switches(["r"])
    )
    assert batch.switch_counts.tolist() == [0, 1]
    rows = np.split(batch.token_versions(), [4])
    assert rows[0].tolist() == [1] * 4 and rows[1].tolist() == [1] * 6 + [2] * 3
    # The three per-sample keys agree: every token of sample 0 is before end_from.
    assert batch.end_version_from.tolist() == [4, 6]
    spans = token_spans(1, 2, 4, 4)
    assert [(s.first_version, s.token_to) for s in spans] == [(1, 4)]


def test_a_request_finished_before_a_push_in_the_same_call_keeps_its_old_version():
    # Absent from tokens_so_far (finished), so no switch was recorded for it.
    weights = ServedWeights(replica_id=0, version="1")
    weights.switched({("long", 0): 5}, "2")
    batch = pack_outputs(
        [Output("short", completions(2)), Output("long", completions(8))],
        0,
        "1",
        "2",
        weights.take_switches(["short", "long"]),
    )
    assert batch.token_versions().tolist() == [1, 1] + [1] * 5 + [2] * 3
    assert batch.end_version_from.tolist() == [2, 5]


def _state(rid, index, count, parent=None):
    detokenizer = SimpleNamespace(num_output_tokens=lambda: count)
    return SimpleNamespace(
        external_req_id=rid, request_index=index, detokenizer=detokenizer, parent_req=parent
    )


def test_tokens_so_far_reports_finished_children_by_their_final_count():
    # vLLM drops a finished child's state; its parent keeps the child's final output.
    parent = SimpleNamespace(output_aggregator=[None, Completion(1, [5, 6, 7]), None])
    processor = SimpleNamespace(
        request_states={
            "0_r": _state("r", 0, 2, parent),
            "2_r": _state("r", 2, 4, parent),
            "x": _state("other", 0, 9),
        }
    )
    assert tokens_so_far(processor, {"r"}) == {("r", 0): 2, ("r", 1): 3, ("r", 2): 4}


# ---------------------------------------------------------------------- the batch
def sample_with(n: int, switches=()) -> SampleData:
    return SampleData(
        np.arange(n, dtype=np.int64),
        np.full(n, -0.5, np.float32),
        "length",
        None,
        "",
        switches=list(switches),
    )


def three_requests() -> RequestBatch:
    return RequestBatch.from_requests(
        [
            RequestData(np.array([1]), None, [sample_with(3)], 0, "4", "4"),
            RequestData(
                np.array([2, 3]),
                None,
                [sample_with(5, [("5", 1), ("6", 3)]), sample_with(2)],
                0,
                "4",
                "6",
            ),
            RequestData(np.array([4]), None, [sample_with(2, [("x", 1)])], 1, "6", "x"),
        ]
    )


def test_request_batch_carries_switches_through_take_concat_and_unpack():
    batch = three_requests()
    assert batch.switch_counts.tolist() == [0, 2, 0, 1]
    assert batch.switch_versions == ["5", "6", "x"]
    assert batch.switch_tokens.dtype == np.int64
    assert batch.token_versions().tolist() == [4, 4, 4, 4, 5, 5, 6, 6, 4, 4, 6, -1]
    # A non-integer label has no integer version: NO_TOKEN_VERSION.
    assert batch.end_version_from.tolist() == [0, 3, 2, 1]
    swapped = batch.take(np.array([2, 1, 0]))
    assert swapped.switch_versions == ["x", "5", "6"]
    assert swapped.token_versions().tolist() == [6, -1, 4, 5, 5, 6, 6, 4, 4, 4, 4, 4]
    back = RequestBatch.merge(
        [([2, 1], batch.take(np.array([0, 1]))), ([0], batch.take(np.array([2])))], 3
    )
    assert back.switch_versions == ["x", "5", "6"]
    whole = RequestBatch.concat([batch.take(np.array([0])), batch.take(np.array([1, 2]))])
    assert whole.token_versions().tolist() == batch.token_versions().tolist()
    unpacked = batch.unpack()
    assert unpacked[1].samples[0].switches == [("5", 1), ("6", 3)]
    assert [s.end_version_from for r in unpacked for s in r.samples] == [0, 3, 2, 1]
    again = RequestBatch.from_requests(unpacked)
    assert again.switch_versions == batch.switch_versions
    np.testing.assert_array_equal(again.switch_tokens, batch.switch_tokens)


def test_request_batch_fields_are_plain_columns():
    # What crosses Ray: numpy arrays and lists of str, no object of ours per sample.
    batch = three_requests()
    for name in ("switch_counts", "switch_tokens"):
        value = getattr(batch, name)
        assert isinstance(value, np.ndarray) and value.dtype == np.int64, name
    assert all(type(v) is str for v in batch.switch_versions)


# ---------------------------------------------------------------------- the policy's layout
def spanning_batch() -> RequestBatch:
    """Two samples: one made by 1, 2 and 3 (two pushes inside), one by 3 alone."""
    return RequestBatch.from_requests(
        [
            RequestData(
                np.array([7, 8]), None, [sample_with(6, [("2", 2), ("3", 4)])], 0, "1", "3"
            ),
            RequestData(np.array([9]), None, [sample_with(3)], 0, "3", "3"),
        ]
    )


def test_token_versions_are_shaped_like_the_response_in_both_layouts():
    padded = generated_padded(spanning_batch(), pad_token_id=0)
    versions = padded.get(TOKEN_VERSION_KEY)
    assert versions.dtype == torch.int64
    assert versions.shape == padded.get(("tokens", "response")).shape
    assert versions.tolist() == [[1, 1, 2, 2, 3, 3], [3, 3, 3] + [NO_TOKEN_VERSION] * 3]
    rows = generated_rows(spanning_batch())
    assert [r.get(TOKEN_VERSION_KEY).tolist() for r in rows] == [[1, 1, 2, 2, 3, 3], [3, 3, 3]]
    assert all(r.get(TOKEN_VERSION_KEY).shape == r.get(("tokens", "response")).shape for r in rows)
    # The three per-sample keys are still written.
    assert padded.get(("vllm", "weight_version_end_from")).tolist() == [4, 0]


# ---------------------------------------------------------------------- consumers
def test_version_runs_and_exact_spans():
    assert version_runs(torch.tensor([5, 5, 5])) == [(5, 0, 3)]
    spans = exact_spans(torch.tensor([1, 1, 2, 2, 3, 3, -1]))
    assert [(s.first_version, s.last_version, s.token_from, s.token_to) for s in spans] == [
        (1, 1, 0, 2),
        (2, 2, 2, 4),
        (3, 3, 4, 6),
    ]
    # The three keys alone: the first span is the range 1..2, read as 1 by a bound.
    assert [(s.first_version, s.last_version) for s in token_spans(1, 3, 4, 6)] == [(1, 2), (3, 3)]


@pytest.mark.parametrize("layout", ["padded", "ragged"])
def test_mask_takes_out_exactly_the_tokens_past_the_bound(layout):
    batch = spanning_batch()
    td = (
        generated_padded(batch, pad_token_id=0)
        if layout == "padded"
        else lazy_stack(generated_rows(batch))
    )
    # current 3, lag 1: version 1 is past the bound, 2 and 3 are within it. The three keys
    # alone would read every token before end_from (4) as version 1.
    assert stale_prefix(td, 3, 1).tolist() == [2, 0]
    mask_stale_tokens(td, current_version=3, max_policy_lag=1)
    kept = [m.tolist() for m in td.get(MASK, as_list=True)]
    if layout == "padded":
        assert kept[0] == [False, False, False, False, True, True, True, True]
        assert kept[1] == [False] * 2 + [True] * 3 + [False] * 3
    else:
        assert kept == [
            [False, False, False, False, True, True, True, True],
            [False, True, True, True],
        ]
    mask_stale_tokens(td, current_version=3, max_policy_lag=1)  # idempotent
    assert [m.tolist() for m in td.get(MASK, as_list=True)] == kept


@pytest.mark.parametrize("layout", ["padded", "ragged"])
def test_exclude_counts_exactly_the_tokens_past_the_bound(layout):
    batch = spanning_batch()
    td = (
        generated_padded(batch, pad_token_id=0)
        if layout == "padded"
        else lazy_stack(generated_rows(batch))
    )
    out = exclude_stale_tokens(td, current_version=3, max_policy_lag=0)
    assert out.per_sample.tolist() == [4, 0] and out.tokens == 4 and out.samples == 0
    assert out.kept_tokens == 5
    nan = [lp.isnan().tolist() for lp in td.get(LOG_PROBS, as_list=True)]
    assert nan[0][-6:] == [True] * 4 + [False] * 2  # the response: full's last 6
    # Everything past the bound: the whole sample out.
    td = generated_padded(batch, pad_token_id=0)
    out = exclude_stale_tokens(td, current_version=5, max_policy_lag=0)
    assert out.samples == 2 and out.kept_tokens == 0


def test_without_the_per_token_key_the_conservative_rule_stays():
    td = generated_padded(spanning_batch(), pad_token_id=0)
    del td["vllm", "token_weight_version"]
    assert stale_prefix(td, 3, 1).tolist() == [4, 0]  # tokens before end_from read as 1


def test_partial_figures_read_the_per_token_versions():
    # A sample finished before a push: start 1, end 2, but no token by 2.
    td = TensorDict(
        {TOKEN_VERSION_KEY: torch.tensor([[1, 1, 1], [1, 2, 3], [3, 3, -1]])}, batch_size=[3]
    )
    td.set(("vllm", "weight_version"), NonTensorStack("1", "1", "3"))
    td.set(("vllm", "weight_version_end"), NonTensorStack("2", "3", "3"))
    out = batch_staleness(td, 3)
    assert out["partial_ratio"] == pytest.approx(1 / 3) and out["max_partial_span"] == 2
    del td["vllm", "token_weight_version"]
    out = batch_staleness(td, 3)  # the start / end rule counts the finished one as partial
    assert out["partial_ratio"] == pytest.approx(2 / 3)


def test_rollout_recorder_records_exact_spans(tmp_path):
    td = generated_padded(spanning_batch(), pad_token_id=0)
    td.set(("next", "reward"), torch.zeros(2))
    td.set("advantage", torch.zeros(2))
    rec = RolloutRecorder(tmp_path / "r", steps=1, rows=2, prompt_len=2, response_len=6)
    rec.record(0, td, consumed_version=3, stale_tokens=torch.tensor([2, 0]))
    row = rec.td[0, 0]
    assert row["token_weight_version"].tolist() == [1, 1, 2, 2, 3, 3]
    assert [(s.first_version, s.token_from, s.token_to) for s in recorded_spans(row)] == [
        (1, 0, 2),
        (2, 2, 4),
        (3, 4, 6),
    ]
    assert rec.td[0, 1]["token_weight_version"].tolist() == [3, 3, 3, -1, -1, -1]


def test_rollout_recorder_without_the_key_records_the_oldest_possible_versions(tmp_path):
    td = generated_padded(spanning_batch(), pad_token_id=0)
    del td["vllm", "token_weight_version"]
    td.set(("next", "reward"), torch.zeros(2))
    td.set("advantage", torch.zeros(2))
    rec = RolloutRecorder(tmp_path / "r", steps=1, rows=2, prompt_len=2, response_len=6)
    rec.record(0, td)
    assert rec.td[0, 0]["token_weight_version"].tolist() == [1, 1, 1, 1, 3, 3]


def test_a_sample_finished_between_two_pushes_has_no_end_version_token():
    # Push 2 landed inside both samples, push 3 after sample 1 finished.
    weights = ServedWeights(replica_id=0, version="1")
    weights.switched({("r", 0): 2, ("r", 1): 2}, "2")
    weights.switched({("r", 0): 6, ("r", 1): 4}, "3")  # sample 1 had finished with 4
    batch = pack_outputs(
        [Output("r", completions(9, 4))], 0, "1", "3", weights.take_switches(["r"])
    )
    rows = np.split(batch.token_versions(), [9])
    assert [r.tolist() for r in rows] == [[1, 1, 2, 2, 2, 2, 3, 3, 3], [1, 1, 2, 2]]
    # end_from names the first token of the end version (3): none in sample 1.
    assert batch.end_version_from.tolist() == [6, 4]

"""Asynchronous GRPO without vLLM: the producer queue, the staleness bound in the loop,
stale tokens out of TorchRL's loss, version spans, the idle and staleness figures, the
config and the demo's flags."""

from __future__ import annotations

import argparse
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from tensordict import NonTensorStack, TensorDict

from torchrl_vllm_ext.collectors import (
    BusyClock,
    RolloutQueue,
    StalenessGate,
    exclude_stale_tokens,
    token_spans,
)
from torchrl_vllm_ext.errors import CollectionStoppedError, ConfigurationError
from torchrl_vllm_ext.grpo import GRPOConfig
from torchrl_vllm_ext.grpo.async_loop import AsyncLoop
from torchrl_vllm_ext.grpo.async_metrics import (
    STEP_KEYS,
    async_summary,
    batch_staleness,
    idle_figures,
)
from torchrl_vllm_ext.jobs import demo

ROWS, PROMPT, ANSWER = 4, 2, 3


def batch_at(start: list[int], end: list[int] | None = None, end_from: list[int] | None = None):
    """A padded batch as VLLMPolicy writes it: prompt then response in ``full``."""
    n = len(start)
    end = start if end is None else end
    assistant = torch.zeros(n, PROMPT + ANSWER, dtype=torch.bool)
    assistant[:, PROMPT:] = True
    td = TensorDict(
        {
            ("masks", "all_assistant_mask"): assistant,
            ("log_probs", "full"): torch.full((n, PROMPT + ANSWER), -1.0),
            ("vllm", "weight_version_end_from"): torch.tensor(end_from or [0] * n),
        },
        batch_size=[n],
    )
    td.set(("vllm", "weight_version"), NonTensorStack(*map(str, start)))
    td.set(("vllm", "weight_version_end"), NonTensorStack(*map(str, end)))
    return td


# ---------------------------------------------------------------- the producer queue
def test_queue_keeps_order_and_bounds_how_far_the_producer_runs_ahead():
    made = []

    def batches():
        for i in range(100):
            made.append(i)
            yield i

    with RolloutQueue(batches(), maxsize=2) as rollouts:
        time.sleep(0.3)
        assert len(made) <= 3  # two waiting, one held by the blocked put
        got = [rollouts.get() for _ in range(5)]
    assert [g.batch for g in got] == [g.index for g in got] == [0, 1, 2, 3, 4]
    assert all(g.generate_s >= 0 for g in got)


def test_queue_hands_the_producers_error_to_the_trainer():
    def batches():
        yield 0
        raise RuntimeError("env broke")

    with RolloutQueue(batches(), maxsize=1) as rollouts:
        assert rollouts.get().batch == 0
        with pytest.raises(CollectionStoppedError, match="env broke"):
            rollouts.get()


def test_close_releases_a_producer_held_at_the_gate_and_joins_it():
    gate = StalenessGate(lambda: 0, max_policy_lag=0)
    rollouts = RolloutQueue(iter(range(10)), maxsize=5, gate=gate).start()
    assert rollouts.get().batch == 0
    time.sleep(0.1)  # batch 1 may not start before version 1: held
    with pytest.raises(Exception):  # noqa: B017 (nothing comes: the queue stays empty)
        rollouts._queue.get(timeout=0.1)
    rollouts.close(timeout=5)
    assert not rollouts._thread.is_alive()


def test_busy_clock_counts_the_block_in_progress():
    clock = BusyClock()
    started = threading.Event()

    def work():
        with clock.busy():
            started.set()
            time.sleep(0.2)

    t = threading.Thread(target=work)
    t.start()
    started.wait()
    time.sleep(0.05)
    assert clock.seconds() > 0.04
    t.join()
    assert clock.seconds() >= 0.2


# ---------------------------------------------------------------- stale tokens, spans
def test_stale_tokens_leave_torchrls_grpo_loss_mask():
    # Sample 0 is fresh; 1 spans a push (its first 2 tokens too old); 2 is all too old.
    td = batch_at(start=[5, 3, 2], end=[5, 4, 2], end_from=[0, 2, 0])
    out = exclude_stale_tokens(td, current_version=5, max_policy_lag=1)
    assert (out.samples, out.tokens, out.kept_tokens) == (1, 5, 4)
    assert out.per_sample.tolist() == [0, 2, 3]
    nan = td["log_probs", "full"].isnan()
    assert nan.tolist() == [
        [False] * 5,
        [False, False, True, True, False],
        [False, False, True, True, True],
    ]
    # TorchRL's GRPOLoss takes a token into its mask only where this is finite.
    assert (torch.isfinite(td["log_probs", "full"]) & td["masks", "all_assistant_mask"]).sum() == 4


def test_stale_tokens_of_a_stack_of_padded_batches_are_written_in_place():
    from tensordict import lazy_stack

    stacked = lazy_stack([batch_at(start=[5, 2]), batch_at(start=[2, 5])])  # LLMCollector's
    out = exclude_stale_tokens(stacked, current_version=5, max_policy_lag=1)
    assert out.per_sample.tolist() == [0, 3, 3, 0]
    nan = [td["log_probs", "full"].isnan().any(-1).tolist() for td in stacked.tensordicts]
    assert nan == [[False, True], [True, False]]


def test_version_spans_from_the_engines_record():
    one = token_spans(4, 4, 0, 3)
    assert [(s.first_version, s.last_version, s.token_from, s.token_to) for s in one] == [
        (4, 4, 0, 3)
    ]
    two_pushes = token_spans(2, 4, 1, 3)  # two pushes fell inside: the first span is 2..3
    assert [(s.first_version, s.last_version, s.token_from, s.token_to) for s in two_pushes] == [
        (2, 3, 0, 1),
        (4, 4, 1, 3),
    ]
    before_any_token = token_spans(2, 3, 0, 3)  # admitted at 2, every token made by 3
    assert [(s.first_version, s.token_from) for s in before_any_token] == [(3, 0)]


def test_batch_staleness_figures():
    td = batch_at(start=[5, 3, 2, 5], end=[5, 5, 2, 5], end_from=[0, 1, 0, 0])
    stale = exclude_stale_tokens(td, current_version=5, max_policy_lag=2)
    out = batch_staleness(td, 5, stale)
    assert out["staleness_max"] == 3 and out["staleness_mean"] == pytest.approx(1.25)
    assert out["stale_dropped"] == 1 and out["stale_masked_tokens"] == 3
    assert out["stale_samples"] == 1  # sample 1: 2 behind, within the bound
    assert out["partial_ratio"] == 0.25 and out["max_partial_span"] == 2


def test_idle_figures_clamp_to_the_step():
    out = idle_figures(step_s=1.0, trainer_idle_s=0.2, rollout_busy_s=1.3, tokens=50)
    assert out["rollout_idle_ratio"] == 0.0 and out["trainer_idle_ratio"] == 0.2
    assert out["fleet_tokens_per_s"] == 50.0


# ---------------------------------------------------------------- the loop, with stand-ins
class FakeCollector:
    """Batches labelled like the engine's: admitted at the served version, finished at
    the one served ``gen_s`` later (a keep push may fall inside)."""

    def __init__(self, gen_s: float, in_flight: bool):
        self.policy_version = 0  # what the replicas serve, and the trainer's version
        self.gen_s, self.in_flight = gen_s, in_flight
        self.updater = SimpleNamespace(last_report=SimpleNamespace(pause_s={}))
        self.shut = False

    def __iter__(self):
        while True:
            start = self.policy_version
            time.sleep(self.gen_s)
            end = self.policy_version if self.in_flight else start
            yield batch_at([start] * ROWS, [end] * ROWS, [1 if end > start else 0] * ROWS)

    def update_policy_weights_(self, model):
        time.sleep(0.005)
        self.policy_version += 1

    def shutdown(self):
        self.shut = True


class FakeTrainer:
    def __init__(self, train_s: float):
        self.train_s = train_s

    def step(self, batch):
        time.sleep(self.train_s)
        return {"reward": 0.5}


class FakeRecorder:
    def __init__(self):
        self.rows = []

    def record(self, step, batch, *, consumed_version, stale_tokens):
        start = batch.get(("vllm", "weight_version")).tolist()
        self.rows.append((consumed_version, [int(v) for v in start], stale_tokens.tolist()))


def run_fake(lag: int, policy: str, *, in_flight: bool, steps: int = 8, gen_s=0.02, train_s=0.04):
    cfg = GRPOConfig(
        steps=steps,
        prompts_per_step=1,
        group_size=ROWS,
        answer_len=ANSWER,
        async_mode=True,
        max_policy_lag=lag,
        stale_policy=policy,
        in_flight_updates=in_flight,
    )
    recorder = FakeRecorder()
    loop = AsyncLoop(cfg, FakeTrainer(train_s), recorder, model=None, scheme=None)
    loop.collector = FakeCollector(gen_s, in_flight)
    loop.updater = loop.collector.updater
    out = loop.run(progress=False, on_step=None)
    assert loop.collector.shut
    return out, recorder.rows


@pytest.mark.parametrize("lag", [0, 1, 2])
def test_wait_policy_never_trains_on_weights_older_than_the_bound(lag):
    steps, rows = run_fake(lag, "wait", in_flight=True)
    assert len(steps) == len(rows) == 8
    for consumed, starts, stale in rows:
        assert all(consumed - s <= lag for s in starts), (consumed, starts)
        assert stale == [0] * ROWS  # the gate kept every token inside the bound
    assert [s["batch_index"] for s in steps] == list(range(8))  # in order
    for s in steps:
        assert set(STEP_KEYS) <= s.keys()
    # A generation shorter than a step: with lag >= 1 the trainer waits on no batch.
    if lag:
        assert max(s["staleness_max"] for s in steps) >= 1
        assert async_summary(steps)["trainer_idle_ratio"] < 0.5


def test_drop_policy_masks_what_the_bound_excludes():
    # The producer runs ahead (lag 0, a 2-deep queue when the trainer is slow).
    steps, rows = run_fake(0, "drop", in_flight=False, gen_s=0.005, train_s=0.05)
    for consumed, starts, stale in rows:
        for s, cut in zip(starts, stale, strict=True):
            assert (cut == ANSWER) == (consumed - s > 0)  # past the bound: every token out
    assert sum(s["stale_dropped"] for s in steps) + steps[-1]["skipped_batches"] > 0


def test_a_sample_past_the_bound_adds_nothing_to_the_corrected_loss():
    from torchrl.modules.llm import TransformersWrapper
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from torchrl_vllm_ext.losses import CorrectedGRPOLoss
    from torchrl_vllm_ext.testing import make_tiny_model

    path = make_tiny_model()
    actor = TransformersWrapper(
        AutoModelForCausalLM.from_pretrained(path).eval(),
        tokenizer=AutoTokenizer.from_pretrained(path),
        input_mode="tokens",
        generate=False,
        pad_output=True,
    )
    full = torch.tensor([[5, 6, 7, 8, 9], [5, 6, 9, 9, 9]])

    def batch(rows):
        td = batch_at(start=[3, 1], end=[3, 1])[rows]
        td.set(("tokens", "prompt"), full[rows, :PROMPT])
        td.set(("tokens", "response"), full[rows, PROMPT:])
        td.set(("tokens", "full"), full[rows])
        td.set(("masks", "all_attention_mask"), torch.ones(len(rows), 5, dtype=torch.bool))
        td.set("advantage", torch.tensor([[[1.0]], [[-1.0]]])[rows])
        engine = actor(td.copy())["log_probs", "full"].detach() - 0.1  # as if older weights
        td.set(("log_probs", "full"), engine)
        return td

    loss = CorrectedGRPOLoss(
        actor, masking_strategy="sft", entropy_bonus=False, rollout_correction="token_truncate"
    )
    assert not torch.allclose(loss(batch([0, 1])).loss_objective, loss(batch([0])).loss_objective)
    both = batch([0, 1])
    assert exclude_stale_tokens(both, current_version=3, max_policy_lag=1).samples == 1
    only_fresh = loss(batch([0])).loss_objective
    torch.testing.assert_close(loss(both).loss_objective, only_fresh)


# ---------------------------------------------------------------- config and flags
def test_config_checks_the_async_fields():
    assert GRPOConfig().pause_mode is None
    assert GRPOConfig(async_mode=True).pause_mode == "wait"
    assert GRPOConfig(async_mode=True, in_flight_updates=True).pause_mode == "keep"
    with pytest.raises(ConfigurationError, match="max_policy_lag=-1"):
        GRPOConfig(max_policy_lag=-1)
    with pytest.raises(ConfigurationError, match="stale_policy='later'"):
        GRPOConfig(stale_policy="later")
    with pytest.raises(ConfigurationError, match="trainer_ranks=1"):
        GRPOConfig(async_mode=True, trainer_ranks=2, prompts_per_step=8)


def test_demo_flags_switch_async_on():
    parser = argparse.ArgumentParser()
    demo.add_parser(parser.add_subparsers())
    args = parser.parse_args(["demo", "--async", "--max-policy-lag", "2", "--in-flight-updates"])
    assert (args.async_mode, args.max_policy_lag, args.in_flight_updates) == (True, 2, True)
    plain = parser.parse_args(["demo"])
    assert (plain.async_mode, plain.max_policy_lag, plain.stale_policy) == (False, 1, "wait")

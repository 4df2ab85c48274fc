"""A push that fails inside the asynchronous loop leaves the rollout side on the last version.

The trainer's third step diverges (a NaN in its embedding), so the scheme refuses the push
before any replica is touched. The job stops with that typed error, as the synchronous
job does: training on past a refused push would train on weights no replica serves, and
the versions behind would no longer bound how far the samples are from the trainer. Its
producer thread is stopped first; every replica still serves the last committed version
(its log-probs equal the trainer model's of that version); no trained token broke the
staleness bound; and the next push of good weights lands through the same scheme.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from torchrl_vllm_ext import WeightSyncError, WeightSyncScheme

from ..helpers import (
    assert_replicas_match,
    assert_spans_within_bound,
    async_grpo_loop,
    load_trainer,
    producer_threads,
)

FAIL_AT = 3
"""The step whose weights hold a NaN: pushes 1 and 2 land, the third is refused."""
LAG = 1


class DivergesAt:
    """The job's trainer, whose ``at``-th step leaves a NaN in the model (a diverged update)."""

    def __init__(self, trainer, at: int):
        self.trainer = trainer
        self.at = at
        self.steps = 0

    def step(self, batch) -> dict:
        metrics = self.trainer.step(batch)
        self.steps += 1
        if self.steps == self.at:
            with torch.no_grad():
                self.trainer.model.get_input_embeddings().weight[0, 0] = float("nan")
        return metrics


def test_a_refused_push_stops_the_async_job_on_the_last_version(
    service, tiny_model, restore_checkpoint, tmp_path
):
    committed: dict[int, dict[str, torch.Tensor]] = {}
    with WeightSyncScheme(service, transport="storage", pause_mode="keep") as scheme:
        loop, model = async_grpo_loop(
            service, scheme, tiny_model, tmp_path, steps=FAIL_AT + 3, lag=LAG,
            trainer=lambda t: DivergesAt(t, FAIL_AT),
        )  # fmt: skip

        def snapshot(metrics: dict) -> None:  # the weights each landed push serves
            state = model.state_dict()
            committed[metrics["weight_version"]] = {k: v.clone() for k, v in state.items()}

        try:
            loop.run(progress=False, on_step=snapshot)
            raise AssertionError("the NaN push was not refused")
        except WeightSyncError as e:
            assert "NaN" in str(e) and "keep their weights" in str(e), e
        assert producer_threads() == []  # stopped and joined before the error came out
        last = FAIL_AT - 1
        assert sorted(committed) == list(range(1, FAIL_AT))
        assert loop.version() == last and scheme.version == str(last)

        # The rollout side still serves the last committed version, exactly.
        served = load_trainer(tiny_model)
        served.load_state_dict(committed[last])
        assert_replicas_match(service, served, str(last))

        # The bound held for every step trained, the one whose push failed included.
        rollouts = TensorDict.load_memmap(tmp_path / "rollouts")
        assert_spans_within_bound(rollouts, FAIL_AT, LAG)
        assert (rollouts["consumed_version"][:FAIL_AT, 0] == torch.arange(FAIL_AT)).all()

        # Nothing of the refused push stays in the scheme: good weights land next.
        assert scheme.push(served, version=str(FAIL_AT)).version == str(FAIL_AT)
        assert_replicas_match(service, served, str(FAIL_AT))

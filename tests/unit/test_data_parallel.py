"""The GRPO job's trainer ranks without vLLM: the split of a step's groups, the metrics, the
config checks, a data-parallel step over two spawned gloo ranks (FSDP2) against the same
step in one process, and the ranks' lifetime (a failed rank named, an interrupted rank 0
leaves no rank behind)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from tensordict import TensorDict

from torchrl_vllm_ext import ConfigurationError, TrainerRankError
from torchrl_vllm_ext.grpo import GRPOConfig
from torchrl_vllm_ext.grpo.data_parallel import (
    DataParallelStep,
    check_trainer_ranks,
    combine_metrics,
    serve_steps,
    shard_model,
    split_groups,
)
from torchrl_vllm_ext.grpo.ranks import TrainerRanks

GROUP = 2
ROWS = 8


def test_split_keeps_whole_groups_in_equal_parts():
    batch = TensorDict({"x": torch.arange(ROWS)}, batch_size=[ROWS])
    parts = split_groups(batch, group_size=GROUP, parts=4)
    assert [p["x"].tolist() for p in parts] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(ConfigurationError, match="3 equal parts"):
        split_groups(batch, group_size=GROUP, parts=3)


def test_metrics_are_means_but_seconds_are_the_slowest_ranks():
    got = combine_metrics([{"loss": 1.0, "score_s": 0.5}, {"loss": 3.0, "score_s": 0.25}])
    assert got == {"loss": 2.0, "score_s": 0.5}
    with pytest.raises(ValueError, match="ranks \\[1\\]"):
        combine_metrics([{"loss": 1.0}, {"kl": 1.0}])


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"trainer_ranks": 0}, "--trainer-ranks 0"),
        ({"trainer_ranks": 3, "prompts_per_step": 8}, "does not divide --prompts 8"),
        ({"trainer_ranks": 2, "lora_rank": 8}, "adapter pushes come from one process"),
    ],
)
def test_config_refusals_name_the_flag(fields, match):
    with pytest.raises(ConfigurationError, match=match):
        check_trainer_ranks(GRPOConfig(**fields))
    check_trainer_ranks(GRPOConfig())  # the default: one process, as before


# ------------------------------------------------------------------ two gloo ranks
class SgdTrainer:
    """GRPOTrainer's interface over a tiny model: an advantage-weighted log-likelihood, SGD."""

    group_size = GROUP

    def __init__(self, model):
        self.model = model
        self.optimizer = torch.optim.SGD(model.parameters(), lr=0.5)

    def set_advantage(self, batch):
        batch.set("advantage", batch["reward"] - batch["reward"].mean())

    def step(self, part):
        self.set_advantage(part)
        logp = self.model(part["ids"]).logits.log_softmax(-1)[:, :-1]
        chosen = logp.gather(-1, part["ids"][:, 1:, None]).squeeze(-1)
        loss = -(chosen.mean(-1) * part["reward"]).mean()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return {"loss": loss.item(), "train_s": 0.0}


def _batch() -> TensorDict:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 15, (ROWS, 6), generator=generator)
    return TensorDict({"ids": ids, "reward": torch.rand(ROWS, generator=generator)}, [ROWS])


def _tiny(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def serve_sgd_steps(rank, world, model_dir):
    model = shard_model(_tiny(model_dir))
    assert serve_steps(SgdTrainer(model), push=lambda: None) == 2


def test_two_ranks_step_as_one_process_on_the_full_batch(tiny_model):
    reference = _tiny(tiny_model)
    single = SgdTrainer(reference)
    for _ in range(2):
        single.step(_batch())
    with TrainerRanks(2, serve_sgd_steps, (str(tiny_model),)) as ranks:
        model = shard_model(_tiny(tiny_model))
        with DataParallelStep(SgdTrainer(model), world=2) as train:
            for _ in range(2):
                batch = _batch()
                metrics = train.step(batch)
        assert set(metrics) == {"loss", "train_s"}
        assert "advantage" in batch.keys()  # the full batch's, for the recorder
        processes = list(ranks.processes)
    assert not dist.is_initialized()
    assert [p.exitcode for p in processes] == [0]
    # Rank 0's shards (FSDP2: the first of two chunks on dim 0) against the same rows of
    # the model trained in one process on the full batches.
    mine = {k: v.to_local() for k, v in model.state_dict().items()}
    expected = {k: v.chunk(2, dim=0)[0] for k, v in reference.state_dict().items()}
    assert mine.keys() == expected.keys()
    for name, value in mine.items():
        torch.testing.assert_close(value, expected[name], atol=1e-6, rtol=1e-5, msg=name)
    assert any(
        not torch.equal(v, _tiny(tiny_model).state_dict()[k].chunk(2)[0]) for k, v in mine.items()
    )


def fail_after_joining(rank, world):
    raise RuntimeError("out of memory on purpose")


def test_a_failed_rank_is_named_with_its_error():
    with pytest.raises(
        TrainerRankError, match=r"(?s)trainer rank 1 .*out of memory on purpose"
    ) as e:
        with TrainerRanks(2, fail_after_joining) as ranks:
            ranks.processes[0].join(60)
    assert e.value.rank == 1
    assert not dist.is_initialized()


def wait_in_a_collective(rank, world):
    dist.barrier()  # rank 0 never comes


def test_an_interrupted_rank_0_ends_the_other_ranks():
    with pytest.raises(KeyboardInterrupt):
        with TrainerRanks(2, wait_in_a_collective) as ranks:
            processes = list(ranks.processes)
            start = time.monotonic()
            raise KeyboardInterrupt
    assert time.monotonic() - start < 15  # terminated, not joined for join_timeout_s
    assert not any(p.is_alive() for p in processes)
    assert not dist.is_initialized()

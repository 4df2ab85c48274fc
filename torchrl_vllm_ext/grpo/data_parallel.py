"""Data-parallel GRPO: the trainer sharded with FSDP2 over ranks (gloo), each rank training
on its own groups of every step's batch, every rank pushing its shards to the replicas.

Rank 0 is the job's process (service, collector, scoring, report); ranks 1..N-1 are
spawned by it (:class:`~.ranks.TrainerRanks`) and run :func:`train_rank`. Each step, every
rank in the same order:

1. rank 0 splits the collected batch into ``N`` equal parts of whole GRPO groups (their
   advantages are those of the full batch) and sends each rank its part, as plain data
   (:mod:`.rank_messages`: JSON and tensor bytes, no pickle);
2. every rank: GRPOLoss on its part, backward (FSDP2 averages the gradients over the
   ranks: the full batch's gradient when each part holds as many tokens), optimizer step;
3. rank 0 collects the ranks' metrics, as JSON (:func:`combine_metrics`);
4. every rank pushes its shards (:class:`~torchrl_vllm_ext.ShardedWeightSync`): rank 0
   through the collector's updater, the others directly.

:data:`STOP` instead of a part tells the ranks to stop (:meth:`DataParallelStep.stop`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from collections.abc import Callable

import torch
from tensordict import TensorDictBase
from torch import nn

from torchrl_vllm_ext.errors import ConfigurationError
from torchrl_vllm_ext.grpo.config import GRPOConfig
from torchrl_vllm_ext.grpo.rank_messages import receive, send_json, send_tensordict
from torchrl_vllm_ext.grpo.ranks import TrainerRanks
from torchrl_vllm_ext.grpo.trainer import GRPOTrainer, restrict_vocabulary
from torchrl_vllm_ext.grpo.trainer_model import build_trainer, load_trainer_model

logger = logging.getLogger(__name__)


def check_trainer_ranks(cfg: GRPOConfig) -> None:
    """Refuse a ``trainer_ranks`` the job cannot split its steps over, before anything starts.

    Examples:
        >>> check_trainer_ranks(GRPOConfig(trainer_ranks=2, prompts_per_step=8))
        >>> check_trainer_ranks(GRPOConfig(trainer_ranks=3, prompts_per_step=8))
        Traceback (most recent call last):
        ...
        torchrl_vllm_ext.errors.ConfigurationError: --trainer-ranks 3 does not divide --prompts 8: ...
    """
    ranks = cfg.trainer_ranks
    if ranks < 1:
        raise ConfigurationError(f"--trainer-ranks {ranks}: pass 1 (one process) or more.")
    if ranks == 1:
        return
    if cfg.prompts_per_step % ranks:
        raise ConfigurationError(
            f"--trainer-ranks {ranks} does not divide --prompts {cfg.prompts_per_step}: each "
            "rank trains on whole GRPO groups, as many as every other rank; pass a number of "
            "prompts that is a multiple of the ranks."
        )
    if cfg.lora_rank:
        raise ConfigurationError(
            f"--trainer-ranks {ranks} with --lora-rank {cfg.lora_rank}: adapter pushes come "
            "from one process; pass --trainer-ranks 1 to train an adapter."
        )


STOP = "stop"
"""What rank 0 sends instead of a batch when the job is done."""


def split_groups(batch: TensorDictBase, group_size: int, parts: int) -> list[TensorDictBase]:
    """``batch`` (rows ``[k*G, (k+1)*G)`` answer prompt ``k``) in ``parts`` equal runs of
    whole groups, copied (each one crosses to its rank alone).

    Examples:
        >>> from tensordict import TensorDict
        >>> batch = TensorDict({"x": torch.arange(8)}, batch_size=[8])
        >>> [p["x"].tolist() for p in split_groups(batch, group_size=2, parts=2)]
        [[0, 1, 2, 3], [4, 5, 6, 7]]
    """
    data = batch.reshape(-1)
    rows = data.shape[0]
    if rows % group_size or (rows // group_size) % parts:
        raise ConfigurationError(
            f"a batch of {rows} rows in groups of {group_size} cannot be split into {parts} "
            "equal parts of whole groups; pass a number of prompts that is a multiple of the "
            "trainer ranks."
        )
    size = rows // parts
    return [data[i * size : (i + 1) * size].clone() for i in range(parts)]


def combine_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """One step's metrics from every rank's: the mean over the ranks (equal parts: the full
    batch's figure), but the slowest rank's seconds (``*_s``: the step waits for it).

    Examples:
        >>> combine_metrics([{"reward": 0.2, "train_s": 1.0}, {"reward": 0.4, "train_s": 3.0}])
        {'reward': 0.30000000000000004, 'train_s': 3.0}
    """
    keys = per_rank[0].keys()
    differ = [r for r, m in enumerate(per_rank) if m.keys() != keys]
    if differ:
        raise ValueError(f"ranks {differ} report other metrics than rank 0 ({sorted(keys)})")
    return {
        k: max(m[k] for m in per_rank)
        if k.endswith("_s")
        else sum(m[k] for m in per_rank) / len(per_rank)
        for k in keys
    }


def shard_model(model: nn.Module) -> nn.Module:
    """FSDP2 over ``model`` on the default process group: each transformer block its own
    unit (the classes transformers never splits, ``_no_split_modules``), then the root."""
    from torch.distributed.fsdp import fully_shard

    blocks = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if type(module).__name__ in blocks:
            fully_shard(module)
    fully_shard(model)
    return model


class DataParallelStep:
    """Rank 0's training step over every trainer rank: ``step(batch)`` as
    :meth:`GRPOTrainer.step`, the parts sent to the ranks and their metrics collected.

    Args:
        trainer: rank 0's :class:`GRPOTrainer`, over its sharded model.
        world: the number of trainer ranks (the default process group's).

    Examples:
        >>> with DataParallelStep(trainer, world=2) as train:  # doctest: +SKIP
        ...     metrics = train.step(batch)  # every rank trains on its half of the groups
    """

    def __init__(self, trainer: GRPOTrainer, world: int):
        self.trainer, self.world = trainer, world
        self.stopped = False

    def step(self, batch: TensorDictBase) -> dict[str, float]:
        self.trainer.set_advantage(batch)  # the full batch's, which the recorder reads
        parts = split_groups(batch, self.trainer.group_size, self.world)
        for rank in range(1, self.world):
            send_tensordict(parts[rank], rank)
        metrics = self.trainer.step(parts[0])
        return combine_metrics([metrics, *(receive(rank) for rank in range(1, self.world))])

    def stop(self) -> None:
        """Tell the other ranks the job is done (they close their sync and exit)."""
        if not self.stopped:
            self.stopped = True
            for rank in range(1, self.world):
                send_json(STOP, rank)

    def __enter__(self) -> DataParallelStep:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # NOTE: after an error the other ranks may be inside another collective: they are
        # not told, TrainerRanks terminates them.
        if exc_type is None:
            self.stop()


def start_trainer_ranks(cfg: GRPOConfig, model_path, token_ids) -> TrainerRanks:
    """Ranks 1..N-1 spawned, each loading ``model_path`` and serving :func:`train_rank`."""
    return TrainerRanks(
        cfg.trainer_ranks, train_rank, (cfg, str(model_path), [int(t) for t in token_ids])
    )


def train_rank(rank: int, world: int, cfg: GRPOConfig, model_path: str, token_ids: list) -> None:
    """A spawned rank's loop: load and shard the model, then train on each part rank 0
    sends and push, until it sends STOP."""
    from torchrl_vllm_ext import ShardedWeightSync

    _log_to(cfg.log_file, rank)
    # NOTE: every rank shares the host with the replicas; one rank's OpenMP team per core
    # share keeps N ranks from oversubscribing it.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    torch.manual_seed(cfg.seed)
    _, tokenizer, model = load_trainer_model(dataclasses.replace(cfg, model=model_path))
    mask = restrict_vocabulary(model, token_ids)
    trainer = build_trainer(cfg, shard_model(model), tokenizer)
    with ShardedWeightSync(None) as sync:

        def push() -> None:
            with mask.lifted():  # as rank 0's: the value check scores the model's forward
                sync.push(model)

        steps = serve_steps(trainer, push)
    logger.info("trainer rank %d done: %d steps, version %s", rank, steps, sync.version)


def serve_steps(trainer, push: Callable[[], object]) -> int:
    """Ranks 1..N-1: train on each part rank 0 sends (:class:`DataParallelStep`), send the
    metrics back, ``push()``; until rank 0 sends :data:`STOP`. Returns the steps served."""
    steps = 0
    while True:
        part = receive(0)
        if not isinstance(part, TensorDictBase):  # rank 0's STOP
            return steps
        send_json(trainer.step(part), 0)
        push()
        steps += 1


def _log_to(log_file, rank: int) -> None:
    """This rank's output (its log records, warnings, a traceback) appended to the job's
    log file, as the replicas' is; the terminal when there is none."""
    if log_file is not None:
        with open(log_file, "a") as log:  # the duplicated descriptors stay open
            os.dup2(log.fileno(), sys.stdout.fileno())
            os.dup2(log.fileno(), sys.stderr.fileno())
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s trainer-rank-{rank} %(name)s %(levelname)s: %(message)s",
        force=True,
    )


__all__ = [
    "DataParallelStep",
    "check_trainer_ranks",
    "combine_metrics",
    "serve_steps",
    "shard_model",
    "split_groups",
    "start_trainer_ranks",
    "train_rank",
]

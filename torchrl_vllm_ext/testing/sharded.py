"""A sharded trainer for tests, benchmarks and examples: the package's tiny model under
FSDP2 on CPU ranks (gloo), perturbed the same way on every rank."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn


def shard(model: nn.Module, mesh=None) -> nn.Module:
    """FSDP2 over ``model``: each decoder layer its own unit, then the root."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


@torch.no_grad()
def perturb(model: nn.Module, seed: int, scale: float = 0.02) -> nn.Module:
    """Add seeded noise to every floating parameter of an unsharded ``model`` (the same
    on every rank, so each rank's shards are blocks of the same full model)."""
    generator = torch.Generator().manual_seed(seed)
    for _, p in sorted(model.named_parameters()):
        if p.is_floating_point():
            p.add_(torch.randn(p.shape, generator=generator, dtype=torch.float32).to(p.dtype) * scale)
    return model


def load(model_dir: str | Path, seed: int | None = None, dtype=torch.float32) -> nn.Module:
    """The model from ``model_dir`` in transformers (eval), perturbed by ``seed`` if given."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    return perturb(model, seed) if seed is not None else model


def init_gloo(rank: int, world: int, port: int) -> None:
    """Join a gloo world of ``world`` ranks on the loopback at ``port``."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)

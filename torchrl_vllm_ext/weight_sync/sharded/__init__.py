"""Pushes from a trainer sharded over many ranks (FSDP2 / DTensor): every rank calls the
push with its shards, none gathers the model (:mod:`.push`)."""

from torchrl_vllm_ext.weight_sync.sharded.push import ShardedWeightSync

__all__ = ["ShardedWeightSync"]

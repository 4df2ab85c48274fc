"""The trainer's model and its :class:`GRPOTrainer`, from a :class:`GRPOConfig`: what rank 0
(:mod:`.run`) and every other trainer rank (:mod:`.data_parallel`) build alike."""

from __future__ import annotations

from pathlib import Path

import torch

from torchrl_vllm_ext.errors import ConfigurationError
from torchrl_vllm_ext.grpo.config import GRPOConfig
from torchrl_vllm_ext.grpo.trainer import GRPOTrainer


def load_trainer_model(cfg: GRPOConfig):
    """(model path, tokenizer, model): the given model, or the package's tiny random Qwen2."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from torchrl_vllm_ext.testing import make_tiny_model

    path = Path(cfg.model) if cfg.model else make_tiny_model(seed=cfg.seed)
    if not (path / "config.json").is_file():
        raise ConfigurationError(
            f"--model {path} is not a Hugging Face model directory (no config.json); "
            "pass a local directory saved with save_pretrained, or omit --model."
        )
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, cfg.dtype))
    vocab = model.get_output_embeddings().weight.shape[0]
    if cfg.high > vocab:
        raise ConfigurationError(
            f"the task uses token ids up to {cfg.high - 1} but {path} has {vocab}; "
            f"pass --high <= {vocab}."
        )
    return path, tokenizer, model


def build_trainer(cfg: GRPOConfig, model, tokenizer) -> GRPOTrainer:
    """The job's :class:`GRPOTrainer` over ``model`` (sharded or not)."""
    return GRPOTrainer(
        model,
        tokenizer,
        group_size=cfg.group_size,
        lr=cfg.lr,
        clip_epsilon=cfg.clip_epsilon,
        entropy_coeff=cfg.entropy_coeff,
        kl_to_ref_coeff=cfg.kl_coef,
        rollout_correction=cfg.rollout_correction,
        is_clip=cfg.is_clip,
        is_clip_low=cfg.is_clip_low,
    )

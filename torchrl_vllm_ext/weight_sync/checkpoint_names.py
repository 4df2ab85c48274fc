"""transformers' in-memory parameter names -> the served checkpoint's (fused MoE experts,
published checkpoints' older names).

transformers 5 keeps some weights under other names and layouts than its checkpoints:
a MoE layer's experts are one stacked tensor per projection
(``mlp.experts.gate_up_proj``, ``[experts, 2 * width, hidden]``) where the checkpoint
holds one tensor per expert and projection (``block_sparse_moe.experts.0.w1.weight``).
``save_pretrained`` reverts this with transformers' conversion mapping; a push does the
same, after checking the fused tensors against a meta-device instance of the served
architecture (no memory, a few ms), so a missing or misshaped one is named as the
trainer knows it. The reverted tensors are views (chunks) of the pushed ones: no copy.

Published checkpoints of older families were saved from the base model: GPT-2's names
have no ``transformer.`` prefix, OPT's no ``model.`` (``decoder.layers.0...``), and
GPT-2's hold each layer's attention-mask buffers (``h.0.attn.bias``), which no module
has any more. transformers and vLLM load both; so does a push: a name that is the
checkpoint's with the base-model prefix is renamed, and checkpoint tensors the
architecture has no parameter for (:attr:`CheckpointNames.stale`) need not be pushed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from torchrl_vllm_ext.errors import WeightSyncError
from torchrl_vllm_ext.weight_sync.specs import TensorSpec

logger = logging.getLogger(__name__)

_TIED_HEAD = "lm_head.weight"


class CheckpointNames:
    """Maps a push keyed by transformers' in-memory names onto the served checkpoint's names.

    Args:
        model_dir: the model directory the replicas serve (its ``config.json``).
        expected: the checkpoint's tensors (:func:`~.params.expected_specs`).

    Examples:
        >>> from torchrl_vllm_ext.testing import make_tiny_model
        >>> from torchrl_vllm_ext.weight_sync.params import expected_specs
        >>> path = make_tiny_model(arch="mixtral")
        >>> names = CheckpointNames(path, expected_specs(path))
        >>> names.in_memory_only["model.layers.0.mlp.experts.gate_up_proj"].shape
        (4, 128, 128)
    """

    def __init__(self, model_dir: str | Path, expected: dict[str, TensorSpec]):
        self.model_dir = Path(model_dir)
        self.expected = expected
        self._meta: nn.Module | None = None
        self._stale: frozenset[str] | None = None

    def needed(self, tensors: dict[str, torch.Tensor]) -> bool:
        """Whether ``tensors`` use names the checkpoint lacks (other than a tied LM head)."""
        return any(n not in self.expected and n != _TIED_HEAD for n in tensors)

    def checkpoint_name(self, name: str) -> str:
        """``name`` as the checkpoint spells it: without the base-model prefix
        (``transformer.``, ``model.``) when the checkpoint was saved from the base model.

        Examples:
            >>> from torchrl_vllm_ext.testing import make_tiny_model
            >>> from torchrl_vllm_ext.weight_sync.params import expected_specs
            >>> path = make_tiny_model(arch="gpt2", layout="hub")
            >>> CheckpointNames(path, expected_specs(path)).checkpoint_name("transformer.wte.weight")
            'wte.weight'
        """
        if name in self.expected:
            return name
        prefix = self._base_prefix
        if prefix and name.startswith(prefix) and name[len(prefix) :] in self.expected:
            return name[len(prefix) :]
        return name

    @property
    def _base_prefix(self) -> str:
        prefix = getattr(self.meta_model, "base_model_prefix", "")
        return f"{prefix}." if prefix else ""

    def stale(self, tensors: dict[str, torch.Tensor]) -> frozenset[str]:
        """Checkpoint tensors that ``tensors`` (checkpoint-named) may leave out: those the
        served architecture has no parameter for (GPT-2's attention-mask buffers), which
        vLLM skips when it loads. Empty when nothing is missing (no meta model built)."""
        if all(name in tensors for name in self.expected):
            return frozenset()
        if self._stale is None:
            try:
                meta = dict(self.meta_model.state_dict())
            except (ValueError, KeyError, OSError) as e:
                # No transformers class for this checkpoint: none of its tensors is known
                # to be unused, so every one is required (validate names the missing).
                logger.debug("no meta model for %s (%s): nothing is stale", self.model_dir, e)
                self._stale = frozenset()
                return self._stale
            covered = set(self.to_checkpoint(meta)) | {self.checkpoint_name(n) for n in meta}
            self._stale = frozenset(n for n in self.expected if n not in covered)
        return self._stale

    @property
    def meta_model(self) -> nn.Module:
        """The served architecture on the meta device (names and shapes, no storage)."""
        if self._meta is None:
            from transformers import AutoConfig, AutoModelForCausalLM

            config = AutoConfig.from_pretrained(self.model_dir)
            with torch.device("meta"):
                self._meta = AutoModelForCausalLM.from_config(config)
        return self._meta

    @property
    def in_memory_only(self) -> dict[str, TensorSpec]:
        """Tensors transformers holds under names its checkpoint does not use (fused experts)."""
        return {
            name: TensorSpec(
                name=name, dtype=str(t.dtype).removeprefix("torch."), shape=tuple(t.shape)
            )
            for name, t in self.meta_model.state_dict().items()
            if self.checkpoint_name(name) not in self.expected and name != _TIED_HEAD
        }

    def to_checkpoint(
        self, tensors: dict[str, torch.Tensor], module: nn.Module | None = None
    ) -> dict[str, torch.Tensor]:
        """``tensors`` under the checkpoint's names; a missing or misshaped fused tensor is a
        :class:`WeightSyncError` naming it (nothing is sent).

        ``module``: the pushed transformers model, whose own conversions (recorded by
        ``from_pretrained``) are reverted when it has them.
        """
        from transformers.core_model_loading import revert_weight_conversion

        fused = self.in_memory_only
        for name, spec in fused.items():
            if name not in tensors:
                raise WeightSyncError(
                    f"parameter {name!r} is missing from the pushed weights; the served "
                    f"{self.meta_model.config.model_type} model keeps it fused in transformers "
                    "(one tensor for every expert): push the full model (model.state_dict())."
                )
            if tuple(tensors[name].shape) != spec.shape:
                raise WeightSyncError(
                    f"parameter {name!r} has shape {tuple(tensors[name].shape)} but the served "
                    f"model expects {spec.shape}; push weights of the same architecture "
                    "(number of experts, widths)."
                )
        owner = module if getattr(module, "_weight_conversions", None) else self.meta_model
        reverted = revert_weight_conversion(owner, dict(tensors))
        return {self.checkpoint_name(name): t for name, t in reverted.items()}

    def checkpoint_writers(self, model: nn.Module) -> dict[str, Callable[[torch.Tensor], None]]:
        """For each checkpoint name, a function that writes that checkpoint tensor into
        ``model`` (a transformers instance of the served architecture), wherever its
        fused parameters keep it.

        Computed once: transformers' conversion is run on tensors of element indices, which
        says where each element of each checkpoint tensor lives in the fused ones.
        """
        state = model.state_dict()
        writers: dict[str, Callable[[torch.Tensor], None]] = {
            self.checkpoint_name(name): t.copy_
            for name, t in state.items()
            if self.checkpoint_name(name) in self.expected
        }
        fused = {
            n: t
            for n, t in state.items()
            if self.checkpoint_name(n) not in self.expected and n != _TIED_HEAD
        }
        if not fused:
            return writers
        offsets, indices, start = {}, {}, 0
        for name, t in fused.items():
            offsets[name] = start
            indices[name] = torch.arange(start, start + t.numel()).view(t.shape)
            start += t.numel()
        owners = sorted(offsets.items(), key=lambda kv: kv[1])
        for ck_name, idx in self.to_checkpoint(indices).items():
            if ck_name in writers or ck_name == _TIED_HEAD:
                continue
            flat_idx = idx.reshape(-1)
            first = int(flat_idx[0])
            owner = next(n for n, off in reversed(owners) if off <= first)
            writers[ck_name] = _scatter_into(state[owner], flat_idx - offsets[owner])
        return writers


def _scatter_into(target: torch.Tensor, positions: torch.Tensor) -> Callable[[torch.Tensor], None]:
    flat = target.view(-1)  # a parameter's own storage: writes land in the model

    def write(t: torch.Tensor) -> None:
        flat.index_copy_(0, positions, t.reshape(-1).to(flat.dtype))

    return write

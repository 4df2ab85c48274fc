"""What a push is given, turned into what it sends: every trainer-side form in one place.

A full push takes an ``nn.Module`` (a transformers model), a state dict, a TensorDict,
TorchRL's ``TransformersWrapper`` (its ``.model``) or a PEFT model (its LoRA merged into
the base weights, computed apart: the training model is not touched). An adapter push
takes a PEFT model, a ``TransformersWrapper`` around one, or ``(state_dict, config)``.
Anything else is a :class:`~torchrl_vllm_ext.errors.WeightSyncError` naming the object.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from torch import nn

from torchrl_vllm_ext.errors import WeightSyncError
from torchrl_vllm_ext.weight_sync.params import named_tensors

_TORCHRL_LLM_WRAPPERS = ("torchrl.modules.llm.policies.common", "LLMWrapperBase")
_LORA_PARTS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")


@dataclass(frozen=True)
class PushSource:
    """The tensors a full push sends (Hugging Face names) and the module that computes
    with them, if any (the value check scores the probe with it)."""

    tensors: dict[str, torch.Tensor]
    module: nn.Module | None
    """A transformers (or PEFT) model whose forward is the served function; None for
    tensors, and for models whose names are not the checkpoint's (a PEFT model)."""
    scorer: nn.Module | None
    """What the value check may run (the PEFT model itself, whose forward is the merged
    model's); None: score the tensors with a reference copy of the served model."""


def _is_torchrl_llm_wrapper(obj) -> bool:
    module = sys.modules.get(_TORCHRL_LLM_WRAPPERS[0])  # loaded if obj can be one
    base = getattr(module, _TORCHRL_LLM_WRAPPERS[1], None)
    return base is not None and isinstance(obj, base)


def _is_peft(obj) -> bool:
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(obj, peft.PeftModel)


def unwrap(obj, purpose: str = "push"):
    """The trainer model inside TorchRL's LLM wrappers (``TransformersWrapper.model``);
    other objects unchanged. A wrapper that holds no trainable model (``vLLMWrapper``,
    whose ``.model`` is an engine) is an error naming it."""
    if not _is_torchrl_llm_wrapper(obj):
        return obj
    inner = getattr(obj, "model", None)
    if not isinstance(inner, nn.Module):
        raise WeightSyncError(
            f"cannot {purpose} a {type(obj).__name__}: its .model is a "
            f"{type(inner).__name__}, not the trainer's weights. Pass the TransformersWrapper "
            "the trainer optimises (or its transformers model)."
        )
    return inner


def full_push_source(weights) -> PushSource:
    """What a full push of ``weights`` sends; see the module docstring."""
    what = type(weights).__name__
    weights = unwrap(weights)
    if _is_peft(weights):
        return PushSource(merged_lora_state(weights), None, weights)
    if isinstance(weights, nn.Module) and not _looks_like_causal_lm(weights):
        raise WeightSyncError(
            f"cannot push a {what}: it is not a transformers model (no config / "
            "state dict with Hugging Face names). Pass the trainer's transformers model, "
            "TorchRL's TransformersWrapper around it, a PEFT model, a state dict or a "
            "TensorDict keyed by Hugging Face names."
        )
    module = weights if isinstance(weights, nn.Module) else None
    return PushSource(named_tensors(weights), module, module)


def _looks_like_causal_lm(module: nn.Module) -> bool:
    # A transformers model has a config; a bare module of tests or users (nn.Linear,
    # a custom nn.Module with HF names) is accepted too unless it is a policy of ours
    # or TorchRL's, which hold no weights to push.
    if hasattr(module, "config"):
        return True
    return not type(module).__module__.startswith(("torchrl.", "torchrl_vllm_ext."))


@torch.no_grad()
def merged_lora_state(peft_model) -> dict[str, torch.Tensor]:
    """The base model's state dict with every active LoRA delta added, under the base
    model's names; the PEFT model is not modified (no ``merge_and_unload``).

    Examples:
        >>> import peft, torch
        >>> base = torch.nn.Sequential(torch.nn.Linear(4, 4))
        >>> lora = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["0"]))
        >>> torch.nn.init.ones_(lora.base_model.model[0].lora_B["default"].weight)
        Parameter containing:...
        >>> merged = merged_lora_state(lora)
        >>> sorted(merged)
        ['0.bias', '0.weight']
        >>> bool((merged["0.weight"] != base[0].base_layer.weight).any())
        True
    """
    from peft.tuners.lora import LoraLayer

    base = peft_model.get_base_model()
    deltas: dict[str, torch.Tensor] = {}
    for name, layer in base.named_modules():
        if not isinstance(layer, LoraLayer) or layer.merged or layer.disable_adapters:
            continue
        for adapter in layer.active_adapters:
            if adapter not in layer.lora_A and adapter not in layer.lora_embedding_A:
                continue
            if layer.use_dora.get(adapter) or getattr(layer, "lora_bias", {}).get(adapter):
                raise WeightSyncError(
                    f"LoRA layer {name!r} uses DoRA or a LoRA bias; a full push merges plain "
                    "LoRA only. Push the merged model (peft's merge_and_unload on a copy) or "
                    "push the adapter with AdapterSync."
                )
            key = f"{name}.weight"
            delta = layer.get_delta_weight(adapter)
            deltas[key] = deltas[key] + delta if key in deltas else delta
    out: dict[str, torch.Tensor] = {}
    saved = ".modules_to_save."
    for key, tensor in base.state_dict().items():
        parts = key.split(".")
        if any(p in _LORA_PARTS for p in parts) or ".original_module." in key:
            continue
        if saved in key:  # modules_to_save: the active adapter's trained copy
            head, tail = key.split(saved, 1)
            adapter, _, rest = tail.partition(".")
            if adapter not in peft_model.active_adapters:
                continue
            key = f"{head}.{rest}"
        key = key.replace(".base_layer.", ".")
        tensor = tensor.detach()
        out[key] = tensor + deltas[key].to(tensor.dtype) if key in deltas else tensor
    return out


def adapter_source(adapter):
    """What an adapter push is given: a PEFT model (inside a ``TransformersWrapper`` or
    not) or a ``(state_dict, config)`` pair; anything else is an error naming it."""
    inner = unwrap(adapter, "push as an adapter")
    if isinstance(inner, tuple) or _is_peft(inner):
        return inner
    raise WeightSyncError(
        f"cannot push a {type(adapter).__name__} as a LoRA adapter: it is not a PEFT model. "
        "Pass the peft.PeftModel being trained (or TorchRL's TransformersWrapper around it), "
        "a (state_dict, LoraConfig) pair, or push the full weights with WeightSyncScheme."
    )


__all__ = ["PushSource", "adapter_source", "full_push_source", "merged_lora_state", "unwrap"]

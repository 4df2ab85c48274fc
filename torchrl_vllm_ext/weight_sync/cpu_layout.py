"""vLLM-CPU weights kept in checkpoint layout, so a weight update is an in-place copy.

vLLM-CPU repacks every unquantized linear weight for oneDNN after loading and drops
the original. A weight update then has to run vLLM's layerwise reload, which
re-materialises and repacks every layer (most of a push on CPU). With the weights kept as plain parameters behind
``torch.nn.functional.linear`` (MKL), the model's own ``load_weights`` copies an
update straight into them, and the tied LM head shares the embedding as on GPU.

The switch happens in the worker process, before the model loads (the worker
extension imports this module); ``ServiceConfig(cpu_packed_weights=True)`` keeps vLLM's
packing (it reaches the worker as ``TORCHRL_VLLM_CPU_PACKED_WEIGHTS=1``).
"""

from __future__ import annotations

import logging
import os

import torch

from torchrl_vllm_ext._compat import (
    module_derives_weights,
    module_has_experts,
    module_is_quantized,
    module_packs_weights,
    replace_cpu_gemm_dispatch,
)
from torchrl_vllm_ext.extensions import PACKED_WEIGHTS_ENV

logger = logging.getLogger(__name__)

_REPLACED: set = set()
"""The dispatch functions this module made (a process replaces vLLM's once)."""


def _plain_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    return torch.nn.functional.linear(x, weight, bias)


def keep_checkpoint_layout() -> bool:
    """Make vLLM-CPU's linear dispatch keep 2-D weights as they load; returns whether it applies.

    Other layers (3-D expert weights, conv weights) keep vLLM's own dispatch.
    """
    if os.environ.get(PACKED_WEIGHTS_ENV, "0") == "1":
        return False

    def make_dispatch(original):
        if original in _REPLACED:  # already replaced in this process
            return original

        def dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
            weight = getattr(layer, "weight", None)
            if weight is None or weight.is_meta or weight.ndim != 2:
                return original(layer, remove_weight)
            layer.cpu_linear = _plain_linear  # also what marks it plain

        _REPLACED.add(dispatch)
        return dispatch

    applied = replace_cpu_gemm_dispatch(make_dispatch)
    if applied:
        logger.debug("vLLM-CPU linear weights stay in checkpoint layout (torch linear)")
    return applied


def loads_in_place(model: torch.nn.Module) -> bool:
    """Whether ``model.load_weights`` alone updates every weight the forward pass reads.

    True on GPU and for CPU models whose every linear kept its checkpoint layout (LoRA
    wrappers included: their base layers hold the weights); False
    when any CPU linear holds a packed copy (then only vLLM's reload re-derives it), the
    model has fused MoE layers (their kernels keep the experts in a layout of their own),
    layers that derive weights after loading (MLA attention) or it is quantized.
    """
    for module in model.modules():
        if isinstance(getattr(module, "base_layer", None), torch.nn.Module):
            # A LoRA wrapper: its GEMM is its base layer's (which it shows as its own
            # attributes), checked as a module of its own.
            continue
        if (
            module_packs_weights(module)
            and getattr(module, "cpu_linear", None) is not _plain_linear
        ):
            return False
        if module_has_experts(module) or module_is_quantized(module):
            return False
        if module_derives_weights(module):
            return False
    return True

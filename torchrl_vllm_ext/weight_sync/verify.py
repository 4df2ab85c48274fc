"""Arrival by value: after a push, every replica scores a fixed probe like the trainer does.

Why log-probs of a probe and not checksums of the served tensors: vLLM serves weights in
layouts of its own (q/k/v and gate/up fused, experts stacked, tensor-parallel shards,
CPU kernels' prepacked copies, quantized formats), and the copy a kernel reads may be
none of the parameters a checksum would see: the MoE reload bug this check was built
for left every parameter right and the prepacked experts stale. The forward pass reads
exactly what is served, whatever the layout, so its log-probs are the one digest that
needs no knowledge of the layout. It costs one short scoring request per replica (run
after the pause, beside other requests) and one forward pass of the trainer's model.

What it cannot see: a load that misses a tensor whose new value is within noise of its
old one (a tiny training step); it sees a stale or garbled tensor once it moves the
probe's log-probs by more than ``tol`` on average.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from torchrl_vllm_ext.errors import WeightSyncError

PROBE_TOKENS = 16
"""Length of the probe sequence (tokens; log-probs of the last 15 are compared)."""
_SEED = 20261124
TOLERANCE = {"float32": 1e-3}
"""Mean |log-prob gap| a replica may show, by served dtype (16-bit dtypes: ``TOLERANCE_16``)."""
TOLERANCE_16 = 5e-2


def probe_ids(model_dir: str | Path, length: int = PROBE_TOKENS) -> list[int]:
    """A fixed pseudo-random token sequence within the served model's vocabulary."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    vocab = int(config.get("vocab_size") or config.get("text_config", {})["vocab_size"])
    generator = torch.Generator().manual_seed(_SEED)
    return torch.randint(0, vocab, (length,), generator=generator).tolist()


def default_tolerance(dtype: str) -> float:
    """The probe's tolerance for weights served in ``dtype``."""
    return TOLERANCE.get(dtype, TOLERANCE_16)


def mean_gap(reference: list[float], got: list[float]) -> float:
    """Mean |reference - got| (NaN when either holds NaN: a failed check)."""
    if len(reference) != len(got):
        return math.nan
    return float(torch.tensor(reference).sub(torch.tensor(got)).abs().mean())


@torch.no_grad()
def model_logprobs(model: nn.Module, ids: list[int]) -> list[float]:
    """Log-probs a transformers causal LM gives ``ids[1:]`` (eval mode for the call)."""
    param = next(model.parameters())
    training = model.training
    model.eval()
    try:
        x = torch.tensor([ids], device=param.device)
        logits = model(input_ids=x).logits[0, :-1].float()
    finally:
        model.train(training)
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, x[0, 1:, None])[:, 0].cpu().tolist()


def plain_causal_lm(weights) -> bool:
    """Whether the pushed object's own forward computes what the engine serves: a module
    with no forward hook anywhere (a hook that masks logits, as the demo's
    ``restrict_vocabulary`` does, changes the function, not the weights). Anything else (a
    hooked model, a state dict) is scored by the :class:`ReferenceModel` with the pushed
    tensors.

    Examples:
        >>> plain_causal_lm({"w": torch.zeros(1)}), plain_causal_lm(nn.Linear(1, 1))
        (False, True)
    """
    if not isinstance(weights, nn.Module) or not callable(getattr(weights, "forward", None)):
        return False
    return not any(m._forward_hooks or m._forward_pre_hooks for m in weights.modules())


def reference_attention(config) -> dict:
    """``from_pretrained`` keywords for a transformers copy that computes what vLLM serves.

    NOTE: transformers' default attention (sdpa) has no soft-capping: for Gemma 2 it
    silently drops ``attn_logit_softcapping``, which vLLM applies (log-probs ~1e-3 apart
    on a tiny model); only the eager implementation caps the scores.

    Examples:
        >>> from types import SimpleNamespace
        >>> reference_attention(SimpleNamespace(attn_logit_softcapping=50.0))
        {'attn_implementation': 'eager'}
        >>> reference_attention(SimpleNamespace())
        {}
    """
    if getattr(config, "attn_logit_softcapping", None):
        return {"attn_implementation": "eager"}
    return {}


class ReferenceModel:
    """The served architecture in transformers, for pushes given as tensors (not a model).

    Loaded once from the served directory (one more copy of the weights in the trainer's
    process); each push copies its tensors, keyed by the checkpoint's names, into it.
    ``checkpoint_writers(model)`` gives, per checkpoint name, the function that writes
    it into the model (for MoE layers, into the fused experts).
    """

    def __init__(self, model_dir: str | Path, checkpoint_writers):
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype="auto", **reference_attention(config)
        ).eval()
        with torch.no_grad():
            self.writers = checkpoint_writers(self.model)

    @torch.no_grad()
    def logprobs(self, tensors: dict[str, torch.Tensor], ids: list[int]) -> list[float]:
        for name, t in tensors.items():
            write = self.writers.get(name)
            if write is None:
                raise WeightSyncError(
                    f"the probe's reference model has no tensor {name!r}; push with "
                    "verify=False, or push the transformers model itself."
                )
            write(t)
        return model_logprobs(self.model, ids)


@dataclass(frozen=True)
class ProbeResult:
    """One replica's probe against the trainer's reference."""

    replica_id: int
    gap: float
    """Mean |replica - trainer| log-prob over the probe."""
    tol: float

    @property
    def ok(self) -> bool:
        return self.gap <= self.tol  # False for NaN

    def error(self, version: str) -> WeightSyncError:
        return WeightSyncError(
            f"replica {self.replica_id} reported weight version {version} loaded, but its "
            f"log-probs for the probe sequence differ from the trainer's by {self.gap:.3g} on "
            f"average (tolerance {self.tol:g}): the pushed tensors did not all reach the "
            "weights it serves. It is restarted at the last verified version; report this "
            "with the model's architecture (vLLM's reload for it may be incomplete)."
        )

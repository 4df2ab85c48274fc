"""Arrival by value: after a push, every replica scores a fixed probe like the trainer does.

Why log-probs of a probe and not checksums of the served tensors: vLLM serves weights in
layouts of its own (q/k/v and gate/up fused, experts stacked, tensor-parallel shards,
CPU kernels' prepacked copies, quantized formats), and the copy a kernel reads may be
none of the parameters a checksum would see: the MoE reload bug this check was built
for left every parameter right and the prepacked experts stale. The forward pass reads
exactly what is served, whatever the layout, so its log-probs are the one digest that
needs no knowledge of the layout. It costs one short scoring request per replica (run
after the pause, beside other requests) and one forward pass of the trainer's model.

The decision, in any served dtype: the trainer scores the probe twice, with the pushed
weights in float32 (the reference the replica is compared with) and cast to the dtype the
replicas serve (their rounding and 16-bit arithmetic). The gap between those two is this
push's own noise scale: a replica passes when its mean gap to the float32 reference is at
most ``NOISE_MARGIN`` times that noise (never less than ``TOLERANCE``, the float32 limit,
which is the whole rule when replicas serve float32). docs/models.md gives, per family
and tensor kind, how far correct and wrong pushes land (``benchmarks/bench_verify.py``).

What it cannot see: a load that misses a tensor whose new value is within noise of its
old one (a tiny training step, a norm weight barely moved); it sees a stale or garbled
tensor once it moves the probe's log-probs by more than the limit on average.
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
TOLERANCE = 1e-3
"""Mean |log-prob gap| a replica may always show (the whole limit for float32 replicas)."""
NOISE_MARGIN = 3.0
"""A 16-bit replica's limit is this many times the push's noise (:class:`Reference`),
chosen from the largest gap / noise of correct pushes over every family, MoE rows the
worst (docs/models.md, ``benchmarks/bench_verify.py``)."""
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def probe_ids(model_dir: str | Path, length: int = PROBE_TOKENS) -> list[int]:
    """A fixed pseudo-random token sequence within the served model's vocabulary."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    vocab = int(config.get("vocab_size") or config.get("text_config", {})["vocab_size"])
    generator = torch.Generator().manual_seed(_SEED)
    return torch.randint(0, vocab, (length,), generator=generator).tolist()


def served_dtype(name: str) -> torch.dtype:
    """The torch dtype of a served dtype's name (``"bfloat16"``, ``"torch.float16"``, ...).

    Examples:
        >>> served_dtype("torch.bfloat16"), served_dtype("float32")
        (torch.bfloat16, torch.float32)
    """
    key = str(name).removeprefix("torch.")
    if key not in DTYPES:
        raise WeightSyncError(
            f"replicas serve weights in {name!r}: the value check knows {sorted(DTYPES)}; "
            "push with verify='never' (or verify_tol= to give the limit yourself)."
        )
    return DTYPES[key]


def mean_gap(reference: list[float], got: list[float]) -> float:
    """Mean |reference - got| (NaN when either holds NaN: a failed check)."""
    if len(reference) != len(got):
        return math.nan
    return float(torch.tensor(reference).sub(torch.tensor(got)).abs().mean())


@torch.no_grad()
def model_logprobs(
    model: nn.Module, ids: list[int], dtype: torch.dtype | None = None
) -> list[float]:
    """Log-probs a transformers causal LM gives ``ids[1:]`` (eval mode for the call).

    ``dtype``: compute with the floating-point parameters cast to it (a transient copy of
    those not already in it; the model itself untouched), e.g. float32 for the exact
    reference of a bfloat16 model, or the served dtype for the replicas' rounding.
    """
    param = next(model.parameters())
    training = model.training
    model.eval()
    try:
        x = torch.tensor([ids], device=param.device)
        params = _cast_params(model, dtype)
        if params:
            out = torch.func.functional_call(model, params, args=(), kwargs={"input_ids": x})
        else:
            out = model(input_ids=x)
        logits = out.logits[0, :-1].float()
    finally:
        model.train(training)
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, x[0, 1:, None])[:, 0].cpu().tolist()


def _cast_params(model: nn.Module, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """The floating-point parameters not in ``dtype``, cast to it (empty: none to cast)."""
    if dtype is None:
        return {}
    named = dict(model.named_parameters())
    if all(p.dtype == dtype or not p.is_floating_point() for p in named.values()):
        return {}
    return {n: p.to(dtype) if p.is_floating_point() else p for n, p in named.items()}


@dataclass(frozen=True)
class Reference:
    """The trainer's side of one push's value check.

    Examples:
        >>> ref = Reference([-1.0, -2.0], noise=0.02, dtype="bfloat16")
        >>> ref.limit, Reference([-1.0], 0.0, "float32").limit
        (0.06, 0.001)
    """

    logprobs: list[float]
    """The probe's log-probs with the pushed weights in float32."""
    noise: float
    """Mean |served-dtype - float32| log-prob over the probe, both computed here (0 when the
    replicas serve float32): how far rounding alone moves the probe for these weights."""
    dtype: str
    """The dtype the replicas serve."""

    @property
    def limit(self) -> float:
        """The largest mean gap a replica may show: ``max(TOLERANCE, NOISE_MARGIN * noise)``."""
        return max(TOLERANCE, NOISE_MARGIN * self.noise)


@dataclass(frozen=True)
class TimedReference:
    """A push's :class:`Reference` and the seconds the trainer took to compute it."""

    reference: Reference
    seconds: float


def reference(model: nn.Module, ids: list[int], dtype: str) -> Reference:
    """Score ``ids`` with ``model`` in float32 and, for 16-bit replicas, in ``dtype``."""
    exact = model_logprobs(model, ids, torch.float32)
    served = served_dtype(dtype)
    if served == torch.float32:
        return Reference(exact, 0.0, "float32")
    rounded = model_logprobs(model, ids, served)
    return Reference(exact, mean_gap(exact, rounded), str(served).removeprefix("torch."))


def collective_reference(model: nn.Module, ids: list[int], dtype: str) -> Reference:
    """:func:`reference` of a sharded model (FSDP2 / DTensor parameters), run by every rank
    at once: its forward is collective, and no rank holds the whole model. The served
    dtype's rounding is scored under autocast (casting sharded parameters for a functional
    call would gather each one whole outside the model's own schedule)."""
    exact = model_logprobs(model, ids)
    served = served_dtype(dtype)
    if served == torch.float32:
        return Reference(exact, 0.0, "float32")
    with torch.autocast(next(model.parameters()).device.type, dtype=served):
        rounded = model_logprobs(model, ids)
    return Reference(exact, mean_gap(exact, rounded), str(served).removeprefix("torch."))


def plain_causal_lm(weights) -> bool:
    """Whether the pushed object's own forward computes what the engine serves: a module
    with no forward hook anywhere (a hook that masks logits, as the demo's
    ``restrict_vocabulary`` does, changes the function, not the weights) and no 16-bit
    floating-point buffer (``model.to(torch.bfloat16)`` rounds the rotary frequencies,
    which ``from_pretrained(dtype=...)`` and vLLM keep in float32: a gap of most of
    float32's limit before any weight is wrong). Anything else (a hooked or cast model, a
    state dict) is scored by the :class:`ReferenceModel` with the pushed tensors.

    Examples:
        >>> plain_causal_lm({"w": torch.zeros(1)}), plain_causal_lm(nn.Linear(1, 1))
        (False, True)
        >>> cast = nn.Linear(1, 1)
        >>> cast.register_buffer("inv_freq", torch.ones(1, dtype=torch.bfloat16))
        >>> plain_causal_lm(cast)
        False
    """
    if not isinstance(weights, nn.Module) or not callable(getattr(weights, "forward", None)):
        return False
    if any(b.is_floating_point() and b.itemsize < 4 for b in weights.buffers()):
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

    Loaded once from the served directory in float32 (one more copy of the weights in the
    trainer's process); each push copies its tensors, keyed by the checkpoint's names,
    into it.
    ``checkpoint_writers(model)`` gives, per checkpoint name, the function that writes
    it into the model (for MoE layers, into the fused experts).
    """

    def __init__(self, model_dir: str | Path, checkpoint_writers):
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, **reference_attention(config)
        ).eval()
        with torch.no_grad():
            self.writers = checkpoint_writers(self.model)

    def logprobs(self, tensors: dict[str, torch.Tensor], ids: list[int]) -> list[float]:
        """The probe's float32 log-probs with ``tensors`` written in."""
        self.write(tensors)
        return model_logprobs(self.model, ids)

    def reference(self, tensors: dict[str, torch.Tensor], ids: list[int], dtype: str) -> Reference:
        """:func:`reference` with ``tensors`` written in."""
        self.write(tensors)
        return reference(self.model, ids, dtype)

    @torch.no_grad()
    def write(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            write = self.writers.get(name)
            if write is None:
                raise WeightSyncError(
                    f"the probe's reference model has no tensor {name!r}; push with "
                    "verify=False, or push the transformers model itself."
                )
            write(t)


@dataclass(frozen=True)
class ProbeResult:
    """One replica's probe against the trainer's reference."""

    replica_id: int
    gap: float
    """Mean |replica - trainer (float32)| log-prob over the probe."""
    tol: float
    """The limit (:attr:`Reference.limit`, or the scheme's ``verify_tol``)."""
    noise: float = 0.0
    """The push's noise (:attr:`Reference.noise`) the limit was derived from."""

    @property
    def ok(self) -> bool:
        return self.gap <= self.tol  # False for NaN

    def error(self, version: str) -> WeightSyncError:
        noise = f", {NOISE_MARGIN:g} x this push's rounding noise {self.noise:.3g}" * (
            self.noise > 0
        )
        return WeightSyncError(
            f"replica {self.replica_id} reported weight version {version} loaded, but its "
            f"log-probs for the probe sequence differ from the trainer's by {self.gap:.3g} on "
            f"average (limit {self.tol:.3g}{noise}): the pushed tensors did not all reach the "
            "weights it serves. It is restarted at the last verified version; report this "
            "with the model's architecture (vLLM's reload for it may be incomplete)."
        )

"""Correctness criteria for 16-bit replicas on a GPU, judged on the same kernels.

bf16 vLLM kernels and bf16 transformers disagree by ~0.13 nats per token on a tiny random
model before any push (H200, 2026-11-27), so "replica within a fixed tolerance of the
trainer" cannot tell wrong weights from kernel noise. What can:

- a **round trip**: push W1, push the original W0 back, and the replica serves bitwise what
  it served before any push (:func:`differing` is empty);
- two transports giving the same bytes serve bitwise the same log-probs;
- a gap to the trainer judged against the gap a **fresh** replica (weights from the
  checkpoint, no push) shows to the trainer at W0 (:func:`gap_bound`): a push that
  delivered the right bytes lands within :data:`FRESH_GAP_FACTOR` of it, one that did not
  lands at the distance between W0 and W1 (:func:`assert_can_tell`).

:class:`Snapshot` keeps the trainer's W0 so that every test perturbs from the same point
(perturbations that accumulate from test to test grow the logits and with them the kernel
gap: 0.18 after one step, 0.49 after three, same GPU).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

FRESH_GAP_FACTOR = 3.0
"""A pushed replica's gap to the trainer may be this many times a fresh replica's gap.
Measured on an H200 (bf16, vLLM 0.26): a fresh replica 0.1325 from the trainer; after
one perturbation step of 0.05 pushed, 0.177 (1.34x)."""

PERTURB_SCALE = 0.05
"""Noise per parameter of the tests' stand-in training step (check-model uses the same)."""


def max_gap(got: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest per-token |got - expected| in float32 (the shapes must agree)."""
    if got.shape != expected.shape:
        raise ValueError(f"shapes differ: {tuple(got.shape)} vs {tuple(expected.shape)}")
    return (got.float() - expected.float()).abs().max().item() if got.numel() else 0.0


def gap_bound(fresh_gap: float, factor: float = FRESH_GAP_FACTOR) -> float:
    """The largest trainer gap a pushed replica may show, given a fresh replica's.

    A fresh gap of 0 (fp32 kernels that agree exactly) still allows float32 rounding."""
    if fresh_gap < 0:
        raise ValueError(f"fresh_gap={fresh_gap} is negative")
    return max(factor * fresh_gap, 1e-5)


def assert_can_tell(signal: float, bound: float) -> None:
    """Fail when the test could not tell a missed push from a delivered one: the trainer's
    own change between W0 and W1 (``signal``) must exceed the allowed gap."""
    if not signal > bound:
        raise AssertionError(
            f"the push changes the trainer's log-probs by {signal:.3g}, not more than the "
            f"allowed gap {bound:.3g}: perturb more, or the criterion cannot see a missed push"
        )


def assert_within(gap: float, fresh_gap: float, what: str, factor: float = FRESH_GAP_FACTOR):
    """``gap`` (a pushed replica to the trainer) within ``factor`` x the fresh replica's."""
    bound = gap_bound(fresh_gap, factor)
    assert gap <= bound, (
        f"{what}: |replica - trainer| = {gap:.4g} > {factor:g} x the fresh replica's "
        f"{fresh_gap:.4g} = {bound:.4g}"
    )


def differing(
    before: Mapping[int, torch.Tensor | tuple], after: Mapping[int, torch.Tensor | tuple]
) -> list[int]:
    """Replicas whose served values differ, bitwise, between two readings (a replica in
    one reading only counts as differing). Values are tensors or tuples of tensors / ints."""
    return sorted(r for r in set(before) | set(after) if not _same(before.get(r), after.get(r)))


def _same(a, b) -> bool:
    if a is None or b is None:
        return False
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and torch.equal(a, b)
        )
    if isinstance(a, tuple | list) and isinstance(b, tuple | list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


class Snapshot:
    """A model's parameters at one point (W0), to restore or to perturb from."""

    def __init__(self, model: torch.nn.Module):
        self._params = {k: p.detach().clone() for k, p in model.named_parameters()}

    def restore(self, model: torch.nn.Module) -> torch.nn.Module:
        """Put W0 back in place (same parameter tensors: a colocated push shares them)."""
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(self._params[name])
        return model

    def perturbed(
        self, model: torch.nn.Module, seed: int, scale: float = PERTURB_SCALE
    ) -> torch.nn.Module:
        """W0 plus seeded noise, in place: the same W1 for the same seed whatever ran before."""
        self.restore(model)
        with torch.no_grad():
            for p in model.parameters():
                g = torch.Generator(device=p.device).manual_seed(seed)
                p.add_(torch.randn(p.shape, generator=g, device=p.device, dtype=p.dtype) * scale)
                seed += 1
        return model

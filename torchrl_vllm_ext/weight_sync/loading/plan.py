"""The load plan: where a model's own loader put each pushed tensor (traced once per layout
by :mod:`.recorder`), bound to the served tensors and replayed as one batched copy.

A plan is a list of :class:`Copy` (a pushed tensor's view -> a view of one of the model's
parameters or buffers, each a :class:`View` relative to its base), the tensors the loader
keeps (tainted: :attr:`LoadPlan.loader` says why), and the fingerprint (pointer, shape,
stride, dtype) of every destination as the trace left it. :meth:`LoadPlan.bind` checks the
fingerprints and returns a :class:`BoundPlan`; :meth:`BoundPlan.apply` is one
``torch._foreach_copy_`` into the served tensors, in place (CUDA graphs keep their
addresses). :func:`content_sums` is the backstop's position-sensitive checksum.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

Fingerprint = tuple
"""``(data pointer, shape, stride, dtype, device)`` of a tensor of the model's state."""

Layout = tuple
"""``((name, shape, stride, dtype, device type), ...)`` of a push, in order: what a plan is for."""


def layout_of(named: Iterable[tuple[str, torch.Tensor]]) -> Layout:
    """The layout key of a push: names, shapes, strides, dtypes and device types, in order.

    Examples:
        >>> layout_of([("w", torch.zeros(2, 3))])
        (('w', (2, 3), (3, 1), torch.float32, 'cpu'),)
    """
    return tuple((n, tuple(t.shape), t.stride(), t.dtype, t.device.type) for n, t in named)


def fingerprint(t: torch.Tensor) -> Fingerprint:
    """Where a tensor of the model's state lives and how it is laid out."""
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device)


@dataclass(frozen=True)
class View:
    """A strided view, relative to a base tensor: ``base.as_strided(size, stride,
    base.storage_offset() + offset)``.

    Examples:
        >>> base = torch.arange(12.0).view(3, 4)
        >>> view = View.of(base[1:, 2:], base)
        >>> view
        View(offset=6, size=(2, 2), stride=(4, 1))
        >>> view.on(base).tolist()
        [[6.0, 7.0], [10.0, 11.0]]
    """

    offset: int
    """Elements past the base's first element."""
    size: tuple[int, ...]
    stride: tuple[int, ...]

    @classmethod
    def of(cls, t: torch.Tensor, base: torch.Tensor) -> View:
        delta = t.data_ptr() - base.data_ptr()
        return cls(delta // t.element_size(), tuple(t.shape), tuple(t.stride()))

    def on(self, base: torch.Tensor) -> torch.Tensor:
        return base.as_strided(self.size, self.stride, base.storage_offset() + self.offset)

    def span(self) -> int:
        """Elements from the first to one past the last this view touches (0 if empty)."""
        if any(s == 0 for s in self.size):
            return 0
        return 1 + sum((s - 1) * st for s, st in zip(self.size, self.stride, strict=True))

    @property
    def numel(self) -> int:
        n = 1
        for s in self.size:
            n *= s
        return n


@dataclass(frozen=True)
class Copy:
    """One planned copy: ``state[target]``'s view ``dst`` <- pushed ``source``'s view ``src``."""

    source: str
    src: View
    target: str
    dst: View


@dataclass
class LoadPlan:
    """What the loader does with one layout (see the module docstring).

    Examples:
        >>> class Fused(torch.nn.Module):  # q and k land in one fused parameter
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.qk = torch.nn.Parameter(torch.zeros(4, 2), requires_grad=False)
        ...     def load_weights(self, weights):
        ...         for name, w in weights:
        ...             rows = slice(0, 2) if name == "q" else slice(2, 4)
        ...             self.qk.data[rows].copy_(w)
        >>> model = Fused()
        >>> pushed = [("q", torch.ones(2, 2)), ("k", torch.full((2, 2), 2.0))]
        >>> from torchrl_vllm_ext.weight_sync.loading.recorder import trace
        >>> plan = trace(model.load_weights, pushed, dict(model.named_parameters()))
        >>> [(c.source, c.target, c.dst.offset) for c in plan.copies], plan.loader
        ([('q', 'qk', 0), ('k', 'qk', 4)], {})
        >>> bound = plan.bind(dict(model.named_parameters()))
        >>> bound.apply({"q": torch.zeros(2, 2), "k": torch.ones(2, 2)})  # a later push
        >>> model.qk.sum().item()
        4.0
    """

    layout: Layout
    copies: tuple[Copy, ...]
    loader: dict[str, str] = field(default_factory=dict)
    """Pushed tensors the loader keeps: name -> why."""
    skipped: tuple[str, ...] = ()
    """Pushed tensors the loader wrote nothing of (names the model keeps no tensor for)."""
    targets: dict[str, Fingerprint] = field(default_factory=dict)
    """The state tensors the copies write, as the trace left them."""
    nbytes: dict[str, int] = field(default_factory=dict)
    """Bytes of each pushed tensor."""

    @property
    def replayed_bytes(self) -> int:
        """Bytes of the pushed tensors the replay copies (the loader keeps the rest)."""
        copied = {c.source for c in self.copies}
        return sum(n for name, n in self.nbytes.items() if name in copied)

    @property
    def loader_bytes(self) -> int:
        return sum(self.nbytes.get(name, 0) for name in self.loader)

    def bind(self, state: Mapping[str, torch.Tensor]) -> BoundPlan | None:
        """The destinations on ``state`` (the model's parameters and buffers by name), or
        None when a target is gone or its fingerprint changed (trace again)."""
        for name, fp in self.targets.items():
            t = state.get(name)
            if t is None or fingerprint(t) != fp:
                return None
        tensors = {name: state[name].detach() for name in self.targets}
        dsts = [c.dst.on(tensors[c.target]) for c in self.copies]
        return BoundPlan(self, tensors, dsts)


@dataclass
class BoundPlan:
    """A plan bound to the model's tensors: apply it to each push of the layout."""

    plan: LoadPlan
    tensors: dict[str, torch.Tensor]
    dsts: list[torch.Tensor]
    scatter_map: object | None = None
    """What :mod:`.scatter` derived from this plan (built at the first delta it loads)."""

    def valid(self, state: Mapping[str, torch.Tensor]) -> bool:
        """Whether every target of the model's live ``state`` still has the fingerprint
        the trace saw (a parameter rebound or replaced since fails it)."""
        for name, fp in self.plan.targets.items():
            t = state.get(name)
            if t is None or fingerprint(t) != fp:
                return False
        return True

    def apply(self, named: Mapping[str, torch.Tensor], non_blocking: bool = False) -> None:
        """Copy every planned view of ``named`` (this push's buffers) into place: one
        ``torch._foreach_copy_``. The loader's own tensors are the caller's to load."""
        if not self.dsts:
            return
        srcs = [c.src.on(named[c.source]) for c in self.plan.copies]
        torch._foreach_copy_(self.dsts, srcs, non_blocking=non_blocking)


_SUM_CHUNK = 1 << 22
"""Words summed at a time by :func:`content_sums` (its scratch: 3 x 32 MB of int64)."""


def content_sums(tensors: Sequence[torch.Tensor]) -> list[int]:
    """A position-sensitive sum of each tensor's bytes (two rows swapped change it), computed
    where each tensor lives, read back with one host sync per device: the trace push's
    comparison of the replay with the loader.

    Examples:
        >>> a = torch.tensor([1.0, 2.0]); b = torch.tensor([2.0, 1.0])
        >>> content_sums([a])[0] != content_sums([b])[0]
        True
    """
    sums = []
    for t in tensors:
        raw = t.detach().contiguous().view(-1).view(torch.uint8)
        words = raw.view(torch.int32) if raw.numel() % 4 == 0 else raw
        total = torch.zeros((), dtype=torch.int64, device=raw.device)
        for start in range(0, words.numel(), _SUM_CHUNK):  # bounded scratch memory
            chunk = words[start : start + _SUM_CHUNK].to(torch.int64)
            weights = torch.arange(
                start + 1, start + 1 + chunk.numel(), device=raw.device, dtype=torch.int64
            )
            total += (chunk * (weights * 2654435761 + 1)).sum()
        sums.append(total)
    if not sums:
        return []
    by_device: dict[torch.device, list[int]] = {}
    for i, s in enumerate(sums):
        by_device.setdefault(s.device, []).append(i)
    out = [0] * len(sums)
    for indices in by_device.values():
        for i, v in zip(indices, torch.stack([sums[i] for i in indices]).tolist(), strict=True):
            out[i] = int(v)
    return out

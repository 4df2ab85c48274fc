"""The load plan's recorder: where a model's own loader puts each pushed tensor, traced once
(the plan it makes is replayed as one batched copy: :mod:`.plan`).

vLLM's ``model.load_weights`` maps checkpoint names onto fused and sharded parameters with a
Python weight loader per tensor (narrow the incoming tensor to this rank's shard, narrow the
fused parameter to its slice, ``copy_``): Python work per tensor that made most of a push's
pause on a GPU (``benchmarks/README.md``).
What it does depends on the names, shapes and dtypes pushed (the *layout*), not on the
values, so :func:`trace` runs it once under a recorder (a ``TorchFunctionMode``) that notes,
for every ``copy_`` or basic-index ``__setitem__`` into the model's parameters and buffers
(its *state*), the destination view and the source view relative to the pushed tensor it
reads. Tensors are told apart by storage and byte range, not by Python object
(``param.data`` is a new object at each call). Later pushes of the layout rebind the plan to
their own buffers (storage slots A/B, broadcast receive buffers and CUDA IPC buckets differ
from push to push) and apply it as one ``torch._foreach_copy_`` into the served tensors, in
place (CUDA graphs keep their addresses): :meth:`BoundPlan.apply`.

What keeps the loader (the tensor is *tainted*; :attr:`LoadPlan.loader` says why):

- anything that derives a new tensor or a value from it: a cast or a ``.contiguous()`` that
  copies, ``torch.cat``, math, ``.item()`` and value-dependent branches;
- a copy of it into something that is not the model's state (a scratch buffer), a write into
  it, a copy whose view spans several pushed tensors or reinterprets its dtype;
- a destination the loader also computes (in-place math on a parameter, ``set_``, a write
  from another loaded parameter), reads back after writing (math on the parameter), or
  rebinds (``param.data = ...``: the parameter's fingerprint changed during the trace);
- a destination that overlaps another planned one, or that a later write of the loader (a
  constant, or a tensor kept by the loader) overlaps.

Constant writes (the zeroed vocab padding of ``VocabParallelEmbedding``) happen once, at the
trace, and are not repeated. Backstops: every planned destination's tensor is fingerprinted
(pointer, shape, stride, dtype) at the trace and checked before each replay
(:meth:`LoadPlan.bind`), and the trace push compares each destination's :func:`content_sums`
after a replay with what the loader wrote (:mod:`.planned`). Plain torch, no vLLM:
``tests/unit/test_load_plan.py`` drives it with loaders written like vLLM's.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

from torchrl_vllm_ext.weight_sync.loading.plan import (
    Copy,
    Layout,
    LoadPlan,
    View,
    fingerprint,
    layout_of,
)

# Calls whose non-tensor result says nothing of the values (shapes, strides, pointers).
_METADATA = frozenset(
    {
        "__get__",  # properties: shape, dtype, device, ndim, data, ...
        "__len__",
        "__hash__",
        "size",
        "dim",
        "ndimension",
        "numel",
        "nelement",
        "stride",
        "storage_offset",
        "data_ptr",
        "element_size",
        "is_contiguous",
        "is_floating_point",
        "is_complex",
        "is_signed",
        "is_pinned",
        "is_shared",
        "get_device",
        "untyped_storage",
        "_typed_storage",
        "storage",
        "has_names",
        "type",
    }
)
# In-place calls that change no value.
_INPLACE_METADATA = frozenset({"requires_grad_", "share_memory_", "retain_grad", "pin_memory_"})
# In-place calls that write a constant when none of their arguments is tracked.
_CONSTANT_WRITES = frozenset({"fill_", "zero_"})
_INPLACE_DUNDERS = frozenset(
    {"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__"}
    | {"__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__"}
)


def trace(
    load: Callable[[Iterable[tuple[str, torch.Tensor]]], object],
    named: Sequence[tuple[str, torch.Tensor]],
    state: Mapping[str, torch.Tensor],
) -> LoadPlan:
    """Run ``load(iter(named))`` (the model's own loader: it loads this push) under the
    recorder and return the plan of ``named``'s layout over ``state`` (the model's
    parameters and buffers by name, as the loader writes them)."""
    named = list(named)
    before = {name: fingerprint(t) for name, t in state.items()}
    recorder = _Recorder(dict(named), state)

    def consumed():
        for name, t in named:
            recorder.current = name
            yield name, t

    with recorder:
        load(consumed())
    rebound = {name for name, t in state.items() if fingerprint(t) != before[name]}
    return recorder.plan(layout_of(named), rebound)


@dataclass
class _Write:
    """A write into the model's state seen during a trace (in order)."""

    kind: str  # "copy" (a pushed tensor's view), "constant" or "computed"
    target: str
    storage: int
    lo: int  # absolute bytes, [lo, hi)
    hi: int
    view: torch.Tensor | None  # the destination (None: the whole target)
    source: str | None  # copy: the pushed tensor; else the tensor being consumed
    copy: Copy | None = None


class _Index:
    """Tensors by storage and byte range: which named tensor(s) a view falls in."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self._by_storage: dict[int, list[tuple[int, int, str]]] = {}
        self.tensors = dict(tensors)
        for name, t in tensors.items():
            if t.is_meta or t.numel() == 0:
                continue
            lo, hi = _bytes(t)
            self._by_storage.setdefault(_storage(t), []).append((lo, hi, name))
        for ranges in self._by_storage.values():
            ranges.sort()
        self._starts = {k: [r[0] for r in v] for k, v in self._by_storage.items()}

    def names(self, t: torch.Tensor) -> list[str]:
        """The named tensors whose bytes ``t`` touches."""
        if not isinstance(t, torch.Tensor) or t.is_meta or t.numel() == 0:
            return []
        ranges = self._by_storage.get(_storage(t))
        if ranges is None:
            return []
        lo, hi = _bytes(t)
        found = []
        i = max(0, bisect.bisect_right(self._starts[_storage(t)], lo) - 1)
        for start, end, name in ranges[i:]:
            if start >= hi:
                break
            if end > lo:
                found.append(name)
        return found

    def within(self, t: torch.Tensor, name: str) -> bool:
        """Whether every byte ``t`` touches lies inside the named tensor."""
        lo, hi = _bytes(t)
        base_lo, base_hi = _bytes(self.tensors[name])
        return base_lo <= lo and hi <= base_hi


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _bytes(t: torch.Tensor) -> tuple[int, int]:
    """Absolute byte range ``t`` touches (strides are never negative in torch)."""
    span = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True))
    lo = t.data_ptr()
    return lo, lo + span * t.element_size()


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in _tensors(item)]
    if isinstance(obj, dict):
        return [t for item in obj.values() for t in _tensors(item)]
    return []


class _Recorder(TorchFunctionMode):
    """Notes the loader's writes into ``state`` and taints what it computes (module docstring).

    Runs with itself popped inside :meth:`__torch_function__` (torch's rule for modes), so
    its own tensor calls are not recorded.
    """

    def __init__(self, incoming: dict[str, torch.Tensor], state: Mapping[str, torch.Tensor]):
        super().__init__()
        self.incoming = _Index(incoming)
        self.state = _Index({n: t for n, t in state.items() if isinstance(t, torch.Tensor)})
        self.writes: list[_Write] = []
        self.tainted: dict[str, str] = {}
        self.computed: dict[str, str] = {}  # state tensors the loader computes -> how
        self.written_from: dict[str, set[str]] = {}  # state name -> pushed tensors copied in
        self.touched: set[str] = set()
        self.current: str | None = None

    # ------------------------------------------------------------------ the hook
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "copy_" and len(args) >= 2:
            self._copy(args[0], args[1])
        elif name == "__setitem__" and len(args) == 3:
            self._setitem(*args)
        elif name == "__set__" and len(args) == 2:
            self._rebind(*args)
        else:
            self._before(name, args, kwargs)
        out = func(*args, **kwargs)
        if name not in ("copy_", "__setitem__", "__set__"):
            self._after(name, args, kwargs, out)
        return out

    # ------------------------------------------------------------------ rules
    def _taint(self, sources: Iterable[str], why: str) -> None:
        for s in sources:
            self.tainted.setdefault(s, why)
            self.touched.add(s)

    def _compute(self, targets: Iterable[str], why: str) -> None:
        for t in targets:
            self.computed.setdefault(t, why)

    def _read_back(self, targets: Iterable[str], what: str) -> None:
        """A state tensor already written from pushed tensors is read by a computation."""
        for t in targets:
            writers = self.written_from.get(t)
            if writers:
                self._taint(writers, f"the loader reads {t} back after writing it ({what})")

    def _inplace(self, name: str, kwargs: dict) -> bool:
        if "out" in kwargs and kwargs["out"] is not None:
            return True
        if name in _INPLACE_DUNDERS:
            return True
        return (
            name.endswith("_")
            and not name.startswith("_")
            and name not in _INPLACE_METADATA
            and name != "copy_"
        )

    def _before(self, name: str, args: tuple, kwargs: dict) -> None:
        """In-place calls: judged before they run (the destination is an argument)."""
        if not self._inplace(name, kwargs):
            return
        out = kwargs.get("out")
        dests = _tensors(out) if out is not None else _tensors(args[:1])
        others = [
            t
            for t in _tensors(args) + _tensors({k: v for k, v in kwargs.items() if k != "out"})
            if not any(t is d for d in dests)
        ]
        sources = {s for t in others for s in self.incoming.names(t)}
        read = {s for t in others for s in self.state.names(t)}
        for d in dests:
            into_pushed = self.incoming.names(d)
            if into_pushed:
                self._taint(into_pushed, f"the loader writes into it ({name})")
            targets = self.state.names(d)
            if not targets:
                if sources:
                    self._taint(sources, f"{name} into a tensor that is not the model's")
                continue
            self._read_back(read, name)
            if name in _CONSTANT_WRITES and not sources and not read:
                if d.numel():
                    self._record(d, targets, "constant", None)
            else:
                self._taint(sources, f"{name} computes {targets[0]} from it")
                self._read_back(targets, name)  # math on the parameter reads it too
                self._compute(targets, f"{name} on {targets[0]}")

    def _after(self, name: str, args: tuple, kwargs: dict, out) -> None:
        if self._inplace(name, kwargs):
            return
        ins = _tensors(args) + _tensors(kwargs)
        sources = {s for t in ins for s in self.incoming.names(t)}
        read = {s for t in ins for s in self.state.names(t)}
        if not sources and not read:
            return
        self.touched |= sources
        outs = _tensors(out)
        in_storages = {_storage(t) for t in ins if not t.is_meta}
        new = [o for o in outs if o.is_meta or _storage(o) not in in_storages]
        value = out is not None and not outs and name not in _METADATA
        if new or value:
            what = "reads its values" if value else "computes a new tensor from it"
            self._taint(sources, f"{name} {what}")
            self._read_back(read, name)

    def _copy(self, dst, src) -> None:
        if not isinstance(dst, torch.Tensor) or dst.numel() == 0:
            return
        targets = self.state.names(dst)
        into_pushed = self.incoming.names(dst)
        sources = self.incoming.names(src) if isinstance(src, torch.Tensor) else []
        read = self.state.names(src) if isinstance(src, torch.Tensor) else []
        self.touched |= set(sources)
        if into_pushed:
            self._taint(into_pushed + sources, "the loader writes into it (copy_)")
            return
        if not targets:
            if sources:
                self._taint(sources, "copied into a tensor that is not the model's")
            return
        if len(targets) > 1:
            self._taint(sources, f"copied into a view spanning {targets}")
            self._compute(targets, "a copy spanning several tensors")
            return
        target = targets[0]
        base = self.state.tensors[target]
        if dst.dtype != base.dtype or (dst.data_ptr() - base.data_ptr()) % dst.element_size():
            self._taint(sources, f"copied into a reinterpreted view of {target}")
            self._compute(targets, "a reinterpreting copy")
            return
        if not sources:
            writers = {w for r in read for w in self.written_from.get(r, ())}
            if writers:
                self._taint(writers, f"copied from a loaded tensor into {target}")
                self._compute(targets, "a copy from a loaded tensor")
            else:
                self._record(dst, targets, "constant", None)
            return
        source = sources[0]
        pushed = self.incoming.tensors[source]
        if (
            len(sources) > 1
            or not self.incoming.within(src, source)
            or src.dtype != pushed.dtype
            or (src.data_ptr() - pushed.data_ptr()) % src.element_size()
        ):
            self._taint(sources, "copied through a view spanning or reinterpreting it")
            self._compute(targets, "a copy through a spanning view")
            return
        try:
            src_view = src.expand(dst.shape)
        except RuntimeError:  # the copy itself will fail and the loader raise
            self._taint(sources, "copied with shapes that do not broadcast")
            return
        copy = Copy(source, View.of(src_view, pushed), target, View.of(dst, base))
        self.written_from.setdefault(target, set()).add(source)
        self._record(dst, targets, "copy", copy)

    def _setitem(self, base, index, value) -> None:
        if not isinstance(base, torch.Tensor):
            return
        targets = self.state.names(base)
        sources = self.incoming.names(value) if isinstance(value, torch.Tensor) else []
        if self.incoming.names(base):
            self._taint(self.incoming.names(base) + sources, "the loader writes into it")
            return
        if not targets:
            if sources:
                self._taint(sources, "copied into a tensor that is not the model's")
            return
        try:
            dst = base[index]
        except Exception:  # the write itself will fail and the loader raise
            self._taint(sources, "written with an index that fails")
            return
        if isinstance(dst, torch.Tensor) and _storage(dst) == _storage(base):
            self._copy(dst, value)  # a basic index: a view, as copy_ into it
        else:  # an advanced index: torch writes through an index, not a view
            self._taint(sources, f"written into {targets[0]} through an advanced index")
            self._compute(targets, "an advanced-index write")

    def _rebind(self, obj, value) -> None:
        """A property set (``param.data = ...``): the tensor gets new storage."""
        if not isinstance(obj, torch.Tensor):
            return
        targets = self.state.names(obj)
        sources = self.incoming.names(value) if isinstance(value, torch.Tensor) else []
        if targets:
            self._taint(sources, f"the loader rebinds {targets[0]} to it (param.data = ...)")
            self._compute(targets, "rebound (.data = ...) by the loader")
        elif sources:
            self._taint(sources, "set as another tensor's data")

    def _record(self, dst: torch.Tensor, targets: list[str], kind: str, copy: Copy | None):
        lo, hi = _bytes(dst)
        self.writes.append(
            _Write(
                kind,
                targets[0],
                _storage(dst),
                lo,
                hi,
                dst,
                copy.source if copy else self.current,
                copy,
            )
        )

    # ------------------------------------------------------------------ the plan
    def plan(self, layout: Layout, rebound: set[str]) -> LoadPlan:
        tainted = dict(self.tainted)
        for w in self.writes:
            if w.kind != "copy":
                continue
            if w.target in rebound:
                tainted.setdefault(w.source, f"the loader rebinds {w.target} (param.data = ...)")
            elif w.target in self.computed:
                why = self.computed[w.target]
                tainted.setdefault(w.source, f"the loader computes {w.target} ({why})")
        while True:  # until no planned copy is overlapped by another write
            planned = [w for w in self.writes if w.kind == "copy" and w.source not in tainted]
            newly = _overlapped(self.writes, planned, tainted)
            if not newly:
                break
            for source, why in newly.items():
                tainted.setdefault(source, why)
        planned = [w for w in self.writes if w.kind == "copy" and w.source not in tainted]
        copies = tuple(w.copy for w in planned)
        copied = {c.source for c in copies}
        names = [entry[0] for entry in layout]
        skipped = tuple(n for n in names if n not in copied and n not in tainted)
        nbytes = {n: t.numel() * t.element_size() for n, t in self.incoming.tensors.items()}
        targets = {c.target: fingerprint(self.state.tensors[c.target]) for c in copies}
        return LoadPlan(layout, copies, tainted, skipped, targets, nbytes)


def _overlapped(writes: list[_Write], planned: list[_Write], tainted: dict) -> dict[str, str]:
    """Sources of planned copies that another write overlaps where a replay would differ
    from the loader: another planned copy (in any order: one batched copy has none), a
    constant written after it, or any write made while the loader consumed a tensor it
    keeps (it runs again after the replay). A constant written before the copy is
    overwritten at the trace as at a replay. Which tensor the loader was consuming is the
    last one it took from the iterator (a loader that reads ahead shifts it by one): the
    trace push's comparison backs this up."""
    out: dict[str, str] = {}
    order = {id(w): i for i, w in enumerate(writes)}
    for p in planned:
        for w in writes:
            if w is p or w.storage != p.storage or w.hi <= p.lo or p.hi <= w.lo:
                continue
            if w.kind == "copy" and w.source not in tainted:
                why = f"its destination in {p.target} overlaps {w.source}'s"
            elif w.kind == "copy" or w.source in tainted:
                why = f"the loader, kept for {w.source}, writes over its destination in {p.target}"
            elif order[id(w)] < order[id(p)]:
                continue
            else:
                why = f"a constant is written over its destination in {p.target} after it"
            if _views_overlap(p.view, w.view):
                out.setdefault(p.source, why)
    return out


def _views_overlap(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Whether two views of one storage share an element (exact; called only when their
    byte ranges overlap)."""
    if a is None or b is None or a.element_size() != b.element_size():
        return True
    item = a.element_size()
    lo = min(a.data_ptr(), b.data_ptr())
    hi = max(_bytes(a)[1], _bytes(b)[1])
    mask = torch.zeros((hi - lo) // item, dtype=torch.bool)
    mask.as_strided(a.shape, a.stride(), (a.data_ptr() - lo) // item).fill_(True)
    return bool(mask.as_strided(b.shape, b.stride(), (b.data_ptr() - lo) // item).any())

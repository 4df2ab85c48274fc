"""A worker's in-place loads through its load plans: trace the model's own loader on the
first push of a layout (:mod:`.recorder`), replay the plan on every later one (:mod:`.plan`).

:meth:`PlannedLoader.load` is what :meth:`.loads.Loads.load` runs on the
in-place path (dense models on GPU, and on CPU with checkpoint layout):

1. a layout seen before whose plan still binds (every target's fingerprint unchanged):
   **replay**, one ``torch._foreach_copy_`` of the planned views, then the model's loader for
   the tensors the plan leaves to it (none, for the dense families);
2. otherwise **trace**: the loader loads this push under the recorder; then the backstop:
   each target's :func:`~.plan.content_sums` as the loader left it, a replay of the
   plan (and the loader for the tensors it keeps), the sums again. Equal: the plan is kept.
   Different: the loader loads the push once more (the parameters are as a normal load
   leaves them) and the layout keeps the loader from then on, with a warning naming the
   tensors.

``TORCHRL_VLLM_LOAD_PLAN=0`` in a replica's environment (or :attr:`PlannedLoader.enabled`
set False at run time: the testing worker extension's ``use_load_plan``) loads every push with the
loader, as before plans existed. Each load returns a :class:`LoadReport` (plain data: it
reaches ``SyncReport.loads``).
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace

import torch

from torchrl_vllm_ext.extensions import LOAD_PLAN_ENV
from torchrl_vllm_ext.weight_sync.loading.plan import (
    BoundPlan,
    LoadPlan,
    content_sums,
    layout_of,
)
from torchrl_vllm_ext.weight_sync.loading.recorder import trace
from torchrl_vllm_ext.weight_sync.loading.scatter import Changes, scatter
from torchrl_vllm_ext.weight_sync.loading.slices import (
    SliceReads,
    TensorSlice,
    kept_bytes,
    plan_slices,
    slice_reads,
)

logger = logging.getLogger(__name__)


Loader = Callable[[Iterable[tuple[str, torch.Tensor]]], object]


@dataclass(frozen=True)
class LoadReport:
    """How one worker loaded one push (plain data)."""

    path: str
    """``replay`` (the plan), ``scatter`` (a delta's changed elements through the plan),
    ``trace`` (the loader, recording the plan), ``loader`` (the
    model's loader: plans off, or refused for this layout) or ``layerwise`` (vLLM's reload:
    MoE, quantized, CPU-packed models)."""
    nbytes: int
    """Bytes of the pushed tensors."""
    replayed_bytes: int = 0
    """Of those, the bytes the plan copied (``replay``; ``scatter``: the bytes written)."""
    why: str | None = None
    """Why the loader loaded (``loader``, ``layerwise``) or what it keeps (``replay``)."""
    kept_bytes: int | None = None
    """Of ``nbytes``, the bytes this worker keeps: its slices of the pushed tensors, read
    off its load plan (:mod:`.slices`; a tensor-parallel rank keeps its shards); None where
    no plan says (the loader's loads)."""
    received_bytes: int | None = None
    """Of ``nbytes``, the bytes this worker read (a storage worker reads only its slices of
    the tensors its plan slices: :func:`~.slices.slice_reads`); None: every byte (the
    transport hands each worker every tensor whole)."""
    sliced_received_bytes: int | None = None
    """Of ``received_bytes``, the tensors read as slices (their views)."""
    sliced_kept_bytes: int | None = None
    """Of ``kept_bytes``, those same tensors' (the ratio is 1.0 when no two copies of the
    plan read one element)."""
    whole: dict[str, str] | None = None
    """Tensors a slice read read whole: name -> why (the loader computes from it; replicated)."""

    def as_dict(self) -> dict:
        return asdict(self)

    def read_as(self, reads: SliceReads | None) -> LoadReport:
        """This report with what the worker read: ``reads`` (its slices), or every byte."""
        if reads is None:
            return replace(self, received_bytes=self.nbytes)
        return replace(
            self,
            received_bytes=reads.received_bytes,
            sliced_received_bytes=reads.sliced_received,
            sliced_kept_bytes=reads.sliced_kept,
            whole=dict(reads.whole),
        )


def enabled_by_env() -> bool:
    """Whether this process's environment lets loads use plans (:data:`LOAD_PLAN_ENV`)."""
    return os.environ.get(LOAD_PLAN_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


class PlannedLoader:
    """The load plans of one worker, by layout (see the module docstring).

    Args:
        keep: layouts whose plans are kept (the oldest is dropped past it).

    Examples:
        >>> model = torch.nn.Linear(2, 2, bias=False).requires_grad_(False)
        >>> def load_weights(weights):
        ...     for _, w in weights:
        ...         model.weight.data.copy_(w)
        >>> loader = PlannedLoader()
        >>> state = lambda: dict(model.named_parameters())
        >>> loader.load(load_weights, state, [("weight", torch.ones(2, 2))]).path
        'trace'
        >>> loader.load(load_weights, state, [("weight", torch.zeros(2, 2))]).path
        'replay'
        >>> model.weight.sum().item()
        0.0
    """

    def __init__(self, keep: int = 4):
        self.keep = keep
        self.enabled = enabled_by_env()
        self._plans: OrderedDict[tuple, LoadPlan | str] = OrderedDict()
        self._bound: dict[tuple, BoundPlan] = {}
        self._kept: dict[tuple, int] = {}
        self._reads: dict[tuple, SliceReads] = {}
        self._slices: dict[tuple, dict[str, TensorSlice]] = {}
        self.written: tuple | None = None
        """The layout whose plan the last load wrote through (replay, trace, scatter);
        None after any other load (the loader's, a failed one)."""

    def plan(self, named: Sequence[tuple[str, torch.Tensor]]) -> LoadPlan | str | None:
        """The plan of ``named``'s layout, the reason it has none (a refusal), or None
        (not traced yet)."""
        return self._plans.get(layout_of(named))

    def reads(self, key: tuple) -> SliceReads | None:
        """What this worker reads of each tensor of layout ``key`` (:func:`.slices.slice_reads`),
        or None: no plan of it (not traced yet, refused, or plans off)."""
        plan = self._plans.get(key)
        if not self.enabled or not isinstance(plan, LoadPlan):
            return None
        if key not in self._reads:
            self._reads[key] = slice_reads(plan)
        return self._reads[key]

    def slices(
        self, key: tuple, state: Callable[[], Mapping[str, torch.Tensor]]
    ) -> dict[str, TensorSlice] | None:
        """Each tensor of layout ``key``: the slice this worker keeps
        (:func:`.slices.plan_slices`); None unless a load of it would replay its plan now
        (no plan, a refused one, plans off, or a parameter moved since it was traced)."""
        if not self._binds(key, state):
            return None
        if key not in self._slices:
            self._slices[key] = plan_slices(self._plans[key])
        return self._slices[key]

    def replays(self, named, state: Callable[[], Mapping[str, torch.Tensor]]) -> bool:
        """Whether :meth:`load` of ``named`` would replay its layout's plan (a plan, still
        bound to the model's tensors), reading only the plan's views of them."""
        return self._binds(layout_of(named), state)

    def _binds(self, key: tuple, state: Callable[[], Mapping[str, torch.Tensor]]) -> bool:
        """Whether layout ``key`` has a plan still bound to the model's tensors (or that
        binds to them now)."""
        plan = self._plans.get(key)
        if not self.enabled or not isinstance(plan, LoadPlan):
            return False
        bound = self._bound.get(key)
        live = state()
        return (bound is not None and bound.valid(live)) or plan.bind(live) is not None

    def forget(self) -> None:
        """Drop every plan (the next push of each layout is traced again)."""
        self._plans.clear()
        self._bound.clear()
        self._kept.clear()
        self._reads.clear()
        self._slices.clear()
        self.written = None

    def scatter(
        self,
        load: Loader,
        state: Callable[[], Mapping[str, torch.Tensor]],
        named: Sequence[tuple[str, torch.Tensor]],
        changes: Changes,
    ) -> LoadReport | None:
        """Load ``named`` (a delta's new version) by writing only what ``changes`` says
        changed (:mod:`.scatter`), or None (the caller loads it whole) unless the last
        load wrote through this layout's plan, still bound to the same tensors. The caller
        knows that the parameters held ``changes.base`` then and that nothing wrote them
        since."""
        written, self.written = self.written, None
        key = layout_of(named)
        bound = self._bound.get(key)
        if not self.enabled or written != key or bound is None or not bound.valid(state()):
            return None
        named = list(named)
        elements = scatter(bound, dict(named), changes)
        kept = bound.plan.loader
        if kept:
            load(iter([(n, t) for n, t in named if n in kept]))
        self.written = key
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        itemsize = max((t.element_size() for t in bound.tensors.values()), default=0)
        why = f"the loader keeps {sorted(kept)}" if kept else None
        kept_bytes = self._kept_bytes(key, bound.plan)
        return LoadReport("scatter", nbytes, elements * itemsize, why, kept_bytes)

    def load(
        self,
        load: Loader,
        state: Callable[[], Mapping[str, torch.Tensor]],
        named: Sequence[tuple[str, torch.Tensor]],
        non_blocking: bool = False,
    ) -> LoadReport:
        """Load ``named`` into the model (``load``: its ``load_weights``; ``state()``: its
        parameters and buffers by name) by replay or trace; ``non_blocking``: the pushed
        tensors are in pinned host memory (one batched non-blocking copy, one sync)."""
        named = list(named)
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        self.written = None
        if not self.enabled:
            load(iter(named))
            return LoadReport("loader", nbytes, why=f"load plans are off ({LOAD_PLAN_ENV}=0)")
        key = layout_of(named)
        plan = self._plans.get(key)
        if isinstance(plan, str):
            load(iter(named))
            return LoadReport("loader", nbytes, why=plan)
        if plan is not None:
            live = state()  # fingerprinted at every replay: a moved parameter retraces
            bound = self._bound.get(key)
            if bound is None or not bound.valid(live):
                bound = plan.bind(live)
            if bound is not None:
                self._bound[key] = bound
                self._plans.move_to_end(key)
                self._replay(load, bound, named, non_blocking)
                self.written = key
                kept = f"the loader keeps {sorted(plan.loader)}" if plan.loader else None
                return LoadReport(
                    "replay", nbytes, plan.replayed_bytes, kept, self._kept_bytes(key, plan)
                )
            logger.info(
                "a parameter of the model moved since its load plan was traced (a new "
                "pointer, shape, stride or dtype): tracing the loader again"
            )
            self._bound.pop(key, None)
        return self._trace(load, state, named, key, nbytes)

    def _replay(self, load: Loader, bound: BoundPlan, named, non_blocking: bool) -> None:
        bound.apply(dict(named), non_blocking=non_blocking)
        if non_blocking and bound.dsts and bound.dsts[0].is_cuda:
            # The staging buffers are reused by the next push: the copies must be done.
            torch.cuda.current_stream(bound.dsts[0].device).synchronize()
        kept = bound.plan.loader
        if kept:
            load(iter([(n, t) for n, t in named if n in kept]))

    def _trace(self, load: Loader, state, named, key: tuple, nbytes: int) -> LoadReport:
        tensors = state()
        plan = trace(load, named, tensors)  # the loader loads this push
        bound = plan.bind(state())
        if bound is None:
            return self._refuse(key, nbytes, "a parameter moved while the loader ran")
        targets = list(bound.tensors.values())
        try:
            loaded = content_sums(targets)
            self._replay(load, bound, named, non_blocking=False)
            replayed = content_sums(targets)
        except torch.cuda.OutOfMemoryError:  # the check's scratch (a colocated trainer)
            load(iter(named))  # as a normal load leaves them; no plan yet: traced again
            why = "no GPU memory for the plan's check this push (traced again next push)"
            logger.warning("the loader loaded this push: %s", why)
            return LoadReport("loader", nbytes, why=why)
        differ = [n for n, a, b in zip(bound.tensors, loaded, replayed, strict=True) if a != b]
        if differ:
            load(iter(named))  # as a normal load leaves them
            return self._refuse(
                key,
                nbytes,
                f"a replay of its plan wrote {differ[:3]} ({len(differ)} tensors) differently "
                "from the loader",
            )
        self._remember(key, plan)
        self._bound[key] = bound
        self.written = key
        logger.info(
            "load plan traced for %d pushed tensors: %d copies replay %.1f of %.1f MB as one "
            "batched copy%s%s",
            len(named),
            len(plan.copies),
            plan.replayed_bytes / 1e6,
            nbytes / 1e6,
            f"; the loader keeps {_reasons(plan.loader)}" if plan.loader else "",
            f"; the loader skips {len(plan.skipped)}" if plan.skipped else "",
        )
        return LoadReport("trace", nbytes, kept_bytes=self._kept_bytes(key, plan))

    def _kept_bytes(self, key: tuple, plan: LoadPlan) -> int:
        """The bytes of ``plan``'s layout this worker keeps (worked out once per plan)."""
        if key not in self._kept:
            self._kept[key] = kept_bytes(plan)
        return self._kept[key]

    def _refuse(self, key: tuple, nbytes: int, why: str) -> LoadReport:
        logger.warning("no load plan for this layout, the loader loads every push: %s", why)
        self._remember(key, why)
        return LoadReport("loader", nbytes, why=why)

    def _remember(self, key: tuple, plan: LoadPlan | str) -> None:
        self._plans[key] = plan
        self._kept.pop(key, None)  # worked out from the plan it replaces
        self._reads.pop(key, None)
        self._slices.pop(key, None)
        self._plans.move_to_end(key)
        while len(self._plans) > self.keep:
            old, _ = self._plans.popitem(last=False)
            self._bound.pop(old, None)
            self._kept.pop(old, None)
            self._reads.pop(old, None)
            self._slices.pop(old, None)


def _reasons(loader: dict[str, str], limit: int = 3) -> str:
    shown = "; ".join(f"{n}: {why}" for n, why in list(loader.items())[:limit])
    more = len(loader) - limit
    return shown + (f"; and {more} more" if more > 0 else "")


def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A model's parameters and buffers by name: what a loader may write."""
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}

"""Which way a push's bytes reach each replica: the plan of ``transport="auto"`` on GPUs.

Where every byte lives decides it (the first GPU run: one NCCL communicator may not hold
two ranks on one GPU):

- a replica whose workers all sit on the trainer's GPU gets **CUDA IPC** (handles of the
  trainer's packed buckets; the worker copies from them in its pause);
- a replica on other GPUs gets **NCCL**, in *layers*: each layer is one communicator of
  the trainer and at most one worker per GPU, so replicas sharing a GPU go to different
  layers;
- a replica with no GPU, a MIG slice or a device that did not report itself gets the
  **storage** slots on the trainer's host, a **gloo** broadcast elsewhere;
- a replica split across the trainer's GPU and others (a TP replica) gets **storage**.

Devices compare by UUID only (:mod:`..devices`). Plain functions, unit-tested on CPU; the
transport (:mod:`.sender`) follows the plan, each route through the transport the registry
names for it (:data:`~..registry.ROUTES`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from torchrl_vllm_ext.errors import ConfigurationError
from torchrl_vllm_ext.weight_sync.transports.devices import is_mig

Route = str
"""A route name: a key of :data:`~..registry.ROUTES` (which transport carries it, and how)."""


@dataclass(frozen=True)
class Place:
    """Where one process computes: its Ray node and its GPU (normalised UUID; None: no GPU
    or unknown)."""

    node: str
    gpu: str | None = None


@dataclass(frozen=True)
class ReplicaPlan:
    """How one replica receives a push."""

    replica_id: int
    route: Route
    layer: int = 0
    """NCCL: the communicator it joins (0, 1, ...); 0 otherwise."""
    why: str = ""


@dataclass(frozen=True)
class TransportPlan:
    """Every replica's route, and the reason in one line (``scheme.reason``)."""

    replicas: tuple[ReplicaPlan, ...]

    def routes(self) -> dict[tuple[Route, int], list[int]]:
        """``{(route, layer): [replica ids]}`` in replica order: one sub-transport each."""
        out: dict[tuple[Route, int], list[int]] = defaultdict(list)
        for p in sorted(self.replicas, key=lambda p: p.replica_id):
            out[(p.route, p.layer)].append(p.replica_id)
        return dict(out)

    @property
    def reason(self) -> str:
        parts = []
        for (route, layer), ids in self.routes().items():
            name = f"nccl layer {layer}" if route == "nccl" else route
            whys = sorted({p.why for p in self.replicas if p.replica_id in ids and p.why})
            parts.append(f"{name}: replicas {ids}" + (f" ({'; '.join(whys)})" if whys else ""))
        return "; ".join(parts) or "no replica"


def plan_routes(
    trainer: Place, workers: dict[int, list[Place]], shared_dir: bool = False
) -> TransportPlan:
    """The route of each replica (``workers``: replica id -> its workers' places).

    Raises:
        ConfigurationError: a replica cannot be reached (a MIG slice or split replica on
        another host with no shared directory), naming it and its devices.

    Examples:
        >>> t = Place("n1", "gpu-a")
        >>> plan = plan_routes(t, {0: [Place("n1", "gpu-a")], 1: [Place("n1", "gpu-b")],
        ...                        2: [Place("n1", "gpu-b")]})
        >>> plan.routes()
        {('ipc', 0): [0], ('nccl', 0): [1], ('nccl', 1): [2]}
    """
    plans: list[ReplicaPlan] = []
    taken: dict[int, set[str]] = defaultdict(set)  # NCCL layer -> GPUs holding a rank
    for rid in sorted(workers):
        places = workers[rid]
        route, why = _route(trainer, rid, places, shared_dir)
        layer = 0
        if route == "nccl":
            gpus = {p.gpu for p in places}
            while taken[layer] & gpus:
                layer += 1
            taken[layer] |= gpus
            if layer:
                why = "shares a GPU with a replica of an earlier layer"
        plans.append(ReplicaPlan(rid, route, layer, why))
    return TransportPlan(tuple(plans))


def _route(trainer: Place, rid: int, places: list[Place], shared_dir: bool) -> tuple[Route, str]:
    nodes = {p.node for p in places}
    on_trainer_host = nodes == {trainer.node}
    host_route: Route = "storage" if on_trainer_host or shared_dir else "gloo"
    gpus = [p.gpu for p in places]
    if any(g is None for g in gpus):
        return host_route, "a worker without a known GPU"
    if any(is_mig(g) for g in gpus) or is_mig(trainer.gpu):
        if host_route == "gloo":
            raise ConfigurationError(
                f"replica {rid} runs on MIG slices {sorted(set(gpus))} on another host: CUDA "
                "IPC and NCCL do not cross MIG slices. Give the scheme a storage_dir shared "
                "with that host, or use whole GPUs."
            )
        return host_route, "MIG slice: no CUDA IPC or NCCL"
    if trainer.gpu is None:
        return host_route, "the trainer's tensors are on the CPU"
    on_trainer_gpu = [g == trainer.gpu for g in gpus]
    if all(on_trainer_gpu):
        return "ipc", ""
    if any(on_trainer_gpu):
        if host_route == "gloo":  # pragma: no cover - a GPU belongs to one host
            raise ConfigurationError(f"replica {rid}: inconsistent device report {places}.")
        return "storage", f"split between the trainer's GPU {trainer.gpu} and others"
    return "nccl", ""


def nccl_layers_hold_one_rank_per_gpu(trainer: Place, plan: TransportPlan, workers) -> bool:
    """The invariant NCCL needs, checked: no layer holds two ranks of one GPU (the trainer's
    included)."""
    for (route, _), ids in plan.routes().items():
        if route != "nccl":
            continue
        gpus = [trainer.gpu] + [p.gpu for rid in ids for p in workers[rid]]
        if len(gpus) != len(set(gpus)):
            return False
    return True

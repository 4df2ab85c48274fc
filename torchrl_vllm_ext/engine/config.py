"""ServiceConfig: how a :class:`~torchrl_vllm_ext.VLLMService` launches and runs its replicas.

Declared once: ``VLLMService.launch(model, **kwargs)`` fills these fields from its
keyword arguments (the rest go to ``vllm.AsyncEngineArgs``), and every check runs in
``__post_init__``, so a bad value fails before Ray or vLLM start.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchrl_vllm_ext.engine.placement import PLACEMENTS
from torchrl_vllm_ext.engine.routing import validate_strategies
from torchrl_vllm_ext.errors import ConfigurationError
from torchrl_vllm_ext.extensions import (
    ACTOR_EXTENSION,
    ENGINE_UPDATES,
    PACKED_WEIGHTS_ENV,
    WORKER_EXTENSION,
)
from torchrl_vllm_ext.hf import model_dir

DEFAULT_ROUTING = ("session", "prefix", "least_outstanding")
MAX_SHARE_OF_SLICE = 0.95
"""The most of its GPU slice a replica sharing a GPU may ask for (``gpu_memory_utilization``
<= this x ``gpus_per_replica``): the rest holds its CUDA context, which vLLM's start check
counts against the replicas after it."""
ENGINE_PROCESS_ENV = "TORCHRL_VLLM_ENGINE_PROCESS"
"""Overrides the default of :attr:`ServiceConfig.engine_process` (``1`` / ``0``)."""


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")


@dataclass
class ServiceConfig:
    """How the service launches and runs its replicas.

    Examples:
        >>> from torchrl_vllm_ext.testing import make_tiny_model
        >>> cfg = ServiceConfig(model=make_tiny_model(), num_replicas=2)  # doctest: +SKIP
        >>> cfg.routing  # doctest: +SKIP
        ('session', 'prefix', 'least_outstanding')
    """

    model: str
    """Local path of a Hugging Face causal LM."""
    num_replicas: int = 1
    """Engine replicas to start."""
    tensor_parallel_size: int = 1
    """Tensor-parallel workers per replica."""
    pipeline_parallel_size: int = 1
    """Pipeline-parallel stages per replica."""
    ray_address: str | None = None
    """Address of a Ray cluster to join; None starts (or reuses) a local one."""
    routing: tuple[str, ...] = DEFAULT_ROUTING
    """Routing strategies, tried in order (see :mod:`torchrl_vllm_ext.engine.routing`)."""
    cpus_per_replica: float | None = None
    """CPUs reserved per replica without GPUs (fractions allowed); default 1."""
    gpus_per_replica: float = 1.0
    """GPUs per tensor/pipeline-parallel worker on GPU clusters; a fraction lets several
    single-worker replicas share one GPU (each then gets that share of its memory,
    ``gpu_memory_utilization = 0.9 x share``, unless given)."""
    placement: str = "any"
    """Which node each replica goes to: ``any`` (Ray decides), ``pack`` (fill one node
    first), ``spread`` (fewest replicas first) or ``strict_spread`` (one per node); see
    :mod:`torchrl_vllm_ext.engine.placement`."""
    replica_resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources each replica reserves, e.g. ``{"rollout": 0.01}`` to keep
    replicas on the nodes started with ``--resources '{"rollout": 1}'``."""
    weight_version: str = "0"
    """Weight version label the replicas start with: the checkpoint's label."""
    allow_mixed_versions: bool = False
    """Let a started replica that holds other weights than the live version's serve beside
    the others, under its own label: after the weight-sync scheme that pushed the live
    version closed, a restarted or added replica holds the checkpoint's weights (labelled
    ``weight_version``). Off: it takes no requests until a push brings it to the live
    version (state ``held``). Samples carry each token's true version either way."""
    engine_process: bool = field(default_factory=lambda: _env_flag(ENGINE_PROCESS_ENV))
    """(Default from ``TORCHRL_VLLM_ENGINE_PROCESS``.) Run every replica's engine as ``AsyncLLM`` with an engine-core process, also on CPU
    (default off: a single-worker CPU replica steps ``LLMEngine`` in its actor)."""
    cpu_packed_weights: bool = field(default_factory=lambda: _env_flag(PACKED_WEIGHTS_ENV))
    """(Default from ``TORCHRL_VLLM_CPU_PACKED_WEIGHTS``.) Keep vLLM-CPU's oneDNN-packed linear weights (default off: checkpoint layout, so a
    weight update is an in-place copy)."""
    worker_extension_cls: str | None = WORKER_EXTENSION
    """vLLM ``worker_extension_cls`` of the replicas: the weight-sync receivers."""
    actor_extension_cls: str | None = ACTOR_EXTENSION
    """Class instantiated in each replica actor (``VLLMReplica.extension_call``)."""
    engine_cls: str | None = None
    """Dotted path of the :class:`~torchrl_vllm_ext.engine.replica.engine.Engine` every
    replica drives instead of vLLM's (None: vLLM's, chosen by the build and the workers); a
    stand-in such as ``torchrl_vllm_ext.testing.instant.InstantEngine`` measures the
    package's own ceiling (``benchmarks/bench_ceiling.py``)."""
    engine_updates_cls: str | None = ENGINE_UPDATES
    """Class TorchRL's engine weight calls on the service go through (``update_weights``,
    ``init_weight_update_group``, ...), built as ``cls(service)`` on first use and
    closed with the service; None: those calls raise."""
    startup_timeout: float = 900.0
    """Seconds a replica may take to start its engine."""
    placement_timeout: float = 60.0
    """Seconds to wait for Ray to place a replica's placement group."""
    shutdown_timeout: float = 60.0
    """Seconds a replica may take to stop gracefully before it is killed."""
    health_check_interval: float = 10.0
    """Seconds between background health checks (0 disables them)."""
    health_check_timeout: float = 30.0
    """Seconds a replica may take to answer a health check."""
    max_retries: int = 3
    """Times a batch part is re-sent after its replica died."""
    restart_attempts: int = 3
    """Times a dead replica is restarted before it is given up."""
    restart_backoff: float = 2.0
    """Seconds before restart attempt k + 1, times k + 1."""
    ready_poll_interval: float = 0.2
    """Seconds between checks for a ready replica while none is."""
    batch_invariant: bool = False
    """Run vLLM's batch-invariant kernels (``VLLM_BATCH_INVARIANT=1`` in every replica): a
    sample's log-probs then do not depend on the batch it shared. GPUs of compute capability
    >= 8.0 and a vLLM that has them; refused with a ``ConfigurationError`` elsewhere (CPU
    included) when the service starts."""
    log_file: str | None = None
    """File the replicas append their output to (vLLM's logs and warnings, engine
    processes) instead of Ray forwarding it to the driver's terminal; None: forwarded."""
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra ``vllm.AsyncEngineArgs`` keyword arguments."""

    def __post_init__(self):
        for name in ("num_replicas", "tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigurationError(
                    f"{name}={value!r} is invalid; it must be an integer >= 1."
                )
        for name in ("max_retries", "restart_attempts"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ConfigurationError(f"{name}={value!r} is invalid; it must be an int >= 0.")
        if self.cpus_per_replica is not None and not self.cpus_per_replica > 0:
            raise ConfigurationError(
                f"cpus_per_replica={self.cpus_per_replica!r} must be > 0 (fractions are fine)."
            )
        for name in ("startup_timeout", "placement_timeout", "shutdown_timeout"):
            if not getattr(self, name) > 0:
                raise ConfigurationError(f"{name}={getattr(self, name)!r} must be > 0 seconds.")
        if not 0 < self.gpus_per_replica <= 1 or (
            self.gpus_per_replica < 1
            and self.tensor_parallel_size * self.pipeline_parallel_size > 1
        ):
            raise ConfigurationError(
                f"gpus_per_replica={self.gpus_per_replica!r} must be in (0, 1], and 1 with "
                "tensor or pipeline parallelism (each worker owns its GPU)."
            )
        share = self.engine_kwargs.get("gpu_memory_utilization")
        most = round(MAX_SHARE_OF_SLICE * self.gpus_per_replica, 4)
        if self.gpus_per_replica < 1 and share is not None and share > most:
            # Replicas sharing a GPU start in parallel, each within its share
            # (engine/driver/start_order.py): the shares, and each replica's CUDA context
            # besides, must fit in the GPU together (vLLM refuses to start a replica that
            # finds less free than its share).
            raise ConfigurationError(
                f"gpu_memory_utilization={share!r} is a share of the whole GPU, and replicas "
                f"with gpus_per_replica={self.gpus_per_replica!r} share one: together with "
                f"their CUDA contexts they would ask for more than the GPU has. Give at most "
                f"{most:.3g} (the default is 0.9 x gpus_per_replica = "
                f"{0.9 * self.gpus_per_replica:.3g}), or set kv_cache_memory_bytes."
            )
        if self.placement not in PLACEMENTS:
            raise ConfigurationError(f"placement={self.placement!r} is not one of {PLACEMENTS}.")
        self.replica_resources = dict(self.replica_resources)
        for key, amount in self.replica_resources.items():
            if not isinstance(key, str) or not isinstance(amount, int | float) or amount <= 0:
                raise ConfigurationError(
                    f"replica_resources[{key!r}]={amount!r} is invalid; give resource name -> "
                    "amount > 0, e.g. {'rollout': 0.01}."
                )
        model_dir(self.model)
        self.model = str(self.model)
        self.routing = validate_strategies(self.routing)
        self.weight_version = str(self.weight_version)
        self.engine_kwargs = dict(self.engine_kwargs)
        if self.log_file is not None:
            self.log_file = str(Path(self.log_file).absolute())

    @classmethod
    def from_kwargs(cls, model: str | Path, **kwargs: Any) -> ServiceConfig:
        """Config fields from ``kwargs``; every other keyword goes to ``engine_kwargs``."""
        names = {f.name for f in dataclasses.fields(cls)} - {"model", "engine_kwargs"}
        own = {k: kwargs.pop(k) for k in list(kwargs) if k in names}
        engine = {**kwargs.pop("engine_kwargs", {}), **kwargs}
        return cls(model=model, **own, engine_kwargs=engine)


__all__ = ["DEFAULT_ROUTING", "ServiceConfig"]

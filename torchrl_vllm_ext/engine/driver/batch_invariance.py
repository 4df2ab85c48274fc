"""vLLM's batch-invariant kernels (``VLLM_BATCH_INVARIANT=1``): where a service may turn
them on, and the replicas' environment when it does.

With them a token's log-prob does not depend on which other requests share its batch, so
the engine's log-probs of a sample are the same whatever the load; they are CUDA kernels
for compute capability >= 8.0 (:attr:`ServiceConfig.batch_invariant`).
"""

from __future__ import annotations

from torchrl_vllm_ext import _compat
from torchrl_vllm_ext.errors import ConfigurationError

ENV = "VLLM_BATCH_INVARIANT"
MIN_CAPABILITY = (8, 0)


def refusal(*, use_gpu: bool, kernels: bool, capabilities: list[tuple[int, int]]) -> str | None:
    """Why batch-invariant kernels cannot run on these replicas (None: they can).

    ``capabilities``: the compute capabilities of the GPUs this process sees (empty: none
    seen here, left to vLLM).

    Examples:
        >>> refusal(use_gpu=True, kernels=True, capabilities=[(9, 0)]) is None
        True
        >>> refusal(use_gpu=True, kernels=True, capabilities=[(7, 5)])[:40]
        'batch_invariant=True needs GPUs of compu'
    """
    if not use_gpu:
        return (
            "batch_invariant=True needs GPU replicas: vLLM's batch-invariant kernels are CUDA "
            "kernels (compute capability >= 8.0) and these replicas run on CPU (a CPU build "
            "of vLLM, or no GPU in the Ray cluster); leave batch_invariant off."
        )
    if not kernels:
        return (
            "batch_invariant=True: the installed vLLM has no batch-invariant kernels "
            f"({' / '.join(_compat.BATCH_INVARIANT_MODULES)}); upgrade vLLM or leave "
            "batch_invariant off."
        )
    old = sorted({c for c in capabilities if tuple(c) < MIN_CAPABILITY})
    if old:
        found = ", ".join(f"{a}.{b}" for a, b in old)
        return (
            f"batch_invariant=True needs GPUs of compute capability >= 8.0 (Ampere or newer); "
            f"this machine has {found}. Leave batch_invariant off."
        )
    return None


def cuda_capabilities() -> list[tuple[int, int]]:
    """The compute capability of every GPU this process sees (none: empty)."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]


def check(use_gpu: bool, config) -> None:
    """Raise :class:`ConfigurationError` when ``config.batch_invariant`` cannot be honoured.

    The GPUs checked are those the driver sees; on a cluster whose driver has none, the
    replicas' GPUs are not read before they start.
    """
    if not config.batch_invariant:
        return
    capabilities = cuda_capabilities() if use_gpu else []
    why = refusal(
        use_gpu=use_gpu,
        kernels=use_gpu and _compat.has_batch_invariant_kernels(),
        capabilities=capabilities,
    )
    if why is not None:
        raise ConfigurationError(why)


def replica_env(config) -> dict[str, str]:
    """What a replica's environment gets for ``config.batch_invariant``."""
    return {ENV: "1"} if config.batch_invariant else {}


__all__ = [
    "ENV",
    "MIN_CAPABILITY",
    "check",
    "cuda_capabilities",
    "refusal",
    "replica_env",
]

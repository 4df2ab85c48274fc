"""What the generation benchmarks run on: this machine's CPUs (their defaults, unchanged) or a
GPU (GPU-sized batches, CUDA graphs, bf16), and how their engines share that GPU.

On a GPU every system of a benchmark is up at once (rounds alternate between them), so
each engine takes a slice: a KV cache of ``GPU_KV_BYTES`` given up front (no memory
profile: the engines start in parallel, and a tiny model's batch fits many times over)
within ``GPU_SHARE`` of the GPU each (vLLM refuses to start an engine whose share is not
free).
"""

from __future__ import annotations

GPU_KV_BYTES = 2 << 30
"""KV cache of every engine of a GPU benchmark (256 x 280 tokens of the tiny model fit)."""
GPU_SHARE = 0.2
"""``gpu_memory_utilization`` of each raw engine; the service's replica reserves as much."""
GPU_SIZES = {"prompts": 256, "max_tokens": 256, "rounds": 5}
"""Default batch and rounds on a GPU (the CPU defaults stay each benchmark's own)."""
GPU_MAX_MODEL_LEN = 512

CPU_PUSH_SERVICE = {
    "num_replicas": 2,
    "cpus_per_replica": 1.0,
    "max_model_len": 256,
    "enforce_eager": True,
    "health_check_interval": 0,
}
"""The two one-CPU replicas the weight-push benchmarks push into (sync, sharded, delta, lora;
each gives its own ``dtype`` and extras)."""


def on_gpu() -> bool:
    """Whether the benchmarks run on a GPU: CUDA is there and vLLM is a GPU build."""
    import torch

    from torchrl_vllm_ext._compat import vllm_build_drives_gpus

    return torch.cuda.is_available() and vllm_build_drives_gpus()


def gpu_engine_kwargs() -> dict:
    """The engine arguments every engine of a GPU benchmark shares (CUDA graphs on)."""
    return {
        "dtype": "bfloat16",
        "max_model_len": GPU_MAX_MODEL_LEN,
        "kv_cache_memory_bytes": GPU_KV_BYTES,
    }


def gpu_service_kwargs() -> dict:
    """``VLLMService.launch`` keywords of a GPU benchmark's one replica (beside raw engines)."""
    return {"gpus_per_replica": GPU_SHARE / 0.9, "health_check_interval": 0, **gpu_engine_kwargs()}


def apply_gpu_sizes(args, parser) -> None:
    """Replace the CPU defaults the user did not set by the GPU sizes."""
    for name, value in GPU_SIZES.items():
        if getattr(args, name, None) == parser.get_default(name):
            setattr(args, name, value)


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"

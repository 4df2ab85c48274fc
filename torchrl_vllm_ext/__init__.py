"""torchrl_vllm_ext: vLLM as the rollout engine of TorchRL.

The public API is re-exported here and imported lazily (PEP 562): replica and vLLM
worker processes import submodules of this package, and must not pay for TorchRL.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "VLLMService": "torchrl_vllm_ext.engine.driver.service",
    "ServiceConfig": "torchrl_vllm_ext.engine.config",
    "VLLMPolicy": "torchrl_vllm_ext.wrappers",
    "WeightSyncScheme": "torchrl_vllm_ext.weight_sync.scheme",
    "SyncReport": "torchrl_vllm_ext.weight_sync.report",
    "ShardedWeightSync": "torchrl_vllm_ext.weight_sync.sharded",
    "AdapterSync": "torchrl_vllm_ext.weight_sync.adapters",
    "Deadline": "torchrl_vllm_ext.deadlines",
    "WeightSyncUpdater": "torchrl_vllm_ext.collectors",
    "ServiceSyncScheme": "torchrl_vllm_ext.weight_sync.torchrl.script_scheme",
    "AsyncCollection": "torchrl_vllm_ext.collectors",
    "StalenessFilter": "torchrl_vllm_ext.collectors",
    "StalenessGate": "torchrl_vllm_ext.collectors",
    "TokenCopyEnv": "torchrl_vllm_ext.envs",
    "TokenCountEnv": "torchrl_vllm_ext.envs",
    "TokenTaskEnv": "torchrl_vllm_ext.envs",
    "mask_stale_tokens": "torchrl_vllm_ext.collectors",
    "exclude_stale_tokens": "torchrl_vllm_ext.collectors",
    "exact_spans": "torchrl_vllm_ext.collectors",
    "token_spans": "torchrl_vllm_ext.collectors",
    "RolloutQueue": "torchrl_vllm_ext.collectors",
    "load_output": "torchrl_vllm_ext.jobs.generate_store",
    "ReferenceKL": "torchrl_vllm_ext.transforms",
    "CorrectedGRPOLoss": "torchrl_vllm_ext.losses",
    "RolloutCorrection": "torchrl_vllm_ext.losses",
    "mismatch_metrics": "torchrl_vllm_ext.losses",
    "ScriptedChat": "torchrl_vllm_ext.envs",
    "AdapterReport": "torchrl_vllm_ext.weight_sync.adapters",
    "PolicyOptions": "torchrl_vllm_ext.wrappers.options",
    "ReplicaPool": "torchrl_vllm_ext.engine.driver.pool",
    "ReplicaState": "torchrl_vllm_ext.engine.fleet",
    "ReplicaView": "torchrl_vllm_ext.engine.fleet",
    "ReplicaDeath": "torchrl_vllm_ext.messages",
    "ReplicaInfo": "torchrl_vllm_ext.messages",
    "ReplicaStats": "torchrl_vllm_ext.messages",
    "RequestBatch": "torchrl_vllm_ext.batches",
    "RequestData": "torchrl_vllm_ext.messages",
    "SampleData": "torchrl_vllm_ext.messages",
    **{
        name: "torchrl_vllm_ext.errors"
        for name in (
            "CollectionStoppedError",
            "ConfigurationError",
            "GenerationTimeoutError",
            "InsufficientResourcesError",
            "InvalidInputTypeError",
            "InvalidRequestError",
            "NoHealthyReplicaError",
            "PartialLoadError",
            "ReplicaDeadError",
            "ReplicaStartupError",
            "ServiceClosedError",
            "ShardedPushError",
            "TorchRLVLLMError",
            "TrainerRankError",
            "TransportCapabilityError",
            "UnknownRoutingStrategyError",
            "WeightSyncError",
        )
    },
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'torchrl_vllm_ext' has no attribute {name!r}")


def __dir__():
    return __all__

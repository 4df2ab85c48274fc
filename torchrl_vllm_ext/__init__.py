"""torchrl_vllm_ext: vLLM as the rollout engine of TorchRL."""

from torchrl_vllm_ext.engine.service import ServiceConfig, VLLMService
from torchrl_vllm_ext.errors import (
    ConfigurationError,
    GenerationTimeoutError,
    InsufficientResourcesError,
    InvalidRequestError,
    NoHealthyReplicaError,
    ReplicaDeadError,
    ReplicaStartupError,
    ServiceClosedError,
    TorchRLVLLMError,
    UnknownRoutingStrategyError,
    WeightSyncError,
)
from torchrl_vllm_ext.messages import ReplicaInfo, ReplicaStats, RequestData, SampleData
from torchrl_vllm_ext.weight_sync.scheme import SyncReport, WeightSyncScheme
from torchrl_vllm_ext.wrappers import VLLMPolicy

__all__ = [
    "ConfigurationError",
    "GenerationTimeoutError",
    "InsufficientResourcesError",
    "InvalidRequestError",
    "NoHealthyReplicaError",
    "ReplicaDeadError",
    "ReplicaInfo",
    "ReplicaStartupError",
    "ReplicaStats",
    "RequestData",
    "SampleData",
    "ServiceClosedError",
    "ServiceConfig",
    "SyncReport",
    "TorchRLVLLMError",
    "UnknownRoutingStrategyError",
    "VLLMPolicy",
    "VLLMService",
    "WeightSyncError",
    "WeightSyncScheme",
]

"""The package's exception hierarchy.

Every error names the bad value and the fix; where they apply, the replica, the
weight version and the slot. Validation errors also derive from ``ValueError`` and
timeouts from ``TimeoutError`` so generic handlers keep working.
"""

from __future__ import annotations


class TorchRLVLLMError(Exception):
    """Base class of every error raised by torchrl_vllm_ext."""


class InvalidRequestError(TorchRLVLLMError, ValueError):
    """A request was rejected before it reached an engine; nothing was enqueued."""


class InvalidInputTypeError(InvalidRequestError, TypeError):
    """An input of the wrong type (e.g. not a ``History``); catchable as ``TypeError``, as
    TorchRL's wrappers raise it."""


class ConfigurationError(TorchRLVLLMError, ValueError):
    """An argument of a constructor or launch call is invalid."""


class TransportCapabilityError(ConfigurationError):
    """A push needs a capability its transport does not declare (``transport``: its name;
    ``capabilities``: those it would take, e.g. a sharded push's ``WrittenByRanks`` or
    ``Streamed``)."""

    def __init__(self, message: str, transport: str = "", capabilities: tuple[str, ...] = ()):
        super().__init__(message)
        self.transport = transport
        self.capabilities = tuple(capabilities)

    def __reduce__(self):  # crosses processes with its fields
        return (type(self), (str(self), self.transport, self.capabilities))


class UnknownRoutingStrategyError(ConfigurationError):
    """A routing strategy name that the router does not know."""


class InsufficientResourcesError(TorchRLVLLMError):
    """The Ray cluster cannot hold the requested replicas."""


class ReplicaDeadError(TorchRLVLLMError):
    """A replica's process died or its engine failed."""


class NoHealthyReplicaError(ReplicaDeadError):
    """No replica is alive to take a request, and none came back in time."""


class ReplicaStartupError(TorchRLVLLMError):
    """A replica failed to start its engine."""


class GenerationTimeoutError(TorchRLVLLMError, TimeoutError):
    """A generation exceeded its timeout; its requests were aborted inside vLLM."""


class ServiceClosedError(TorchRLVLLMError, RuntimeError):
    """The service was used after ``shutdown()``."""


class CollectionStoppedError(TorchRLVLLMError, RuntimeError):
    """A background collector thread ended with an error: nothing more is collected."""


class WeightSyncError(TorchRLVLLMError):
    """A weight update failed; the replicas keep serving the previous version."""


class ShardedPushError(WeightSyncError):
    """A push from a sharded trainer failed on one or more of its ranks (``ranks``); every
    rank raises the same error and the replicas keep serving their previous version."""

    def __init__(self, message: str, ranks: tuple[int, ...] = ()):
        super().__init__(message)
        self.ranks = tuple(ranks)

    def __reduce__(self):  # crosses processes with its ranks
        return (type(self), (str(self), self.ranks))


class PartialLoadError(WeightSyncError):
    """A replica's load failed after it had begun writing its weights: it serves none
    until it is restarted (at the version the service serves)."""


class TrainerRankError(TorchRLVLLMError):
    """A rank of a data-parallel trainer (``rank``) failed or exited; the job stops and
    every other rank is ended."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank

    def __reduce__(self):  # crosses processes with its rank
        return (type(self), (str(self), self.rank))

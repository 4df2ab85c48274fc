"""The weight-sync actor extension: work done in a replica's Ray actor, beside its engine.

The replica instantiates it (``ServiceConfig.actor_extension_cls``:
:data:`torchrl_vllm_ext.extensions.ACTOR_EXTENSION`, a stable dotted path) and runs its public
methods through ``VLLMReplica.extension_call`` (names in
:class:`torchrl_vllm_ext.extensions.ActorMethods`). The class is the union of the transports'
actor parts (:func:`~.transports.registry.actor_parts`; today storage's checksum pass).
"""

from __future__ import annotations

from torchrl_vllm_ext.weight_sync.transports.registry import actor_parts


class WeightSyncActorExtension(*actor_parts()):
    """Methods the replica actor runs beside its engine."""

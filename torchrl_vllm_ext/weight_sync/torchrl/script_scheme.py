"""TorchRL's scheme-and-sender shape over a service, for the GRPO scripts of TorchRL.

TorchRL's sota GRPO scripts push with ``VLLMWeightSyncScheme(...).create_sender()``:
``register_model``, ``init_all_workers_group(metadata, vllm_engine=engine)``,
``register_collector``, ``update_weights()``. That scheme drives vLLM's native NCCL
weight transfer, which these replicas do not serve (their pushes are verified and
versioned). :class:`ServiceSyncScheme` gives the same calls over the service's own push
(``service.update_weights``), so a script changes the line that builds its scheme. It
works where the script's train loop runs: in a Ray actor the service is a handle, and the
pushed tensors go to the service's owner, which pushes them.
"""

from __future__ import annotations

import logging

import torch

from torchrl_vllm_ext.weight_sync.sources import full_push_source

logger = logging.getLogger(__name__)


class ServiceSyncScheme:
    """``VLLMWeightSyncScheme``'s place in a TorchRL script: ``create_sender()``.

    Args:
        engine: the :class:`~torchrl_vllm_ext.VLLMService` (or a handle to it).

    Examples:
        >>> scheme = ServiceSyncScheme(service)  # doctest: +SKIP
        >>> sender = scheme.create_sender()  # doctest: +SKIP
        >>> sender.register_model(policy_training.model)  # doctest: +SKIP
        >>> sender.init_all_workers_group(metadata, vllm_engine=service)  # doctest: +SKIP
        >>> sender.register_collector(collector)  # doctest: +SKIP
        >>> sender.update_weights()  # doctest: +SKIP
    """

    def __init__(self, engine):
        self.engine = engine

    def create_sender(self) -> ServiceSender:
        return ServiceSender(self.engine)


class ServiceSender:
    """TorchRL's weight sender calls, each a push through the service (see the module)."""

    def __init__(self, engine):
        self.engine = engine
        self._model = None
        self._collectors: list = []

    def register_model(self, model) -> None:
        """The model :meth:`update_weights` pushes (a transformers or PEFT model, or
        TorchRL's ``TransformersWrapper``)."""
        self._model = model

    def register_collector(self, collector) -> None:
        """A collector whose policy version each push increments (TorchRL's contract)."""
        self._collectors.append(collector)

    def init_all_workers_group(self, model_metadata=None, vllm_engine=None) -> None:
        """Make the service's scheme (and, for a broadcast, its group) now."""
        self.engine.init_weight_update_group()

    def update_weights(self, weights=None) -> None:
        """Push ``weights`` (default: the registered model) into every replica as the next
        version; then increment every registered collector's policy version. A PEFT model
        is merged apart here; the tensors cross to the owner on the CPU."""
        source = weights if weights is not None else self._model
        if source is None:
            raise ValueError("update_weights() has nothing to push: call register_model first.")
        with torch.no_grad():
            tensors = full_push_source(source).tensors
            cpu = {name: t.detach().to("cpu") for name, t in tensors.items()}
        self.engine.update_weights(iter(cpu.items()))
        for collector in self._collectors:
            collector.increment_version()

    def shutdown(self) -> None:
        """Nothing to release: the service's scheme closes with the service."""


__all__ = ["ServiceSender", "ServiceSyncScheme"]

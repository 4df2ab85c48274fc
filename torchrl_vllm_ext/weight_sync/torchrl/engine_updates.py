"""The weight-update half of TorchRL's ``RLvLLMEngine`` interface on a VLLMService.

TorchRL's ``vLLMUpdaterV2(engine)`` reads the engine's metadata, master address and port,
calls ``init_weight_update_group()`` once and ``update_weights(iterator)`` per push. On a
:class:`~torchrl_vllm_ext.VLLMService` those land here: one
:class:`~torchrl_vllm_ext.WeightSyncScheme` (transport ``auto``) made on first use and
closed with the service, each push validated, versioned (the next integer) and verified
by value like any other.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import ray
import torch

from torchrl_vllm_ext.errors import WeightSyncError
from torchrl_vllm_ext.weight_sync.params import expected_specs, torch_dtype
from torchrl_vllm_ext.weight_sync.report import SyncReport
from torchrl_vllm_ext.weight_sync.scheme import WeightSyncScheme

logger = logging.getLogger(__name__)


def collect(weights: Iterable) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` from an iterator of ``(name, tensor)``; a typed error for
    anything else or a name given twice.

    Examples:
        >>> sorted(collect(iter([("a", torch.zeros(1)), ("b", torch.ones(2))])))
        ['a', 'b']
    """
    if isinstance(weights, dict):
        weights = weights.items()
    out: dict[str, torch.Tensor] = {}
    for i, item in enumerate(weights):
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor)):
            raise WeightSyncError(
                f"update_weights: item {i} is {type(item).__name__}, not a (name, tensor) pair; "
                "pass iter(model.state_dict().items())."
            )
        name, tensor = item
        if name in out:
            raise WeightSyncError(f"update_weights: parameter {name!r} is given twice.")
        out[str(name)] = tensor
    return out


def decoder_names_to_checkpoint(tensors: dict[str, torch.Tensor], expected) -> dict:
    """``tensors`` named as the checkpoint names them.

    TorchRL's ``vLLMUpdaterV2.push_weights_from_transformers(model)`` takes ``model.model``
    when it has one (meant for a ``TransformersWrapper``): given a transformers causal LM
    it sends the decoder's weights, without the ``model.`` prefix and the LM head. Those
    names get their prefix back; a missing LM head is then named by the validation.

    Examples:
        >>> t = torch.zeros(1)
        >>> sorted(decoder_names_to_checkpoint({"norm.weight": t}, {"model.norm.weight": 0}))
        ['model.norm.weight']
    """
    if not tensors or any(n in expected for n in tensors):
        return tensors
    if all(f"model.{n}" in expected for n in tensors):
        logger.info(
            "update_weights got the decoder's names (TorchRL's updater sent model.model of a "
            "transformers model); mapping them to the checkpoint's 'model.' names"
        )
        return {f"model.{n}": t for n, t in tensors.items()}
    return tensors


class EngineUpdates:
    """TorchRL's engine calls over one scheme of ``service`` (made on first use)."""

    def __init__(self, service):
        self.service = service
        self._scheme: WeightSyncScheme | None = None
        self.last_report: SyncReport | None = None

    @property
    def scheme(self) -> WeightSyncScheme:
        if self._scheme is None:
            self._scheme = WeightSyncScheme(self.service)
        return self._scheme

    def metadata(self) -> dict[str, tuple[torch.dtype, torch.Size]]:
        specs = expected_specs(self.service.config.model)
        return {n: (torch_dtype(s.dtype), torch.Size(s.shape)) for n, s in specs.items()}

    def master_address(self) -> str:
        return ray.util.get_node_ip_address()

    def master_port(self) -> int:
        """The port of the scheme's broadcast group once formed, else 0."""
        port = self._scheme.transport_impl.group_port if self._scheme is not None else None
        return port or 0

    def connect(self) -> None:
        self.service.run(self.scheme.aconnect())

    def update(self, weights: Iterable) -> SyncReport:
        tensors = decoder_names_to_checkpoint(collect(weights), self.scheme.expected)
        self.last_report = self.scheme.torchrl.push(tensors)
        return self.last_report

    def close(self) -> None:
        if self._scheme is not None:
            self._scheme.close()
            self._scheme = None


__all__ = ["EngineUpdates", "collect"]

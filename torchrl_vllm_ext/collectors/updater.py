"""WeightSyncUpdater: TorchRL's collector weight-update hook over our WeightSyncScheme.

``LLMCollector`` (torchrl 0.14) takes only a legacy ``WeightUpdaterBase`` as its
weight path (``weight_updater=``), so this is one: ``collector.update_policy_weights_(model)``
pushes ``model`` into every replica through the scheme, as the version the collector is
about to move to. The collector then bumps its own ``PolicyVersion`` once, and the
engine's weight version and TorchRL's ``policy_version`` agree.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

from tensordict import TensorDictBase
from torch import nn

from torchrl_vllm_ext.errors import ConfigurationError
from torchrl_vllm_ext.weight_sync.torchrl.pushes import tracked_version

with warnings.catch_warnings():
    # NOTE: subclassing WeightUpdaterBase warns that it is deprecated in favour of
    # WeightSyncScheme, but LLMCollector in torchrl 0.14 accepts nothing else.
    warnings.simplefilter("ignore", DeprecationWarning)
    from torchrl.collectors import WeightUpdaterBase

    class WeightSyncUpdater(WeightUpdaterBase):
        """Push trainer weights through a :class:`~torchrl_vllm_ext.WeightSyncScheme` from a collector.

        ``collector.update_policy_weights_(weights)`` (an ``nn.Module``, a state dict or a
        TensorDict keyed by Hugging Face names) blocks until every replica serves them as
        version ``collector.policy_version + 1``; the collector then increments its
        ``PolicyVersion`` to that number. Samples collected afterwards carry the same
        version under ``("next", "policy_version")`` (TorchRL's counter) and
        ``("vllm", "weight_version")`` (the engine's, as a string).

        Without version tracking on the collector the updater counts pushes itself,
        starting at 1. UUID versions (``PolicyVersion(version_type="uuid")``) cannot be
        predicted before the bump and are rejected.

        Args:
            scheme: the :class:`~torchrl_vllm_ext.WeightSyncScheme` of the policy's service.

        Examples:
            >>> from torchrl.collectors.llm import LLMCollector
            >>> from torchrl_vllm_ext import TokenCopyEnv, VLLMPolicy, WeightSyncScheme
            >>> scheme = WeightSyncScheme(service, transport="storage")  # doctest: +SKIP
            >>> collector = LLMCollector(
            ...     TokenCopyEnv(batch_size=(4,)),
            ...     policy=VLLMPolicy(service, input_mode="tokens", sampling_params={"max_tokens": 8}),
            ...     dialog_turns_per_batch=4,
            ...     weight_updater=WeightSyncUpdater(scheme),
            ...     track_policy_version=True,
            ... )  # doctest: +SKIP
            >>> batch = next(iter(collector))  # doctest: +SKIP
            >>> collector.update_policy_weights_(trainer_model)  # doctest: +SKIP
            >>> collector.policy_version, scheme.version  # doctest: +SKIP
            (1, '1')
        """

        def __init__(self, scheme):
            self.scheme = scheme
            self.last_report = None

        @property
        def pushes(self):
            """The scheme's TorchRL adapter (versions and their one counter), or in a
            process the updater was shipped to, the owner's, forwarded."""
            return self.scheme if isinstance(self.scheme, ForwardedPush) else self.scheme.torchrl

        # NOTE: no ``register_post_hook(collector.increment_version)`` here, unlike
        # torchrl's vLLMUpdater: Collector.update_policy_weights_ already increments
        # after the push, and a post-hook would bump twice per update.

        def all_worker_ids(self) -> None:
            # One push reaches every replica of the service: no per-worker loop.
            return None

        def _maybe_map_weights(self, policy_or_weights):
            if isinstance(policy_or_weights, nn.Module | Mapping | TensorDictBase):
                return policy_or_weights  # the scheme unwraps TorchRL and PEFT models
            raise ConfigurationError(
                "collector.update_policy_weights_ needs the trainer's weights: pass the "
                "transformers model (or TorchRL's TransformersWrapper, or a PEFT model), its "
                f"state dict or a TensorDict of them, got {type(policy_or_weights).__name__} "
                "(the vLLM policy holds no weights to read)."
            )

        def _sync_weights_with_worker(self, *, worker_id=None, server_weights) -> None:
            self.last_report = self.pushes.push(server_weights, tracked_version(self.collector))

        def __reduce__(self):
            # Shipped into a Ray actor (TorchRL's RayLLMCollector): the owner of the
            # service exports the scheme's push, which the copy calls through the service.
            pushes = self.pushes
            if not isinstance(pushes, ForwardedPush):
                pushes = ForwardedPush(self.scheme.service, self.scheme.service.export(pushes.push))
            return WeightSyncUpdater, (pushes,)


class ForwardedPush:
    """A scheme's TorchRL pushes in another process: run by the service's owner with the
    adapter it exported (the weights travel to the owner, which versions and pushes them).

    Args:
        service: the service (a handle, in the process that pushes).
        key: what the owner's :meth:`~torchrl_vllm_ext.VLLMService.export` returned.
    """

    def __init__(self, service, key: str):
        self.service = service
        self.key = key

    def push(self, weights, policy_version: int | None = None):
        return self.service.call_exported(self.key, weights, policy_version)


__all__ = ["ForwardedPush", "WeightSyncUpdater"]

"""AsyncCollection: TorchRL's LLMCollector running free into a replay buffer, staleness-bounded.

The collector is TorchRL's own: ``LLMCollector(..., replay_buffer=rb)`` and its
``start()`` thread, which extends ``rb`` batch after batch while the trainer samples it
and pushes weights with ``update_policy_weights_``. This module only adds the bound on
how old a sample may be (:mod:`.staleness`) and one owner for the thread's lifetime.
"""

from __future__ import annotations

import logging
import warnings

from torchrl_vllm_ext.collectors.staleness import (
    STALENESS_MODES,
    StalenessFilter,
    StalenessGate,
)
from torchrl_vllm_ext.collectors.updater import WeightSyncUpdater
from torchrl_vllm_ext.errors import CollectionStoppedError, ConfigurationError

logger = logging.getLogger(__name__)


class AsyncCollection:
    """Collect rollouts into a replay buffer in the background, at most ``max_policy_lag`` stale.

    ``staleness="drop"`` puts a :class:`StalenessFilter` first in the buffer's transforms:
    stale rows are dropped when written and when sampled. ``staleness="wait"`` puts a
    :class:`StalenessGate` in front of the policy (the collector waits before a batch that
    would run too far ahead of the trainer) *and* the filter, as a safety net for a
    trainer that does not consume one batch per version.

    The trainer's version is the collector's ``policy_version``, moved by
    ``update_policy_weights_`` (:class:`WeightSyncUpdater` pushes through ``scheme``).

    If the collector thread ends with an error (the env, the policy, the buffer raised),
    TorchRL's thread dies quietly and the buffer stops growing; here the error is logged
    and ``update_policy_weights_``, :meth:`check` and leaving the ``with`` block raise
    :class:`~torchrl_vllm_ext.CollectionStoppedError` from it.

    Args:
        env: a TorchRL LLM env (e.g. :class:`~torchrl_vllm_ext.TokenCopyEnv`).
        policy: the :class:`~torchrl_vllm_ext.VLLMPolicy`.
        scheme: the :class:`~torchrl_vllm_ext.WeightSyncScheme` weights are pushed through.
        replay_buffer: a TorchRL ``ReplayBuffer`` (``LazyStackStorage`` for ragged rows).
        dialog_turns_per_batch: rows per collector batch (one ``extend``).
        max_policy_lag: largest accepted trainer version minus generating version.
        staleness: ``"drop"`` or ``"wait"``.

    Examples:
        >>> from torchrl.data import LazyStackStorage, ReplayBuffer
        >>> rb = ReplayBuffer(storage=LazyStackStorage(256))
        >>> with AsyncCollection(
        ...     TokenCopyEnv(batch_size=(4,)), policy, scheme, rb,
        ...     dialog_turns_per_batch=4, max_policy_lag=1, staleness="wait",
        ... ) as collection:  # doctest: +SKIP
        ...     for step in range(10):
        ...         batch = rb.sample(4)
        ...         train(model, batch)
        ...         collection.update_policy_weights_(model)
    """

    def __init__(
        self,
        env,
        policy,
        scheme,
        replay_buffer,
        *,
        dialog_turns_per_batch: int,
        max_policy_lag: int = 1,
        staleness: str = "drop",
    ):
        from torchrl.collectors.llm import LLMCollector

        if staleness not in STALENESS_MODES:
            raise ConfigurationError(
                f"staleness={staleness!r} is not one of {STALENESS_MODES}: 'drop' throws stale "
                "samples away, 'wait' holds collection back."
            )
        self.staleness = staleness
        self.error: BaseException | None = None
        """What ended the collector thread, if an error did."""
        self.replay_buffer = replay_buffer
        self.updater = WeightSyncUpdater(scheme)
        self.filter = StalenessFilter(self.current_version, max_policy_lag)
        # First: it reads rows as stored and runs last on a write, so no inverse transform
        # of the user's gets the None that an all-stale write becomes.
        replay_buffer.insert_transform(0, self.filter)
        self.gate = None
        if staleness == "wait":
            self.gate = StalenessGate(self.current_version, max_policy_lag)
            policy = self.gate.wrap(policy)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # legacy weight_updater path
            # TorchRL 0.14 warns for any module policy on an env without InitTracker, and
            # LLMCollector takes no ``auto_register_policy_transforms`` to answer it with.
            warnings.filterwarnings("ignore", "The env passed to LLMCollector is missing")
            self.collector = LLMCollector(
                env,
                policy=policy,
                dialog_turns_per_batch=dialog_turns_per_batch,
                replay_buffer=replay_buffer,
                weight_updater=self.updater,
                track_policy_version=True,
            )

    def current_version(self) -> int:
        """The trainer's version: the collector's ``policy_version``."""
        return self.collector.policy_version

    @property
    def dropped(self) -> int:
        """Rows the staleness filter removed so far."""
        return self.filter.dropped

    def start(self) -> AsyncCollection:
        """Start TorchRL's collection thread; returns ``self``."""
        # TorchRL's ``start()`` runs ``_run_iterator`` in its thread and lets an error end
        # the thread unseen: run it through ``_record`` (torchrl 0.14's name; without it,
        # the thread is started as it is).
        run = getattr(self.collector, "_run_iterator", None)
        if run is not None:
            self.collector._run_iterator = lambda: self._record(run)
        self.collector.start()
        return self

    def _record(self, run) -> None:
        try:
            run()
        except BaseException as e:  # the thread's end: kept for the trainer's thread
            self.error = e
            logger.error("the collector thread stopped: %s: %s", type(e).__name__, e, exc_info=e)

    def check(self) -> None:
        """Raise :class:`~torchrl_vllm_ext.CollectionStoppedError` if the collector thread
        ended with an error."""
        if self.error is not None:
            raise CollectionStoppedError(
                f"the collector thread stopped with {type(self.error).__name__}: "
                f"{self.error}; the buffer receives nothing more. Fix the cause and start a "
                "new AsyncCollection."
            ) from self.error

    def update_policy_weights_(self, weights):
        """Push ``weights`` as the next version (blocks); returns the :class:`SyncReport`."""
        self.check()
        self.collector.update_policy_weights_(weights)
        return self.updater.last_report

    def shutdown(self, timeout: float = 120.0) -> None:
        """Stop the thread (after its in-flight batch) and release the collector."""
        if self.gate is not None:
            self.gate.close()
        self.collector.async_shutdown(timeout=timeout)

    def __enter__(self) -> AsyncCollection:
        return self.start()

    def __exit__(self, exc_type, *exc) -> None:
        self.shutdown()
        if exc_type is None:  # an error of the trainer's own goes first
            self.check()


__all__ = ["AsyncCollection"]

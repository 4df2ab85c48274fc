"""RolloutQueue: a producer thread that keeps collecting batches into a queue, in order.

The asynchronous GRPO loop (``torchrl-vllm demo --async``) trains on batch ``b`` while the
rollout side generates batch ``b + 1``: the producer thread pulls batches out of any
iterator (TorchRL's ``LLMCollector``) and puts them in a bounded FIFO queue, which the
trainer reads with :meth:`RolloutQueue.get`. An optional :class:`StalenessGate` holds the
producer before a batch that would run more than ``max_policy_lag`` versions ahead of the
trainer (the ``wait`` policy). :class:`BusyClock` measures each side's busy time, from
which the idle ratios of the job are computed.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from torchrl_vllm_ext.collectors.staleness import StalenessGate
from torchrl_vllm_ext.errors import CollectionStoppedError, ConfigurationError

logger = logging.getLogger(__name__)


class BusyClock:
    """Total seconds spent inside :meth:`busy` blocks, read by any thread at any time.

    ``seconds()`` includes the block in progress, so the busy share of any window is
    ``(seconds(at end) - seconds(at start)) / window``.

    Examples:
        >>> clock = BusyClock()
        >>> with clock.busy():
        ...     time.sleep(0.01)
        >>> clock.seconds() >= 0.01
        True
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._total = 0.0
        self._since: float | None = None

    @contextlib.contextmanager
    def busy(self):
        with self._lock:
            self._since = time.perf_counter()
        try:
            yield
        finally:
            with self._lock:
                self._total += time.perf_counter() - self._since
                self._since = None

    def seconds(self) -> float:
        """Busy seconds so far, the block in progress included."""
        with self._lock:
            running = 0.0 if self._since is None else time.perf_counter() - self._since
            return self._total + running


@dataclass(frozen=True)
class QueuedBatch:
    """One collected batch and when the producer made it."""

    index: int
    """Its place in the stream (0, 1, ...): batches are consumed in this order."""
    batch: object
    """What the iterator yielded (a TensorDict)."""
    generate_s: float
    """Seconds the iterator took to produce it (generation + reward)."""
    gate_wait_s: float
    """Seconds the producer waited at the staleness gate before starting it."""


class RolloutQueue:
    """Collect batches from ``batches`` in a thread into a queue of at most ``maxsize``.

    Args:
        batches: an iterator of batches (``iter(LLMCollector(...))``); it is only ever
            advanced by the producer thread.
        maxsize: batches that may wait in the queue (the producer blocks when it is full:
            at most ``maxsize + 1`` batches are ahead of the trainer).
        gate: a :class:`StalenessGate` the producer passes before each batch (``wait``
            policy); None: only ``maxsize`` bounds how far it runs ahead.

    ``get()`` returns the next :class:`QueuedBatch` in order, and raises
    :class:`~torchrl_vllm_ext.CollectionStoppedError` if the producer ended with an
    error. ``close()`` (or leaving the ``with`` block) stops the thread after the batch
    in progress and joins it. ``clock`` is the producer's busy time (inside
    ``next(batches)``).

    Examples:
        >>> with RolloutQueue(iter(range(5)), maxsize=2) as rollouts:
        ...     [rollouts.get().batch for _ in range(3)]
        [0, 1, 2]
    """

    def __init__(self, batches: Iterator, *, maxsize: int = 1, gate: StalenessGate | None = None):
        if isinstance(maxsize, bool) or not isinstance(maxsize, int) or maxsize < 1:
            raise ConfigurationError(f"maxsize={maxsize!r} must be an int >= 1.")
        self.batches = batches
        self.gate = gate
        self.clock = BusyClock()
        self.error: BaseException | None = None
        self._queue: queue.Queue = queue.Queue(maxsize=maxsize)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, name="rollout-queue", daemon=True)
        self._started = False

    def start(self) -> RolloutQueue:
        self._thread.start()
        self._started = True
        return self

    def _produce(self) -> None:
        index = 0
        try:
            while not self._stop.is_set():
                waited = time.perf_counter()
                if self.gate is not None:
                    self.gate.admit()  # released by close() as well
                waited = time.perf_counter() - waited
                if self._stop.is_set():
                    return
                with self.clock.busy():
                    t0 = time.perf_counter()
                    try:
                        batch = next(self.batches)
                    except StopIteration:
                        return
                    item = QueuedBatch(index, batch, time.perf_counter() - t0, waited)
                while not self._stop.is_set():  # a full queue: wait, but hear close()
                    try:
                        self._queue.put(item, timeout=0.05)
                        break
                    except queue.Full:
                        continue
                index += 1
        except BaseException as e:  # the thread's end: handed to the trainer's get()
            self.error = e
            logger.error("the rollout producer stopped: %s: %s", type(e).__name__, e, exc_info=e)
        finally:
            self._stop.set()

    def get(self) -> QueuedBatch:
        """The next batch, in order; blocks until the producer has one."""
        while True:
            try:
                return self._queue.get(timeout=0.05)
            except queue.Empty:
                if self._stop.is_set() and self._queue.empty():
                    if self.error is not None:
                        raise CollectionStoppedError(
                            f"the rollout producer stopped with {type(self.error).__name__}: "
                            f"{self.error}; no more batches will come."
                        ) from self.error
                    raise CollectionStoppedError(
                        "the rollout producer has stopped (closed, or its iterator ended)."
                    ) from None

    def close(self, timeout: float = 120.0) -> None:
        """Stop the producer after the batch in progress and join it."""
        self._stop.set()
        if self.gate is not None:
            self.gate.close()
        if self._started:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("the rollout producer did not stop within %.0f s", timeout)

    def __enter__(self) -> RolloutQueue:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["BusyClock", "QueuedBatch", "RolloutQueue"]

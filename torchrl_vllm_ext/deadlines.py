"""How long a step that moves weights may take before whoever holds it up counts as gone.

No push waits forever: every collective and every wait on a replica during a push has
a deadline that grows with the bytes it moves,

    deadline(nbytes) = fixed_s + nbytes / min_bytes_per_s

and a replica that has not answered by then is handled like one that died (killed,
recorded, restarted at the live weights) and named in a typed error. Calls that move
no weights (staging a header, polling a receive) must be answered within
``answer_s = fixed_s / 2``, so a replica frozen in the middle of a transfer is found
well within the transfer's deadline.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchrl_vllm_ext.errors import ConfigurationError


@dataclass(frozen=True)
class Deadline:
    """The deadline of a step that moves ``nbytes``: ``fixed_s + nbytes / min_bytes_per_s``.

    Examples:
        >>> d = Deadline(fixed_s=60.0, min_bytes_per_s=50e6)
        >>> d.for_bytes(14e9)  # a 7B model in bf16
        340.0
        >>> d.for_bytes(0)
        60.0
        >>> d.answer_s  # a poll unanswered this long: the replica is gone
        30.0
    """

    fixed_s: float = 60.0
    """Seconds any step may take whatever its size: Ray round trips, a pause, forming a
    process group, a replica answering a poll."""
    min_bytes_per_s: float = 50e6
    """The slowest rate (bytes per second) at which a healthy replica takes weights in:
    under 1 Gb Ethernet (~110 MB/s), far under shared memory, PCIe or NVLink. A step
    slower than this is a stuck step."""

    def __post_init__(self):
        if not self.fixed_s > 0 or not self.min_bytes_per_s > 0:
            raise ConfigurationError(
                f"Deadline(fixed_s={self.fixed_s}, min_bytes_per_s={self.min_bytes_per_s}): "
                "both must be > 0 (seconds, bytes per second)."
            )

    @property
    def answer_s(self) -> float:
        """Seconds a replica may take to answer a call that moves no weights (a poll)."""
        return self.fixed_s / 2

    def for_bytes(self, nbytes: float) -> float:
        """Seconds a step that moves ``nbytes`` may take."""
        return self.fixed_s + nbytes / self.min_bytes_per_s


__all__ = ["Deadline"]

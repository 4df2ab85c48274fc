"""SessionMap: which replica last served a token sequence, for multi-turn routing.

Turn ``k + 1`` of a chat is turn ``k``'s prompt and reply plus a new message: its longest
prefix is a sequence some replica just served, whose KV blocks sit in that replica's
prefix cache. The map keeps a digest of every block-aligned prefix of the sequences the
service served (prompt + sample, as vLLM hashes full blocks) with the replica that served
it; a new prompt goes to the replica of its longest known prefix. Bounded (LRU).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterator, Sequence

import numpy as np

BLOCK_TOKENS = 16
"""Prefix granularity: vLLM's default KV block size (its prefix cache hashes full blocks)."""
CAPACITY = 200_000
"""Prefix digests kept (least recently used go first)."""


def block_digests(tokens: Sequence[int] | np.ndarray, block: int = BLOCK_TOKENS) -> Iterator[bytes]:
    """Digests of ``tokens[:block]``, ``tokens[:2 * block]``, ... (full blocks only).

    Examples:
        >>> len(list(block_digests(list(range(40)), block=16)))
        2
        >>> next(block_digests([1] * 16)) == next(block_digests([1] * 20))
        True
    """
    ids = np.asarray(tokens, dtype=np.int64)
    running = hashlib.blake2b(digest_size=16)
    for end in range(block, len(ids) + 1, block):
        running.update(ids[end - block : end].tobytes())
        yield running.copy().digest()


class SessionMap:
    """Block-aligned prefix digest -> the replica that last served a sequence with it.

    Examples:
        >>> sessions = SessionMap(block=4)
        >>> sessions.record([1, 2, 3, 4, 5, 6, 7, 8, 9], replica_id=1)
        >>> sessions.lookup([1, 2, 3, 4, 5, 6, 7, 8, 42, 43])  # shares 2 blocks
        1
        >>> sessions.lookup([9, 9, 9, 9, 9]) is None
        True
    """

    def __init__(self, block: int = BLOCK_TOKENS, capacity: int = CAPACITY):
        self.block = block
        self.capacity = capacity
        self._owner: OrderedDict[bytes, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._owner)

    def record(self, tokens: Sequence[int] | np.ndarray, replica_id: int) -> None:
        """``replica_id`` served ``tokens`` (prompt + generated): it holds their blocks."""
        for digest in block_digests(tokens, self.block):
            self._owner[digest] = replica_id
            self._owner.move_to_end(digest)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)

    def record_batch(self, batch) -> None:
        """Record every sample (prompt + its tokens) of a replica's ``RequestBatch``."""
        p_ends = np.cumsum(batch.prompt_lengths)
        s_ends = np.cumsum(batch.sample_lengths)
        sample = 0
        for r, n in enumerate(batch.samples_per_request.tolist()):
            prompt = batch.prompt_token_ids[p_ends[r] - batch.prompt_lengths[r] : p_ends[r]]
            if (
                len(prompt) + int(batch.sample_lengths[sample : sample + n].max(initial=0))
                < self.block
            ):
                sample += n
                continue  # not one full block: nothing to route on
            rid = int(batch.replica_ids[r])
            for s in range(sample, sample + n):
                tokens = batch.token_ids[s_ends[s] - batch.sample_lengths[s] : s_ends[s]]
                self.record(np.concatenate([prompt, tokens]), rid)
            sample += n

    def lookup(self, prompt: Sequence[int] | np.ndarray) -> int | None:
        """The replica that served the longest block-aligned prefix of ``prompt``, if any."""
        found = None
        for digest in block_digests(prompt, self.block):
            owner = self._owner.get(digest)
            if owner is None:
                break  # a longer prefix cannot be known if this one is not
            found = owner
        return found

    def forget(self, replica_id: int) -> None:
        """Drop a replica that died or left (its cache is gone)."""
        for digest in [d for d, r in self._owner.items() if r == replica_id]:
            del self._owner[digest]


__all__ = ["BLOCK_TOKENS", "SessionMap", "block_digests"]

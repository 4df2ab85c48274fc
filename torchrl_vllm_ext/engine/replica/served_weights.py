"""ServedWeights: what a replica's actor records about the weights it serves (their version
label, the prefix-cache epoch, the probes sent, where requests in flight switched weights),
one object the actor holds and hands to its worker calls."""

from __future__ import annotations

import os
from collections.abc import Iterable

from torchrl_vllm_ext.batches import Switch


class ServedWeights:
    """The weights a replica serves, as its actor knows them.

    Args:
        replica_id: the replica (named in probe ids).
        version: the weight version label the replica starts with.

    Examples:
        >>> from torchrl_vllm_ext.batches import EVERY_SAMPLE
        >>> weights = ServedWeights(replica_id=3, version="0")
        >>> weights.cache_salt
        'e0'
        >>> weights.changed(); weights.cache_salt
        'e1'
        >>> weights.switched({("req-a", 0): 5, ("req-b", EVERY_SAMPLE): 0}, "1")
        >>> weights.switched({("req-a", 0): 9}, "2")
        >>> weights.take_switches(["req-a"])
        {('req-a', 0): [('1', 5), ('2', 9)]}
        >>> weights.take_switches(["req-a"]) is None
        True
    """

    def __init__(self, replica_id: int, version: str):
        self.replica_id = replica_id
        self.version = str(version)
        """The weight version label the replica serves."""
        # Bumped whenever the weights change (a load, a reset): prefix-cache entries are
        # salted with it, so none computed with older weights serves a later request,
        # while a new label alone (an adapter push) keeps the base model's cache.
        self._cache_epoch = 0
        self._probes = 0  # probe requests sent (their ids and cache salts stay unique)
        # For requests in flight across weight changes: every switch of each sample
        # (request id, sample index or EVERY_SAMPLE), in order (see pack_outputs).
        self._switches: dict[tuple[str, int], list[Switch]] = {}

    @property
    def cache_salt(self) -> str:
        """The prefix-cache salt of requests sent now (changes with the weights)."""
        return f"e{self._cache_epoch}"

    def changed(self) -> None:
        """The weights changed (a load, a reset): no prefix-cache entry computed before
        serves a request sent after."""
        self._cache_epoch += 1

    def relabel(self, version: str) -> None:
        """The engine serves its weights as ``version`` from now on."""
        self.version = str(version)

    def probe_id(self) -> str:
        """A new probe request's id, unique in this replica process (also its cache salt)."""
        self._probes += 1
        return f"probe-{self.replica_id}-{os.getpid()}-{self._probes}"

    def switched(self, progress: dict[tuple[str, int], int], version: str) -> None:
        """Record where requests in flight go on with the weights labelled ``version``:
        ``progress`` is ``{(request id, sample index or EVERY_SAMPLE): tokens so far}``
        (:meth:`~torchrl_vllm_ext.engine.replica.engine.Engine.tokens_so_far`)."""
        for key, tokens in progress.items():
            self._switches.setdefault(key, []).append((str(version), int(tokens)))

    def take_switches(
        self, request_ids: Iterable[str]
    ) -> dict[tuple[str, int], list[Switch]] | None:
        """Pop the switches recorded for these requests' samples, oldest first (None: none
        recorded)."""
        if not self._switches:
            return None
        ids = set(request_ids)
        mine = [key for key in self._switches if key[0] in ids]
        return {key: self._switches.pop(key) for key in mine} or None

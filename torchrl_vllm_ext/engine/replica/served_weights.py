"""ServedWeights: what a replica's actor records about the weights it serves (their version
label, the prefix-cache epoch, the probes sent, where kept requests switched weights), one
object the actor holds and hands to its worker calls."""

from __future__ import annotations

import os
from collections.abc import Iterable


class ServedWeights:
    """The weights a replica serves, as its actor knows them.

    Args:
        replica_id: the replica (named in probe ids).
        version: the weight version label the replica starts with.

    Examples:
        >>> weights = ServedWeights(replica_id=3, version="0")
        >>> weights.cache_salt
        'e0'
        >>> weights.changed(); weights.cache_salt
        'e1'
        >>> weights.switched({("req-a", 0): 5}); weights.take_switches(["req-a", "req-b"])
        {('req-a', 0): 5}
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
        # For requests a keep-mode update spanned: the tokens each sample (request id,
        # sample index) had when the newest weights came in (see pack_outputs).
        self._end_version_from: dict[tuple[str, int], int] = {}

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

    def switched(self, progress: dict[tuple[str, int], int]) -> None:
        """Record where kept requests go on with the new weights: ``{(request id, sample):
        tokens so far}``."""
        self._end_version_from.update(progress)

    def take_switches(self, request_ids: Iterable[str]) -> dict[tuple[str, int], int] | None:
        """Pop the switches recorded for these requests' samples (None: none recorded)."""
        if not self._end_version_from:
            return None
        ids = set(request_ids)
        mine = [key for key in self._end_version_from if key[0] in ids]
        return {key: self._end_version_from.pop(key) for key in mine}

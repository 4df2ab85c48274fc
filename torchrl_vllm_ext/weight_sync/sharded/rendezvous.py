"""The ranks of a sharded push meeting at each step, through a key-value store of their own.

Why not the trainer's process group: a collective on it waits forever (or for the group's
timeout, 30 minutes by default) for a rank that died, and says nothing of which; and the
push's small messages must never interleave with the trainer's own collectives (FSDP2's
all-gathers, a broadcast to the replicas). So rank 0 serves a ``TCPStore`` and every rank
posts under ``<push>/<step>/<rank>``; a wait polls until every rank posted or the step's
deadline passes, then names the ranks that did not. A rank that failed posts its error
instead of its value, and every rank raises the same :class:`ShardedPushError`.

The store listens on the host it is given only (:mod:`torchrl_vllm_ext.listening`), and
what the ranks post is JSON: a process that reaches the port can read or spoil a push's
coordination, never run code in a rank.
"""

from __future__ import annotations

import json
import logging
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from torchrl_vllm_ext.errors import ShardedPushError
from torchrl_vllm_ext.listening import serve_store

logger = logging.getLogger(__name__)

POLL_S = 0.005
"""Seconds between two looks at the store while waiting."""
_FAILED = "__failed__"


class Rendezvous:
    """Rank 0 of ``group`` serves the store; every rank joins it (a collective call).

    Args:
        group: the trainer's process group (the push's ranks, in its rank order).
        host: where rank 0's store listens: ``MASTER_ADDR`` when set (torchrun's, which
            every rank reaches), else the loopback (one host).
    """

    def __init__(self, group=None, host: str | None = None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        host = host or os.environ.get("MASTER_ADDR", "127.0.0.1")
        timeout = timedelta(seconds=30)
        if self.rank == 0:
            self.store = serve_store(host, timeout)
            address = json.dumps([host, self.store.port])
        leader = dist.get_global_rank(group or dist.group.WORLD, 0)
        address = broadcast_text(address if self.rank == 0 else "", leader, group)
        if self.rank != 0:
            host, port = json.loads(address)
            self.store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
        self.push = 0
        """The push the ranks are at (every rank counts its own calls)."""
        self._posted: dict[int, list[str]] = {}
        """This rank's keys, by push."""
        self.gone: set[int] = set()
        """Ranks that missed a step's deadline (not waited for again at :meth:`close`)."""

    def next_push(self) -> None:
        """A new push. This rank's keys of the push before last go: every rank is past it
        (each began the last push, which waits for every rank), while the last push's may
        still be read by a rank that has not returned from it."""
        self.push += 1
        for key in self._posted.pop(self.push - 2, []):
            self._delete(key)

    def _key(self, step: str, rank: int) -> str:
        return f"{self.push}/{step}/{rank}"

    def _delete(self, key: str) -> None:
        try:
            self.store.delete_key(key)
        except Exception as e:
            # Only cleanup: the store went with rank 0's process and every key with it; a
            # push that still needs the store raises at its next step (_leader_gone).
            logger.debug("key %s not deleted: rank 0's store is gone (%s)", key, e)

    def post(self, step: str, value) -> None:
        """Post this rank's ``value`` (JSON) for ``step``."""
        self._set(step, json.dumps(value))

    def fail(self, step: str, error: BaseException) -> None:
        """Post this rank's error for ``step`` (every rank then raises it)."""
        self._set(step, json.dumps({_FAILED: f"{type(error).__name__}: {error}"}))

    def _set(self, step: str, text: str) -> None:
        key = self._key(step, self.rank)
        try:
            self.store.set(key, text)
        except Exception as e:
            raise self._leader_gone(step, e) from e
        self._posted.setdefault(self.push, []).append(key)

    def gather(self, step: str, deadline_s: float, ranks=None) -> list:
        """Every rank's value for ``step`` (in rank order), once all posted; a
        :class:`ShardedPushError` naming the ranks that posted an error, or that had not
        posted within ``deadline_s``."""
        ranks = list(range(self.world)) if ranks is None else list(ranks)
        keys = [self._key(step, r) for r in ranks]
        end = time.monotonic() + deadline_s
        while True:
            try:
                if self.store.check(keys):
                    break
                posted = [r for r, k in zip(ranks, keys, strict=True) if self.store.check([k])]
            except Exception as e:
                raise self._leader_gone(step, e) from e
            if time.monotonic() >= end:
                missing = tuple(r for r in ranks if r not in posted)
                self.gone.update(missing)
                raise ShardedPushError(
                    f"sharded push {self.push}: rank(s) {list(missing)} did not reach step "
                    f"{step!r} within {deadline_s:.1f}s (dead, stuck, or not calling the push "
                    "at the same point of the loop); nothing was published, the replicas keep "
                    "their previous weights. Restart the trainer's ranks, or raise the deadline.",
                    missing,
                )
            time.sleep(POLL_S)
        try:
            values = [json.loads(self.store.get(k)) for k in keys]
        except Exception as e:
            raise self._leader_gone(step, e) from e
        failed = [(r, v[_FAILED]) for r, v in zip(ranks, values, strict=True) if _is_failure(v)]
        if failed:
            raise ShardedPushError(
                "; ".join(f"rank {r}: {message}" for r, message in failed),
                tuple(r for r, _ in failed),
            )
        return values

    def one(self, step: str, rank: int, deadline_s: float):
        """``rank``'s value for ``step`` (its error raised as every rank's)."""
        return self.gather(step, deadline_s, ranks=[rank])[0]

    def _leader_gone(self, step: str, error: BaseException) -> ShardedPushError:
        return ShardedPushError(
            f"sharded push {self.push}: rank 0 (which talks to the service) is gone at step "
            f"{step!r} ({type(error).__name__}: {error}): its process ended, often on an "
            "error of its own, which its log names. The replicas keep the last version rank "
            "0 published. Restart the trainer's ranks.",
            (0,),
        )

    def close(self, wait_s: float = 30.0) -> None:
        """Leave: every rank says so, and rank 0, whose process serves the store, waits
        (up to ``wait_s``) until the others did, so none loses the store while it still
        reads the last push's result. Idempotent."""
        if self.store is None:
            return
        others = [r for r in range(self.world) if r != self.rank and r not in self.gone]
        try:
            self.post("closed", None)
            if self.rank == 0 and others:
                self.gather("closed", wait_s, ranks=others)
        except ShardedPushError as e:
            logger.warning("closing the sharded push's store: %s", e)
        # No key is deleted: rank 0's store goes with it, once the others left.
        self._posted = {}
        self.store = None


ADDRESS_BYTES = 1024
"""Room for the store's address (host and port, as JSON) in the one broadcast that
hands it to the other ranks."""


def broadcast_text(text: str, src: int, group=None) -> str:
    """``text`` of rank ``src`` (a global rank) on every rank of ``group``: UTF-8 bytes in
    one fixed-size tensor broadcast (torch's object broadcast would unpickle what it
    receives). On the group's device: the current GPU for NCCL, else the host."""
    data = text.encode()
    if len(data) > ADDRESS_BYTES:
        raise ValueError(f"{len(data)} bytes do not fit the {ADDRESS_BYTES}-byte broadcast")
    device = "cpu"
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    buf = torch.zeros(ADDRESS_BYTES + 8, dtype=torch.uint8, device=device)
    buf[:8] = torch.tensor(list(len(data).to_bytes(8, "little")), dtype=torch.uint8)
    if data:
        buf[8 : 8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    dist.broadcast(buf, src=src, group=group)
    raw = bytes(buf.cpu().tolist())
    return raw[8 : 8 + int.from_bytes(raw[:8], "little")].decode()


def _is_failure(value) -> bool:
    return isinstance(value, dict) and _FAILED in value

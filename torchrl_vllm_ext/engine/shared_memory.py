"""Anonymous shared memory between the driver and the replicas on its node, with no file.

An adapter push packs its tensors into :class:`SharedSlots` (a ``memfd``: memory with no
name on any file system, gone with the last process that maps it), and a replica on the
driver's node reads them through a :class:`SharedRegion`: it maps the driver's memfd by
``/proc/<pid>/fd/<fd>`` once and keeps the mapping, so a push costs it one copy out of
pages that are already mapped. Ray's object store, the other way, costs a ``ray.put`` of
the whole buffer per push (~5-12 ms for 16 MB on 2 cores: a fresh object, its pages
faulted in, then read by each replica through its own fresh mapping).

Linux only (``os.memfd_create``); elsewhere, or where a replica may not open the
driver's descriptors, adapters go through Ray's object store as before.
"""

from __future__ import annotations

import mmap
import os
import threading
import weakref
from collections import OrderedDict
from dataclasses import astuple, dataclass

import numpy as np

_KEPT_MAPPINGS = 4
"""Mappings of other processes' memfds a process keeps (least recently used dropped)."""


@dataclass(frozen=True)
class SharedRegion:
    """``nbytes`` at ``offset`` of the memfd ``fd`` of process ``pid`` (plain data: it
    crosses Ray and vLLM's RPC as a tuple, :meth:`as_tuple`)."""

    pid: int
    fd: int
    inode: int
    """The memfd's inode: a descriptor number reused for something else is refused."""
    size: int
    """The whole memfd's bytes (what a reader maps)."""
    offset: int
    nbytes: int

    def as_tuple(self) -> tuple[int, ...]:
        return astuple(self)

    def readable(self) -> bool:
        """Whether this process can map the region (same node, may open the descriptor)."""
        try:
            _mapping(self)
        except (OSError, ValueError):
            return False
        return True

    def read(self) -> memoryview:
        """The region's bytes, through this process's mapping of the memfd (kept)."""
        return memoryview(_mapping(self))[self.offset : self.offset + self.nbytes]


_mappings: OrderedDict[tuple[int, int, int, int], mmap.mmap] = OrderedDict()
_lock = threading.Lock()


def _mapping(region: SharedRegion) -> mmap.mmap:
    """This process's read-only mapping of ``region``'s memfd (mapped once, then kept)."""
    key = (region.pid, region.fd, region.inode, region.size)
    with _lock:
        mapping = _mappings.get(key)
        if mapping is None:
            mapping = _map(region)
            _mappings[key] = mapping
            while len(_mappings) > _KEPT_MAPPINGS:
                _mappings.popitem(last=False)  # closed once no view of it remains
        _mappings.move_to_end(key)
        return mapping


def _map(region: SharedRegion) -> mmap.mmap:
    if region.pid == os.getpid():
        fd = os.dup(region.fd)
    else:
        fd = os.open(f"/proc/{region.pid}/fd/{region.fd}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        stat = os.fstat(fd)
        if stat.st_ino != region.inode or stat.st_size < region.size:
            raise ValueError(
                f"descriptor {region.fd} of process {region.pid} is no longer the adapter "
                "buffer it named"
            )
        # MAP_POPULATE: every page mapped now, not faulted in at the first copy (~2 ms
        # per 16 MB, on every replica)
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        return mmap.mmap(fd, region.size, flags=flags, prot=mmap.PROT_READ)
    finally:
        os.close(fd)


def available() -> bool:
    """Whether this platform has memfds (Linux)."""
    return hasattr(os, "memfd_create")


class SharedSlots:
    """``count`` slots of ``nbytes`` each in one memfd of this process, zeroed.

    Examples:
        >>> slots = SharedSlots(2, 64)
        >>> slots.array(1)[:3] = [1, 2, 3]
        >>> bytes(slots.region(1, 3).read())
        b'\\x01\\x02\\x03'
    """

    def __init__(self, count: int, nbytes: int):
        self.count, self.nbytes = count, nbytes
        size = max(count * nbytes, 1)
        fd = os.memfd_create("torchrl-vllm-adapter", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self._fd, self._inode, self._size = fd, os.fstat(fd).st_ino, size
        np.frombuffer(self._map, dtype=np.uint8).fill(0)  # every page allocated now, once
        # The descriptor closes with this object; the memory, once no mapping is left.
        weakref.finalize(self, os.close, fd)

    def array(self, slot: int) -> np.ndarray:
        """Slot ``slot`` as a writable uint8 array."""
        whole = np.frombuffer(self._map, dtype=np.uint8)
        return whole[slot * self.nbytes : (slot + 1) * self.nbytes]

    def region(self, slot: int, nbytes: int) -> SharedRegion:
        """The first ``nbytes`` of slot ``slot``, for a replica to read."""
        return SharedRegion(
            os.getpid(), self._fd, self._inode, self._size, slot * self.nbytes, nbytes
        )


__all__ = ["SharedRegion", "SharedSlots", "available"]

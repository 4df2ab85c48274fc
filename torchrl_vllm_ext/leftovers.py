"""What the package leaves on a machine: who owns each of its directories, and reaping.

Every directory the package creates for itself (storage slots, adapter versions, the
adapters a replica was shipped) starts with :data:`PREFIX` and holds a small marker,
:data:`OWNER_FILE`: the host, the owner's pid and that process's start time. Its
owner removes it on ``close()`` and at interpreter exit (:func:`remove_at_exit`); a
process killed with SIGKILL cannot, so the next service, scheme, adapter sync or
replica to start calls :func:`reap`, which removes each of our directories whose owner
is dead: no such pid, or the pid now names a process started at another time. A
directory without a marker, or made on another host, is never touched.

Examples:
    >>> import tempfile
    >>> base = tempfile.mkdtemp()
    >>> d = owned_dir("torchrl-vllm-example-", base)
    >>> owner = read_owner(d)
    >>> owner.pid == os.getpid() and owner.alive()
    True
    >>> reap(base)  # its owner (this process) is alive: kept
    []
    >>> remove_owned(d)
    >>> os.path.exists(d)
    False
    >>> os.rmdir(base)
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import tempfile
import time
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

logger = logging.getLogger(__name__)

PREFIX = "torchrl-vllm-"
"""Every directory the package creates in a shared temp location starts with it."""
OWNER_FILE = ".torchrl-vllm-owner.json"
"""The marker in each such directory: :class:`Owner` as JSON."""
TAG_ENV = "TORCHRL_VLLM_OWNER_TAG"
"""An environment variable whose value markers record (a CI job, a test session), so a
run can tell its own leftovers from those of others on a shared machine."""
_START_TOLERANCE_S = 0.05  # start times come from clock ticks (10 ms): same process if closer


def shm_base() -> Path:
    """Where private directories go: ``/dev/shm`` (page-cache speed) when writable, else
    the temp dir."""
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        return Path("/dev/shm")
    return Path(tempfile.gettempdir())


def process_start(pid: int) -> float | None:
    """The start time (epoch seconds) of process ``pid``; None if there is none (or only
    its zombie: a killed replica waits as one until its parent reaps it)."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc.create_time()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None
    except psutil.AccessDenied:  # alive, someone else's: report it as running now
        return float("nan")


@dataclass(frozen=True)
class Owner:
    """The process a directory belongs to."""

    pid: int
    """Its process id."""
    start: float
    """Its start time (epoch seconds): a later process that reuses the pid differs."""
    host: str
    """The host it runs on (pids mean nothing elsewhere)."""
    tag: str = ""
    """``$TORCHRL_VLLM_OWNER_TAG`` in its environment (empty when unset)."""

    @classmethod
    def me(cls) -> Owner:
        pid = os.getpid()
        return cls(
            pid, process_start(pid) or 0.0, socket.gethostname(), os.environ.get(TAG_ENV, "")
        )

    def alive(self) -> bool:
        """Whether the owner still runs (True when it cannot be told: another host)."""
        if self.host != socket.gethostname():
            return True
        start = process_start(self.pid)
        if start is None:
            return False
        return start != start or abs(start - self.start) < _START_TOLERANCE_S  # nan: alive


def mark(path: str | Path, owner: Owner | None = None) -> None:
    """Record ``owner`` (this process by default) as the owner of directory ``path``."""
    target = Path(path) / OWNER_FILE
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(asdict(owner or Owner.me()), fh)


def read_owner(path: str | Path) -> Owner | None:
    """The owner recorded in directory ``path`` (None: no marker, or not readable)."""
    try:
        return Owner(**json.loads((Path(path) / OWNER_FILE).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def owned_dir(prefix: str, base: str | Path | None = None) -> Path:
    """A new private (0700) directory named ``prefix...`` in ``base`` (default
    :func:`shm_base`), marked as this process's."""
    if not prefix.startswith(PREFIX):
        raise ValueError(f"directory prefix {prefix!r} must start with {PREFIX!r}")
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=base or shm_base()))
    mark(path)
    return path


def remove_owned(path: str | Path) -> None:
    """Remove directory ``path`` if this process owns it (a forked child never does)."""
    owner = read_owner(path)
    if owner is None or owner.pid != os.getpid():
        if os.path.isdir(path):
            logger.debug("not removing %s: owned by %s", path, owner)
        return
    shutil.rmtree(path, ignore_errors=True)


def adopt_tempdir(prefix: str) -> Path:
    """Make a new owned directory (:func:`owned_dir`) this process's temporary directory
    (``TMPDIR`` and :mod:`tempfile`'s, inherited by the processes it starts); returns it.

    For a replica process, which Ray kills: what vLLM puts in the temporary directory (its
    process group's file-store rendezvous ``vllm_dist_*``, an engine-core process's ZMQ
    sockets) would otherwise outlive a killed replica with no owner to tell. Here it goes
    with the directory: removed by its owner, or by the next :func:`reap` once the owner
    is dead. Torch's compile cache stays where it was (shared by every start).
    """
    # NOTE: torch resolves its inductor cache under the temporary directory, once; resolved
    # now, it keeps the machine-wide cache instead of one that dies with this process. Its
    # C++ precompiled headers' folder is fixed when torch._inductor.codecache is imported:
    # imported later, every start would rebuild them (seconds on 2 cores).
    import torch._inductor.codecache  # noqa: F401
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    cache_dir()
    path = owned_dir(prefix)
    os.environ["TMPDIR"] = str(path)
    tempfile.tempdir = str(path)
    return path


def remove_at_exit(obj: object, path: str | Path) -> weakref.finalize:
    """Remove ``path`` when ``obj`` is garbage collected or the interpreter exits,
    whichever comes first; call the returned finalizer to remove it now."""
    return weakref.finalize(obj, remove_owned, str(path))


@dataclass(frozen=True)
class Leftover:
    """One of our directories on this machine."""

    path: Path
    owner: Owner | None
    """None when it holds no marker (made by an older version, or being created)."""
    alive: bool | None
    """Whether its owner runs (None: unknown, no marker)."""
    nbytes: int
    """Bytes of the files in it."""


def _size(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def leftovers(base: str | Path | None = None) -> list[Leftover]:
    """Our directories in ``base`` (default :func:`shm_base`), with their owners (only
    this user's; symbolic links are never followed)."""
    base = Path(base or shm_base())
    found = []
    try:
        entries = sorted(base.iterdir())
    except OSError:
        return []
    for path in entries:
        if not path.name.startswith(PREFIX) or not path.is_dir() or path.is_symlink():
            continue
        try:
            if path.stat().st_uid != os.getuid():  # another user's: neither ours nor ours to remove
                continue
        except OSError:
            continue
        owner = read_owner(path)
        alive = owner.alive() if owner is not None else None
        found.append(Leftover(path, owner, alive, _size(path)))
    return found


def reap(base: str | Path | None = None) -> list[Path]:
    """Remove our directories in ``base`` whose owner process is dead; the removed paths.

    Called when a service, a weight-sync scheme, an adapter sync or a replica starts.
    """
    removed = []
    for item in leftovers(base):
        if item.alive is False:
            shutil.rmtree(item.path, ignore_errors=True)
            removed.append(item.path)
            logger.info(
                "removed %s (%.1f MB): its owner, pid %d on %s, is gone",
                item.path,
                item.nbytes / 1e6,
                item.owner.pid,
                item.owner.host,
            )
    return removed


def reap_when_gone(paths, timeout: float = 5.0) -> list[Path]:
    """Remove the directories ``paths`` once their owners have died (a process killed a
    moment ago takes a while to go); the removed paths. A directory whose owner still runs
    after ``timeout`` seconds, or on another host, is kept (the next :func:`reap` there).
    """
    pending = [Path(p) for p in paths if p and os.path.isdir(p)]
    removed = []
    deadline = time.monotonic() + timeout
    while pending:
        for path in list(pending):
            owner = read_owner(path)
            if owner is not None and owner.host != socket.gethostname():
                pending.remove(path)
            elif owner is None or not owner.alive():
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
                pending.remove(path)
        if not pending or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    return removed


def release_semaphores() -> int:
    """Unlink the named semaphores (``/dev/shm/sem.mp-*``) of this process's live
    multiprocessing locks; how many. For a process about to be killed (a Ray actor after
    its shutdown): vLLM's executor lock and tqdm's write lock live as long as the
    process, so their names are unlinked only by finalizers at a normal exit, which a
    killed process never reaches. The locks keep working: an open semaphore outlives
    its name.

    Examples:
        >>> import multiprocessing
        >>> lock = multiprocessing.get_context("spawn").Lock()
        >>> release_semaphores() >= 1
        True
        >>> with lock:
        ...     pass
    """
    from multiprocessing import synchronize, util

    released = 0
    for finalizer in list(util._finalizer_registry.values()):
        # NOTE: private registry; each live SemLock of a spawn/forkserver context has a
        # finalizer whose callback unlinks its name and unregisters it from the tracker.
        if getattr(finalizer, "_callback", None) is synchronize.SemLock._cleanup:
            finalizer()
            released += 1
    return released


def thread_only_progress_lock() -> bool:
    """Give tqdm a thread lock in this process, unless it has a lock already; whether it
    set one. tqdm's default lock also holds a multiprocessing ``RLock``: in a spawned
    process (vLLM's engine core under Ray) that is a named semaphore which only a
    finalizer at a normal exit, or the resource tracker, unlinks. A replica killed with
    SIGKILL takes both along (Ray kills a dead worker's children) and leaves a
    ``/dev/shm/sem.mp-*`` behind. vLLM's weight-loading bars take the lock first;
    nothing shares it across processes.
    """
    import threading

    from tqdm import tqdm

    if hasattr(tqdm, "_lock"):
        return False
    tqdm.set_lock(threading.RLock())
    return True


__all__ = [
    "OWNER_FILE",
    "PREFIX",
    "Leftover",
    "Owner",
    "adopt_tempdir",
    "leftovers",
    "mark",
    "owned_dir",
    "read_owner",
    "reap",
    "release_semaphores",
    "remove_at_exit",
    "remove_owned",
    "shm_base",
    "thread_only_progress_lock",
]

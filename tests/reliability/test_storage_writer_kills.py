"""The storage writer SIGKILLed at every step of a publish, many times (no vLLM needed).

Writers run in processes forked from a fork server that has imported torch once, so a
kill round costs milliseconds. Each writer dies at a chosen step of ``SlotWriter.write``
(in the middle of filling the slot, between checksums, before or after the rename, ...)
or after a random delay; a reader must then load a complete slot whose checksums hold:
the last published version, or the new one when the writer died after its rename.
A reader running concurrently with the writers only ever gets a verified slot or a
typed error.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import threading

import pytest
import torch

from torchrl_vllm_ext.errors import WeightSyncError
from torchrl_vllm_ext.weight_sync.transports.storage.slots import (
    SlotReader,
    SlotWriter,
    read_published,
)

NUM_TENSORS = 6
SHAPE = (256, 256)
# Where the writer dies; "after_rename" and "after_fsync_dir" published the new version.
KILL_POINTS = (
    "start",
    "first_tensor",
    "mid_fill",
    "after_fill",
    "manifest_fsync",
    "before_rename",
    "after_rename",
    "after_fsync_dir",
)
PUBLISHED_POINTS = ("after_rename", "after_fsync_dir")


def weights(version: int) -> dict[str, torch.Tensor]:
    return {f"model.layers.{i}.w": torch.full(SHAPE, float(version)) for i in range(NUM_TENSORS)}


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def write_and_die(root: str, version: int, point: str | None) -> None:
    """Child process: publish ``version``, SIGKILLing itself at ``point`` (None: after a delay)."""
    from torchrl_vllm_ext.weight_sync.transports.storage import slots as storage

    if point == "start":
        _die()
    if point in ("first_tensor", "mid_fill"):
        # The write copies and checksums tensor by tensor: die after the first tensor,
        # or with half of them in the slot.
        calls = []
        real = storage.checksum
        limit = 1 if point == "first_tensor" else NUM_TENSORS // 2

        def checksum(t):
            calls.append(1)
            if len(calls) > limit:
                _die()
            return real(t)

        storage.checksum = checksum
    if point == "after_fill":  # every tensor in the slot, nothing published yet
        storage.SlotWriter.publish = lambda self, manifest: _die()
    if point == "manifest_fsync":
        storage.os.fsync = lambda fd: _die()
    if point in ("before_rename", "after_rename"):
        real_replace = os.replace

        def replace(src, dst):
            if point == "after_rename":
                real_replace(src, dst)
            _die()

        storage.os.replace = replace
    if point == "after_fsync_dir":  # the rename is made durable by fsyncing the directory
        from torchrl_vllm_ext import _files

        _files.fsync_path = lambda path: _die()
    SlotWriter(root).write(weights(version), str(version))
    if point is not None:
        raise AssertionError(f"the writer passed kill point {point!r} alive")


def writer_loop(root: str, first: int) -> None:
    """Child process: publish versions first, first+1, ... until killed."""
    w = SlotWriter(root)
    v = first
    while True:
        w.write(weights(v), str(v))
        v += 1


def verified(root, expect: int | None = None) -> int:
    """Read the published slot (checksums verified) and check it holds one whole version."""
    manifest, tensors = SlotReader(root).read()
    v = int(manifest.version)
    for name, t in tensors.items():
        assert torch.all(t == float(v)), f"{name} of version {v} holds another version's data"
    if expect is not None:
        assert v == expect, f"published version {v}, expected {expect}"
    return v


@pytest.fixture(scope="module")
def forkserver():
    ctx = multiprocessing.get_context("forkserver")
    # This module too: it is where the writers' targets live (a child unpickles them from
    # it), and it imports torch and the slots. Without it every writer imported it (and
    # pytest) anew, ~0.3-0.7 s each; a name that does not import is skipped silently.
    ctx.set_forkserver_preload(["torch", "tensordict", __name__])
    return ctx


@pytest.mark.parametrize(
    "rounds", [2, pytest.param(25, marks=pytest.mark.slow)], ids=lambda r: f"{r}-rounds"
)
def test_writer_killed_at_every_step_of_a_publish(tmp_path, forkserver, rounds):
    root = str(tmp_path / "slots")
    SlotWriter(root).write(weights(0), "0")
    published = 0
    rng = random.Random(rounds)
    kills = 0
    for _ in range(rounds):
        for point in rng.sample(KILL_POINTS, len(KILL_POINTS)):
            version = published + 1
            proc = forkserver.Process(target=write_and_die, args=(root, version, point))
            proc.start()
            proc.join(60)
            assert proc.exitcode == -signal.SIGKILL, (point, proc.exitcode)
            kills += 1
            if point in PUBLISHED_POINTS:
                published = version
            verified(root, expect=published)
        # A writer killed after a random delay, wherever it is.
        proc = forkserver.Process(target=writer_loop, args=(root, published + 1))
        proc.start()
        threading.Event().wait(rng.uniform(0.05, 0.6))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(60)
        kills += 1
        v = verified(root)
        assert v >= published
        published = v
    # A fresh writer takes over the slots the killed ones left behind.
    SlotWriter(root).write(weights(published + 1), str(published + 1))
    verified(root, expect=published + 1)
    assert kills == rounds * (len(KILL_POINTS) + 1)


def test_concurrent_reader_never_loads_a_torn_slot(tmp_path, forkserver):
    root = str(tmp_path / "slots")
    SlotWriter(root).write(weights(0), "0")
    reads, typed, stop = [], [], threading.Event()

    def reader():
        r = SlotReader(root)  # one reader keeps its mappings, like a worker
        while not stop.is_set():
            try:
                manifest, tensors = r.read()
            except WeightSyncError as e:  # e.g. the writer lapped the reader: detected
                typed.append(e)
                continue
            values = {float(t.flatten()[0]) for t in tensors.values()} | {
                float(t.flatten()[-1]) for t in tensors.values()
            }
            # The writer refills this slot only after publishing the next version; while
            # the manifest still names this version, the verified slot must be whole.
            if read_published(root)[0].version == manifest.version:
                reads.append((int(manifest.version), values))

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    rng = random.Random(0)
    first = 1
    for _ in range(6):
        proc = forkserver.Process(target=writer_loop, args=(root, first))
        proc.start()
        threading.Event().wait(rng.uniform(0.1, 0.5))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(60)
        first = verified(root) + 1
    stop.set()
    t.join(60)
    assert reads, "the reader loaded slots"
    torn = [(v, vals) for v, vals in reads if vals != {float(v)}]
    assert not torn, f"torn loads: {torn[:3]}"


def test_republishing_the_previous_manifest_rolls_a_push_back(tmp_path):
    # What WeightSyncScheme does when no replica took a storage push: readers (and
    # replicas restarted later) see the last complete version again, intact.
    w = SlotWriter(tmp_path / "slots")
    w.write(weights(1), "1")
    previous = w.published()
    w.write(weights(2), "2")
    assert verified(w.root) == 2
    w.publish(previous)
    assert verified(w.root, expect=1) == 1
    w.write(weights(3), "3")  # the next push fills the rolled-back version's other slot
    assert verified(w.root, expect=3) == 3

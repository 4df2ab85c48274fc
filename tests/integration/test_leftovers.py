"""Nothing left behind: a trainer that launches a service (its own Ray), pushes weights
twice through storage, pushes two LoRA adapter versions (one retired) and closes
everything leaves no directory or semaphore in /dev/shm, no vLLM rendezvous file in the temp
directory and no process of its Ray session.

Each trainer runs in a child process, so its Ray cluster is its own and the check sees
exactly what it made (its directories carry a tag of their own in their owner marker).
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import tempfile
import uuid

import pytest

from ..helpers import (
    TRAINER_RUN,
    ours_tagged,
    processes_of,
    shm_names,
    trainer_env,
    wait_no_new_semaphores,
    wait_until,
)


def start_trainer(tiny_model, out, mode: str, tag: str) -> subprocess.Popen:
    """:data:`TRAINER_RUN` in ``mode``, its output in files in ``out``."""
    with open(out / "stdout", "w") as stdout, open(out / "stderr", "w") as stderr:
        return subprocess.Popen(
            [sys.executable, "-c", TRAINER_RUN, str(tiny_model), str(out), mode],
            env=trainer_env(tag), stdout=stdout, stderr=stderr, text=True,
        )  # fmt: skip


def what_it_made(proc: subprocess.Popen, out) -> dict:
    """Wait for a trainer; what it made (its last JSON stdout line)."""
    try:
        rc = proc.wait(600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == 0, (out / "stderr").read_text()[-3000:]
    # Its line; Ray may still forward the killed replicas' output after it.
    lines = (out / "stdout").read_text().splitlines()
    return json.loads(next(x for x in reversed(lines) if x.startswith("{")))


@pytest.fixture(scope="module")
def trainers(tiny_model, tmp_path_factory):
    """Both modes' trainers, run at once (their starts overlap on the cores); the checks
    begin when both are done, so neither sees the other's files or processes. Per mode:
    (what it made, its tag, /dev/shm's names before, the temp dir's rendezvous files before)."""
    rendezvous = os.path.join(tempfile.gettempdir(), "vllm_dist_*")
    before, before_rendezvous = shm_names(), set(glob.glob(rendezvous))
    started = {}
    for mode in ("close", "ray-first"):
        tag, out = f"test-{mode}-{uuid.uuid4().hex[:8]}", tmp_path_factory.mktemp(mode)
        started[mode] = tag, out, start_trainer(tiny_model, out, mode, tag)
    made = {mode: (what_it_made(proc, out), tag) for mode, (tag, out, proc) in started.items()}
    return {mode: (info, tag, before, before_rendezvous) for mode, (info, tag) in made.items()}


def assert_nothing_left(info: dict, tag: str, shm_before: set) -> None:
    """No directory of ours, no process of its Ray session, no new named semaphore."""
    assert ours_tagged(tag) == []
    # Every process of its Ray session (GCS, raylet, workers, the replica) is gone.
    wait_until(
        lambda: not processes_of(info["session"], info["replicas"]),
        60,
        interval=0.5,
        what=f"the processes of {info['session']} to exit: {processes_of(info['session'])}",
    )
    # Nor a named semaphore: a replica's locks (vLLM's, tqdm's) live until Ray kills it,
    # so its shutdown unlinks their names (each run left one per replica before).
    wait_no_new_semaphores(shm_before)


def test_launch_push_adapters_close_leaves_nothing(trainers):
    info, tag, before, before_rendezvous = trainers["close"]
    # It made a slot directory in /dev/shm, gone; its adapter pushes made no directory.
    assert info["slots"].startswith("/dev/shm/torchrl-vllm-weights-")
    assert not os.path.exists(info["slots"]) and info["adapter_versions"] == ["4"]
    assert not [n for n in set(shm_names()) - set(before) if "adapters" in n]
    assert_nothing_left(info, tag, before)
    # Nor vLLM's file-store rendezvous of the replica's process group.
    rendezvous = os.path.join(tempfile.gettempdir(), "vllm_dist_*")
    assert not set(glob.glob(rendezvous)) - before_rendezvous


def test_an_owner_whose_ray_is_shut_down_first_leaves_nothing(trainers):
    # TorchRL's GRPO scripts end with ray.shutdown() and never shut the engine down: Ray
    # kills the replicas, and the owner's exit removes what they left.
    info, tag, before, _ = trainers["ray-first"]
    assert info["temps"] and all(t.startswith("/dev/shm/") for t in info["temps"])
    assert not any(os.path.exists(t) for t in info["temps"] + [info["slots"]])
    assert_nothing_left(info, tag, before)

"""Nothing left behind: a trainer that launches a service (its own Ray), pushes weights
twice through storage, pushes two LoRA adapter versions (one retired) and closes
everything leaves no directory or semaphore in /dev/shm, no vLLM rendezvous file in the temp
directory and no process of its Ray session.

The trainer runs in a child process, so its Ray cluster is its own and the check sees
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

from ..helpers import (
    TRAINER_RUN,
    ours_tagged,
    processes_of,
    shm_names,
    trainer_env,
    wait_no_new_semaphores,
    wait_until,
)


def run_trainer(tiny_model, tmp_path, mode: str, tag: str) -> dict:
    """Run :data:`TRAINER_RUN` in ``mode``; what it made (its last stdout line)."""
    run = subprocess.run(
        [sys.executable, "-c", TRAINER_RUN, str(tiny_model), str(tmp_path), mode],
        env=trainer_env(tag),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    # Its line; Ray may still forward the killed replicas' output after it.
    return json.loads(next(x for x in reversed(run.stdout.splitlines()) if x.startswith("{")))


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


def test_launch_push_adapters_close_leaves_nothing(tiny_model, tmp_path):
    tag = f"test-close-{uuid.uuid4().hex[:8]}"
    before = shm_names()
    rendezvous = os.path.join(tempfile.gettempdir(), "vllm_dist_*")
    before_rendezvous = set(glob.glob(rendezvous))
    info = run_trainer(tiny_model, tmp_path, "close", tag)
    # It made a slot directory in /dev/shm, gone; its adapter pushes made no directory.
    assert info["slots"].startswith("/dev/shm/torchrl-vllm-weights-")
    assert not os.path.exists(info["slots"]) and info["adapter_versions"] == ["4"]
    assert not [n for n in set(shm_names()) - set(before) if "adapters" in n]
    assert_nothing_left(info, tag, before)
    # Nor vLLM's file-store rendezvous of the replica's process group.
    assert not set(glob.glob(rendezvous)) - before_rendezvous


def test_an_owner_whose_ray_is_shut_down_first_leaves_nothing(tiny_model, tmp_path):
    # TorchRL's GRPO scripts end with ray.shutdown() and never shut the engine down: Ray
    # kills the replicas, and the owner's exit removes what they left.
    tag = f"test-rayfirst-{uuid.uuid4().hex[:8]}"
    before = shm_names()
    info = run_trainer(tiny_model, tmp_path, "ray-first", tag)
    assert info["temps"] and all(t.startswith("/dev/shm/") for t in info["temps"])
    assert not any(os.path.exists(t) for t in info["temps"] + [info["slots"]])
    assert_nothing_left(info, tag, before)

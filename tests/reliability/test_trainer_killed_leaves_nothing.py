"""A trainer SIGKILLed after two pushes cleans nothing up itself; the next start does.

The trainer (a child process) launches its own service and Ray, pushes twice through
storage and is SIGKILLed. Its Ray session dies with it (Ray's processes share their
driver's fate); its slot directory and its replica's temporary directory (vLLM's
rendezvous file) stay until the next weight-sync scheme starts on this machine, which
removes them: their owners are dead. Nothing of either run is left.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import uuid

from torchrl_vllm_ext import WeightSyncScheme

from ..helpers import (
    TRAINER_RUN,
    ours_tagged,
    processes_of,
    shm_names,
    trainer_env,
    wait_no_new_semaphores,
    wait_until,
)


def test_a_killed_trainers_leftovers_are_reaped_by_the_next_start(service, tiny_model, tmp_path):
    tag = f"test-kill-{uuid.uuid4().hex[:8]}"
    before = shm_names()
    proc = subprocess.Popen(
        [sys.executable, "-c", TRAINER_RUN, str(tiny_model), str(tmp_path), "kill"],
        env=trainer_env(tag),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        for line in proc.stdout:  # its JSON line comes after its two pushes
            if line.startswith('{"driver"'):
                break
        else:
            raise AssertionError(f"the trainer exited early ({proc.wait()})")
        info = json.loads(line)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    # A killed trainer leaves its slots, and its replica (killed with its Ray session) its
    # temporary directory with vLLM's rendezvous file in it; no named semaphore once its
    # resource tracker has seen it die.
    assert sorted(ours_tagged(tag)) == sorted([info["slots"], *info["temps"]])
    assert all(glob.glob(os.path.join(t, "vllm_dist_*")) for t in info["temps"])
    wait_no_new_semaphores(before)
    wait_until(
        lambda: not processes_of(info["session"], info["replicas"]),
        120,
        interval=0.5,
        what=f"the killed trainer's Ray processes to exit: {processes_of(info['session'])}",
    )
    # The next run on this machine: starting a scheme reaps what dead owners left.
    with WeightSyncScheme(service, transport="storage") as scheme:
        assert not os.path.exists(info["slots"])
        assert not any(os.path.exists(t) for t in info["temps"])
        assert ours_tagged(tag) == []
        mine = scheme.storage_dir
        assert mine.exists()
    assert not mine.exists(), "closing the new scheme removes its own slots"

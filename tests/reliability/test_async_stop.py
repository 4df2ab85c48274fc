"""Stopping the asynchronous demo mid-run (Ctrl-C while the producer thread generates and
pushes land in flight) leaves nothing behind: no directory of ours, no process of its Ray
cluster or replicas, and the rollouts it finished stay readable."""

from __future__ import annotations

import signal
import subprocess
import sys
import uuid

from tensordict import TensorDict

from ..helpers import ours_tagged, tagged_processes, trainer_env, wait_until

PUSHES_BEFORE_STOP = 3


def test_stopping_the_async_demo_mid_run_leaves_nothing_behind(tmp_path):
    tag = f"test-async-stop-{uuid.uuid4().hex[:8]}"
    out = tmp_path / "run"
    args = [sys.executable, "-m", "torchrl_vllm_ext.cli", "demo", "--async",
            "--in-flight-updates", "--max-policy-lag", "2", "--steps", "500",
            "--replicas", "1", "--prompts", "4", "--group-size", "8",
            "--output", str(out), "--no-progress"]  # fmt: skip
    log = out / "torchrl-vllm.log"
    proc = subprocess.Popen(
        args, env=trainer_env(tag), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    try:
        wait_until(
            lambda: (
                proc.poll() is not None
                or (log.exists() and log.read_text().count("pushed version") >= PUSHES_BEFORE_STOP)
            ),
            300,
            interval=0.2,
            what="the async demo's first pushes",
        )
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=180)
        stderr = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
    assert rc != 0 and "KeyboardInterrupt" in stderr, stderr[-3000:]
    assert ours_tagged(tag) == []
    wait_until(lambda: not tagged_processes(tag), 60, interval=0.5, what="its processes to exit")
    rollouts = TensorDict.load_memmap(out / "rollouts")
    trained = rollouts["consumed_version"][:, 0] >= 0
    assert trained.sum() >= PUSHES_BEFORE_STOP - 1  # the steps it finished are on disk

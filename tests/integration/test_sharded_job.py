"""The GRPO job with its trainer sharded over two ranks (FSDP2, gloo), run as a user runs
it: the example of docs/guide/sharded.md, as a script in a child process (it starts its own
Ray cluster and replicas, and spawns rank 1)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import psutil
import torch
from tensordict import TensorDict

from ..doc_examples import GUIDE, examples

GUIDE_STEPS, STEPS = "steps=20,", "steps=4,"
"""The page's job runs 20 steps; the checks below hold from the first push on, so the test
runs 4 (the 16 more took ~11 s on 2 cores)."""


def test_the_guide_job_trains_on_two_ranks_and_ends_them(tmp_path):
    (example,) = [e for e in examples(GUIDE / "sharded.md") if "run_grpo" in e.code]
    assert example.code.count(GUIDE_STEPS) == 1, "the page's step count moved"
    script = tmp_path / "sharded_job.py"
    script.write_text(example.code.replace(GUIDE_STEPS, STEPS))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "grpo_sharded"
    metrics = json.loads((out / "metrics.json").read_text())
    steps = metrics["config"]["steps"]
    assert metrics["summary"]["trainer_ranks"] == 2
    assert metrics["summary"]["transport"] == "storage"
    # Every step's push reached the replicas: version k+1 after step k, and the next
    # step's samples came from it (on-policy, as with one rank).
    assert [s["weight_version"] for s in metrics["steps"]] == list(range(1, steps + 1))
    rollouts = TensorDict.load_memmap(out / "rollouts")
    assert torch.equal(rollouts["weight_version"], rollouts["step"])
    # The replicas serve exactly what the sharded trainer holds.
    assert metrics["summary"]["max_abs_kl_to_engine"] < 1e-4
    # Rank 1 pushed every step, stopped when told and is gone.
    log = (out / "torchrl-vllm.log").read_text() if (out / "torchrl-vllm.log").exists() else ""
    log += proc.stdout + proc.stderr
    assert f"trainer rank 1 done: {steps} steps, version {steps}" in log
    (pid,) = re.findall(r"trainer-rank-1 \(pid (\d+)\) exited: 0", log)
    assert not psutil.pid_exists(int(pid))

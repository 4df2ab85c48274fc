"""The scripts in ``examples/``, run as a user runs them: a child process that starts
its own Ray cluster and replicas, trains, writes its metrics and leaves nothing behind."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import uuid
from pathlib import Path

from ..helpers import ours_tagged, tagged_processes, trainer_env, wait_until

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_grpo_countdown_trains_pushes_and_cleans_up(tmp_path):
    steps, tag = 3, f"test-example-{uuid.uuid4().hex[:8]}"
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "grpo_countdown.py"), "--steps", str(steps),
         "--replicas", "1", "--output", str(tmp_path), "--no-progress"],
        capture_output=True, text=True, timeout=600, env=trainer_env(tag), check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"{steps} steps in" in proc.stdout  # the summary line
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    rows, summary = metrics["steps"], metrics["summary"]
    assert [m["step"] for m in rows] == list(range(steps))
    for m in rows:
        # CountdownRewardParser's rewards: 0, 0.1 (format) or 1 (right answer).
        assert 0.0 <= m["reward"] <= m["reward_max"] <= 1.0
        assert math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])
        # 2 problems x 4 samples of 1..24 tokens each.
        assert 8 <= m["response_tokens"] <= 8 * 24
        # Every sample came from the weights the trainer held when it scored them (the
        # previous step's push): importance weights 1, no KL to the engine.
        assert abs(m["ess"] - 1.0) < 1e-3 and abs(m["kl_to_inference"]) < 1e-3
        assert m["step_s"] >= m["collect_s"] + m["train_s"] + m["sync_s"] > 0
    # One push per step through the collector: TorchRL's version and the engine's agree.
    assert [m["policy_version"] for m in rows] == list(range(1, steps + 1))
    assert [m["weight_version"] for m in rows] == [str(v) for v in range(1, steps + 1)]
    assert summary["final_policy_version"] == steps
    assert summary["replica_weight_versions"] == {"0": str(steps)}
    assert summary["steps_per_s"] > 0 and math.isfinite(summary["median_step_s"])
    assert "pid=" in (tmp_path / "vllm.log").read_text()  # the replica's vLLM output
    # Nothing left: no directory of ours in /dev/shm, no process of its Ray or replicas.
    assert ours_tagged(tag) == []
    wait_until(lambda: not tagged_processes(tag), 60, interval=0.5, what="its processes to exit")

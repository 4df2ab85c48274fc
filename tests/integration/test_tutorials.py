"""The README's main job and the tutorial notebooks, run as a user runs them.

Each starts its own Ray cluster and replicas in a child process (the CLI, a Jupyter
kernel), shortened by flags or environment variables so the suite stays quick.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

TUTORIALS = Path(__file__).resolve().parents[2] / "tutorials"


def child_env(**extra: str) -> dict[str, str]:
    """The test's environment without its Ray cluster: children start their own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(extra)
    return env


def run_notebook(name: str, cwd: Path, timeout: float, **env: str) -> dict:
    """Execute ``tutorials/<name>``; the JSON the last cell prints."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(TUTORIALS / name, as_version=4)
    client = NotebookClient(
        nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}
    )
    client.execute(env=child_env(**env))
    text = "".join(o.get("text", "") for o in nb.cells[-1].outputs if o.output_type == "stream")
    return json.loads(text.strip().splitlines()[-1])


def test_demo_trains_and_writes_its_outputs(tmp_path):
    steps = 30
    proc = subprocess.run(
        [sys.executable, "-m", "torchrl_vllm_ext.cli", "demo", "--steps", str(steps),
         "--replicas", "1", "--output", str(tmp_path), "--no-progress"],
        capture_output=True, text=True, timeout=600, env=child_env(), check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    for phase in ("generate", "score", "train", "sync"):
        assert phase in proc.stdout  # the printed step breakdown
    # Quiet: a few lines of progress and the summary; the replicas' vLLM output, Ray's and
    # every weight push are in the log file instead.
    terminal = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    shown = [ln for ln in terminal if "starting vLLM replicas" not in ln]
    assert len(shown) <= 15, "\n".join(shown)
    log = (tmp_path / "torchrl-vllm.log").read_text()
    assert "MainProcess pid=" in log, "a replica's vLLM output"
    assert log.count("pushed version") == steps
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    s = metrics["summary"]
    assert len(metrics["steps"]) == steps
    # From the random policy's level (0.1) clearly up, in a fraction of the full run.
    assert s["reward_start"] < 0.3 and s["reward_end"] > s["reward_start"] + 0.25
    # Fresh samples, trainer and engine on the same weights: importance weights are 1.
    assert s["max_abs_kl_to_engine"] < 1e-4
    assert (tmp_path / "reward_curve.png").read_bytes()[:4] == b"\x89PNG"
    rollouts = TensorDict.load_memmap(tmp_path / "rollouts")
    assert rollouts.batch_size == (steps, 128)
    # On-policy: every sample of step k came from weight version k (pushed after step k-1).
    assert torch.equal(rollouts["weight_version"], rollouts["step"])
    assert ((rollouts["response"] >= 5) & (rollouts["response"] < 15)).all()
    torch.testing.assert_close(
        rollouts["reward"].mean(-1), torch.tensor([m["reward"] for m in metrics["steps"]])
    )


# The default run takes every cell through a few steps (2 instead of 8 saved nothing
# measurable: the notebook's time is its kernel's and replicas' start); the 40 steps that
# show the reward rise are slow (test_demo_trains_and_writes_its_outputs proves a GRPO run's
# rise by default).
@pytest.mark.parametrize("steps", [8, pytest.param(40, marks=pytest.mark.slow)])
def test_grpo_notebook_runs_and_its_reward_rises(tmp_path, steps):
    summary = run_notebook(
        "grpo.ipynb", tmp_path, timeout=600, GRPO_STEPS=str(steps), GRPO_REPLICAS="1"
    )
    assert summary["steps"] == steps
    assert summary["max_abs_kl_to_engine"] < 1e-4
    assert summary["kl_to_ref_end"] > 0  # the reference service kept the initial weights
    if steps >= 40:
        assert summary["reward_start"] < 0.3
        assert summary["reward_end"] > summary["reward_start"] + 0.3


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_tensordict_notebook_outputs_documented_keys(tmp_path):
    summary = run_notebook("tensordict_scripting.ipynb", tmp_path, timeout=600)
    for key in ("tokens.prompt", "tokens.response", "tokens.full", "log_probs.response",
                "masks.all_attention_mask", "vllm.weight_version"):  # fmt: skip
        assert key in summary["tokens_padded"], key
        assert key in summary["memmap_keys"], key
    assert summary["tokens_ragged_rows"] == 3
    assert summary["num_samples_batch_shape"] == [3, 4]
    assert summary["text_rows"] == 2
    assert summary["scoring_max_abs_diff"] < 1e-4


def test_demo_with_a_lora_adapter_pushes_only_the_adapter(tmp_path):
    steps = 25
    proc = subprocess.run(
        [sys.executable, "-m", "torchrl_vllm_ext.cli", "demo", "--steps", str(steps),
         "--replicas", "1", "--lora-rank", "8", "--output", str(tmp_path), "--no-progress"],
        capture_output=True, text=True, timeout=600, env=child_env(), check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads((tmp_path / "metrics.json").read_text())["summary"]
    assert s["transport"] == "adapter"
    assert s["reward_end"] > s["reward_start"] + 0.25
    # The replicas serve the trainer's adapter exactly: importance weights are 1.
    assert s["max_abs_kl_to_engine"] < 1e-4
    rollouts = TensorDict.load_memmap(tmp_path / "rollouts")
    assert torch.equal(rollouts["weight_version"], rollouts["step"])

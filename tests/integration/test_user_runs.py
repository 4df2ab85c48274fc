"""What a user runs as a program, run as a user runs it: the README's main job (the demo
CLI), the script of ``examples/``, the sharded job of docs/guide/sharded.md and the
tutorial notebooks.

Each runs in a child process (the CLI, a script, a Jupyter kernel) with its own Ray
cluster and replicas, shortened by flags, arguments or environment variables so the suite
stays quick. The module runs the selected tests' children two at a time: their starts
(imports, Ray, a replica's ~15 s launch) overlap on the machine's cores, and each test
then waits for its own.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import torch
from tensordict import TensorDict

from ..doc_examples import GUIDE, examples
from ..helpers import ours_tagged, recorded_spans, tagged_processes, trainer_env, wait_until

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
TUTORIALS, EXAMPLES = ROOT / "tutorials", ROOT / "examples"
TIMEOUT_S = 600
DEMO_STEPS = 30
LORA_STEPS = 25

NOTEBOOK_RUN = """
import sys
import nbformat
from nbclient import NotebookClient
path, cwd, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
nb = nbformat.read(path, as_version=4)
NotebookClient(nb, timeout=timeout, kernel_name="python3",
               resources={"metadata": {"path": cwd}}).execute()
text = "".join(o.get("text", "") for o in nb.cells[-1].outputs if o.output_type == "stream")
print(text.strip().splitlines()[-1])
"""
"""Execute a notebook (argv: its path, its working directory, the per-cell timeout); the
last line its last cell printed (a JSON summary) goes to stdout."""


def child_env(**extra: str) -> dict[str, str]:
    """The test's environment without its Ray cluster: children start their own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(extra)
    return env


RAY_START_DEADLINE = "The current node timed out during startup"
"""Ray's error when a new cluster's raylet does not register within its fixed 30 s
(``ray/_private/node.py``; no setting changes it): children starting beside each other on
a fresh 2-core machine hit it now and then (both notebooks once with 6 at once, the GRPO
notebook once with 3)."""


@dataclass
class Child:
    """A child process started by the module; its output goes to files in ``out``.
    ``again(out)`` starts the same child in another directory."""

    proc: subprocess.Popen
    out: Path
    again: Callable[[Path], Child] | None = None

    def result(self) -> subprocess.CompletedProcess:
        """Wait for it; its exit status and output. A child whose Ray cluster missed
        :data:`RAY_START_DEADLINE` (at its Ray start, before any replica) runs once more."""
        done = self._wait()
        if done.returncode != 0 and RAY_START_DEADLINE in done.stderr and self.again:
            logger.warning(
                "%s: its Ray cluster missed Ray's start-up deadline; once more", self.out
            )
            again = self.out.with_name(self.out.name + "-again")
            again.mkdir()
            retry = self.again(again)
            self.proc, self.out, self.again = retry.proc, retry.out, None
            done = self._wait()
        return done

    def _wait(self) -> subprocess.CompletedProcess:
        try:
            rc = self.proc.wait(TIMEOUT_S)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        stdout, stderr = ((self.out / n).read_text() for n in ("stdout", "stderr"))
        return subprocess.CompletedProcess(self.proc.args, rc, stdout, stderr)


def start(args: list[str], out: Path, env: dict[str, str] | None = None, **extra: str) -> Child:
    """``python *args`` in ``out`` (``env``: its whole environment, else the test's
    without Ray's, plus ``extra``)."""
    with open(out / "stdout", "w") as stdout, open(out / "stderr", "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, *args], stdout=stdout, stderr=stderr, text=True,
            env=env or child_env(**extra), cwd=out,
        )  # fmt: skip
    return Child(proc, out)


def demo(out: Path, steps: int, *extra: str) -> Child:
    """The demo CLI, writing into ``out / "run"``."""
    args = ["-m", "torchrl_vllm_ext.cli", "demo", "--steps", str(steps), "--replicas", "1",
            "--output", str(out / "run"), "--no-progress", *extra]  # fmt: skip
    return start(args, out)


def notebook(name: str, out: Path, **env: str) -> Child:
    return start(["-c", NOTEBOOK_RUN, str(TUTORIALS / name), str(out), str(TIMEOUT_S)], out, **env)


COUNTDOWN_STEPS = 3
TAG = f"test-example-{uuid.uuid4().hex[:8]}"
"""The marker tag of the countdown example's directories and processes."""


def countdown(out: Path) -> Child:
    args = [str(EXAMPLES / "grpo_countdown.py"), "--steps", str(COUNTDOWN_STEPS),
            "--replicas", "1", "--output", str(out / "run"), "--no-progress"]  # fmt: skip
    return start(args, out, env=trainer_env(TAG))


ASYNC_STEPS, ASYNC_LAG = 12, 1
"""The asynchronous demo's run: the bound and the keys hold from the first step on."""


def async_demo(out: Path) -> Child:
    """The demo with ``--async``, in-flight pushes, a smaller batch (the bound holds from the
    first step on)."""
    return demo(
        out, ASYNC_STEPS, "--async", "--max-policy-lag", str(ASYNC_LAG), "--in-flight-updates",
        "--prompts", "4", "--group-size", "8",
    )  # fmt: skip


GUIDE_STEPS, SHARDED_STEPS = "steps=20,", "steps=4,"
"""The sharded page's job runs 20 steps; the checks below hold from the first push on, so
the test runs 4 (the 16 more took ~11 s on 2 cores)."""


def sharded_job(out: Path) -> Child:
    """The guide's sharded job as a script (it writes into ``out / "grpo_sharded"``)."""
    (example,) = [e for e in examples(GUIDE / "sharded.md") if "run_grpo" in e.code]
    assert example.code.count(GUIDE_STEPS) == 1, "the page's step count moved"
    (out / "sharded_job.py").write_text(example.code.replace(GUIDE_STEPS, SHARDED_STEPS))
    return start([str(out / "sharded_job.py")], out)


CHILDREN = {
    "test_the_guide_job_trains_on_two_ranks_and_ends_them": sharded_job,
    "test_demo_trains_and_writes_its_outputs": lambda out: demo(out, DEMO_STEPS),
    "test_grpo_notebook_runs_and_its_reward_rises[8]": lambda out: notebook(
        "grpo.ipynb", out, GRPO_STEPS="8", GRPO_REPLICAS="1"
    ),
    "test_grpo_notebook_runs_and_its_reward_rises[40]": lambda out: notebook(
        "grpo.ipynb", out, GRPO_STEPS="40", GRPO_REPLICAS="1"
    ),
    "test_async_demo_keeps_the_staleness_bound_and_reports_every_step": async_demo,
    "test_demo_with_a_lora_adapter_pushes_only_the_adapter": lambda out: demo(
        out, LORA_STEPS, "--lora-rank", "8"
    ),
    "test_tensordict_notebook_outputs_documented_keys": lambda out: notebook(
        "tensordict_scripting.ipynb", out
    ),
    "test_grpo_countdown_trains_pushes_and_cleans_up": countdown,
}
"""Each test's child, by test name, in the order they start (the longest first)."""

MAX_RUNNING = 2
"""Children running at once: more overload a fresh 2-core machine (see
:data:`RAY_START_DEADLINE`)."""


@pytest.fixture(scope="module")
def children(request, tmp_path_factory):
    """Starts the child of every test of this module that runs (selected, not skipped),
    :data:`MAX_RUNNING` at a time, from a thread (each as soon as one before it ends);
    yields a function of a test's name that returns its child once started. What still
    runs at the module's end is killed."""
    outs = {
        item.name: tmp_path_factory.mktemp(re.sub(r"\W", "_", item.name))
        for item in request.session.items
        if item.module is request.module and not item.get_closest_marker("skip")
    }
    names = [name for name in CHILDREN if name in outs]
    started: dict[str, Child] = {}
    ready = {name: threading.Event() for name in names}
    stop = threading.Event()

    def feed() -> None:
        for name in names:
            while sum(c.proc.poll() is None for c in started.values()) >= MAX_RUNNING:
                if stop.wait(0.5):
                    return
            started[name] = CHILDREN[name](outs[name])
            started[name].again = CHILDREN[name]
            ready[name].set()

    feeder = threading.Thread(target=feed, name="user-runs", daemon=True)
    feeder.start()

    def get(name: str) -> Child:
        assert ready[name].wait(len(names) * TIMEOUT_S), f"{name}'s child never started"
        return started[name]

    yield get
    stop.set()
    feeder.join()
    for child in started.values():
        if child.proc.poll() is None:
            child.proc.kill()
            child.proc.wait()


@pytest.fixture
def child(children, request) -> Child:
    return children(request.node.name)


def notebook_summary(child: Child) -> dict:
    done = child.result()
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_demo_trains_and_writes_its_outputs(child):
    proc = child.result()
    steps, tmp_path = DEMO_STEPS, child.out / "run"
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
def test_grpo_notebook_runs_and_its_reward_rises(child, steps):
    summary = notebook_summary(child)
    assert summary["steps"] == steps
    assert summary["max_abs_kl_to_engine"] < 1e-4
    assert summary["kl_to_ref_end"] > 0  # the reference service kept the initial weights
    if steps >= 40:
        assert summary["reward_start"] < 0.3
        assert summary["reward_end"] > summary["reward_start"] + 0.3


def test_tensordict_notebook_outputs_documented_keys(child):
    summary = notebook_summary(child)
    for key in ("tokens.prompt", "tokens.response", "tokens.full", "log_probs.response",
                "masks.all_attention_mask", "vllm.weight_version"):  # fmt: skip
        assert key in summary["tokens_padded"], key
        assert key in summary["memmap_keys"], key
    assert summary["tokens_ragged_rows"] == 3
    assert summary["num_samples_batch_shape"] == [3, 4]
    assert summary["text_rows"] == 2
    assert summary["scoring_max_abs_diff"] < 1e-4


def test_async_demo_keeps_the_staleness_bound_and_reports_every_step(child):
    from torchrl_vllm_ext.grpo.async_metrics import STEP_KEYS

    proc = child.result()
    tmp_path = child.out / "run"
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["config"]["async_mode"] and metrics["config"]["rollout_correction"]
    assert len(metrics["steps"]) == ASYNC_STEPS
    for step in metrics["steps"]:
        missing = [k for k in STEP_KEYS if k not in step]
        assert not missing, (step["step"], missing)
        assert step["staleness_max"] <= ASYNC_LAG  # the gate (wait) keeps every sample in
    assert [s["batch_index"] for s in metrics["steps"]] == list(range(ASYNC_STEPS))
    s = metrics["summary"]
    assert s["stale_dropped"] == s["stale_masked_tokens"] == 0
    assert s["stale_samples"] > 0  # trained off-policy: the replicas ran ahead
    assert (tmp_path / "torchrl-vllm.log").read_text().count("pushed version") == ASYNC_STEPS
    # The recorded (exact) spans: no trained token of a batch consumed at version v was
    # made by weights older than v - K.
    r = TensorDict.load_memmap(tmp_path / "rollouts")
    consumed = r["consumed_version"]
    assert (consumed[1:] >= consumed[:-1]).all() and (consumed >= 0).all()
    assert (r["weight_version_end"] >= r["weight_version"]).all()
    for row in r.reshape(-1):
        spans = recorded_spans(row)
        trained = [sp for sp in spans if sp.token_to > int(row["stale_tokens"])]
        assert all(sp.first_version >= int(row["consumed_version"]) - ASYNC_LAG for sp in trained)


def test_demo_with_a_lora_adapter_pushes_only_the_adapter(child):
    proc = child.result()
    tmp_path = child.out / "run"
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads((tmp_path / "metrics.json").read_text())["summary"]
    assert s["transport"] == "adapter"
    assert s["reward_end"] > s["reward_start"] + 0.25
    # The replicas serve the trainer's adapter exactly: importance weights are 1.
    assert s["max_abs_kl_to_engine"] < 1e-4
    rollouts = TensorDict.load_memmap(tmp_path / "rollouts")
    assert torch.equal(rollouts["weight_version"], rollouts["step"])


def test_grpo_countdown_trains_pushes_and_cleans_up(child):
    """The script in ``examples/``: it trains, writes its metrics and leaves nothing behind."""
    proc = child.result()
    steps, out = COUNTDOWN_STEPS, child.out / "run"
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"{steps} steps in" in proc.stdout  # the summary line
    metrics = json.loads((out / "metrics.json").read_text())
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
    assert "pid=" in (out / "vllm.log").read_text()  # the replica's vLLM output
    # Nothing left: no directory of ours in /dev/shm, no process of its Ray or replicas.
    assert ours_tagged(TAG) == []
    wait_until(lambda: not tagged_processes(TAG), 60, interval=0.5, what="its processes to exit")


def test_the_guide_job_trains_on_two_ranks_and_ends_them(child):
    """The GRPO job with its trainer sharded over two ranks (FSDP2, gloo): it starts its own
    Ray cluster and replicas, and spawns rank 1."""
    proc = child.result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = child.out / "grpo_sharded"
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

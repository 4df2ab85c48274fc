"""benchmarks/gpu_report.py's bench part without a GPU: scripts run in their own session and
are stopped past the budget with what they started, results are written as they come, and
docs/gpu.md renders the start times and the throughput table from gpu.json."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import psutil

REPORT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_report.py"


def load_report():
    spec = importlib.util.spec_from_file_location("gpu_report", REPORT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


START = {
    "benchmark": "start",
    "model": "tiny qwen2 (make_tiny_model), bf16, CUDA graphs",
    "gpus_per_replica": 0.5,
    "one_replica_s": 95.0,
    "two_sharing_s": 118.0,
    "ratio_two_vs_one": 1.242,
    "target_ratio": 1.3,
    "one_replica": {"kv_cache_bytes": {"0": 60 << 30}, "pins": {}},
    "two_sharing": {
        "kv_cache_bytes": {"0": None, "1": 60 << 30},
        "pins": {"0@10.0.0.2": {"bytes": 60 << 30, "by": 0, "after_s": 51.2}},
    },
}
POLICY = {
    "benchmark": "policy",
    "model": "tiny qwen2 (make_tiny_model), bf16, CUDA graphs",
    "prompts": 256,
    "max_tokens": 256,
    "rounds": 5,
    "raw_vllm_tokens_per_s": 100000.0,
    "service_tokens_per_s": 90000.0,
    "policy_tokens_per_s": 85000.0,
    "raw_asyncllm_tokens_per_s": 95000.0,
    "rounds_tokens_per_s": {"raw_vllm": [100000.0], "policy": [85000.0]},  # not a system
    "ratio_policy_vs_raw_vllm": 0.85,
    "paired_median_policy_vs_raw_vllm": 0.86,
    "paired_median_policy_vs_service": 0.95,
}


def test_the_bench_part_renders_start_times_and_throughput():
    report = load_report()
    md = "\n".join(
        report.render_benches({"start": START, "policy": POLICY, "sync": {"skipped": "budget"}})
    )
    assert "| one replica | 95.0 | 60.00 GiB |" in md
    assert "pinned 60.00 GiB, measured by replica 0 51.2 s into its start" in md
    assert "Two / one: **1.242** (target <= 1.3)" in md
    assert "| raw_vllm | 100,000 | 1.000 | 0.86 |" in md
    assert "| policy | 85,000 | 0.850 |  |" in md
    assert "ratio_policy_vs_raw_vllm = 0.85" in md
    assert "### sync\n\nNot measured: budget" in md


def test_scripts_past_the_budget_are_skipped_and_results_come_as_they_go(tmp_path, monkeypatch):
    report = load_report()
    quick = tmp_path / "quick.py"
    quick.write_text('import json\nprint("a log line")\nprint(json.dumps({"x": 1}))\n')
    monkeypatch.setattr(report, "BENCHES", {"quick": ([str(quick)], 1), "slow": ([str(quick)], 99)})
    seen = []
    out = report.run_benches(
        ["quick", "slow"], 30, 4, lambda r: seen.append(dict(r)), log_dir=tmp_path
    )
    assert out["quick"]["x"] == 1 and out["quick"]["seconds"] >= 0
    assert out["slow"]["skipped"].startswith("budget:")
    assert [list(s) for s in seen] == [["quick"], ["quick", "slow"]]
    assert "a log line" in (tmp_path / "bench-quick.log").read_text()
    assert report.failed({"bench": out}), "a skipped script counts as not run"


def test_a_script_past_what_is_left_is_stopped_with_its_children(tmp_path):
    report = load_report()
    child_pid = tmp_path / "child.pid"
    script = tmp_path / "hang.py"
    script.write_text(
        "import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(child_pid)!r}, 'w').write(str(p.pid))\n"
        "print('started', file=sys.stderr, flush=True)\n"
        "time.sleep(60)\n"
    )
    t0 = time.monotonic()
    out = report.run_script([str(script)], timeout=3)
    assert time.monotonic() - t0 < 30
    assert out["error"].startswith("stopped after 3 s") and "started" in out["error"]
    pid = int(child_pid.read_text())
    deadline = time.monotonic() + 10
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie":
        assert time.monotonic() < deadline, "the script's child outlived it"
        time.sleep(0.1)


def test_a_script_stopped_after_it_printed_its_figures_keeps_them(tmp_path):
    """A bench whose engine is slow to exit loses no measurement."""
    report = load_report()
    script = tmp_path / "slow_exit.py"
    script.write_text(
        "import json, time\n"
        "print(json.dumps({'benchmark': 'x', 'policy_tokens_per_s': 5.0}), flush=True)\n"
        "time.sleep(60)\n"
    )
    out = report.run_script([str(script)], timeout=3)
    assert out == {"benchmark": "x", "policy_tokens_per_s": 5.0, "stopped_after_s": 3.0}

"""bench_sync on one GPU, in a module of its own (the tier's replicas are gone by then)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu


def test_bench_sync_runs_on_one_gpu():
    bench = Path(__file__).parents[2] / "benchmarks" / "bench_sync.py"
    out = subprocess.run(
        [sys.executable, str(bench), "--repeats", "4"],
        capture_output=True,
        text=True,
        timeout=900,
        check=True,
    )
    figures = json.loads(out.stdout)
    assert figures["colocated"]["transport"] == "ipc"
    assert figures["logprobs_bitwise_equal"], "IPC and storage pushes served different log-probs"
    print(json.dumps(figures))

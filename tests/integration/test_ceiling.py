"""The ceiling bench (benchmarks/bench_ceiling.py) runs briefly on the real path with the
engine stand-in: every system carries every token. No timing is asserted: the figures are
the bench's, this only keeps it working for CI."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_ceiling.py"


def test_the_ceiling_bench_carries_every_token_through_the_real_path(ray_cluster):
    spec = importlib.util.spec_from_file_location("bench_ceiling", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = bench.parser().parse_args(["--prompts", "24", "--max-tokens", "8", "--rounds", "2"])
    out = bench.main(args)
    assert out["tokens_per_call"] == dict.fromkeys(
        ("stand_in", "service", "policy", "policy_padded"), 24 * 8
    )
    assert all(out[f"{name}_tokens_per_s"] > 0 for name in out["tokens_per_call"])
    assert len(out["rounds_tokens_per_s"]["policy"]) == 2

"""torchrl-vllm bench: run the benchmark scripts and print one JSON table.

Each benchmark script measures one figure against its baseline in the same run and
prints a JSON object; this command runs the chosen ones one after the other (never in
parallel: they would measure each other), each in its own process, and gathers their
objects into one table: {"benchmarks": {name: {"ok", "seconds", "ratios", "result"}}},
where "ratios" lifts every ratio-like figure out of the nested result.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import time
from pathlib import Path

from torchrl_vllm_ext.errors import ConfigurationError

logger = logging.getLogger(__name__)

# name -> (arguments of the full run, arguments of --quick)
BENCHMARKS = {
    "generate": ([], ["--rounds", "3", "--prompts", "32"]),
    "policy": ([], ["--rounds", "3", "--prompts", "32"]),
    "ceiling": ([], ["--rounds", "3", "--prompts", "64", "--max-tokens", "32"]),
    "sync": ([], ["--hidden", "256", "--layers", "8", "--repeats", "3"]),
    "collect": ([], ["--rounds", "2", "--repeats", "1", "--overhead-rounds", "5"]),
    "faults": ([], ["--quick"]),
    "multiturn": ([], ["--sessions", "9", "--turns", "3", "--repeats", "1"]),
    "lora": ([], ["--hidden", "256", "--layers", "8", "--repeats", "2"]),
    "multinode": ([], ["--hidden", "256", "--layers", "8", "--rounds", "3"]),
    "sharded": ([], ["--hidden", "256", "--layers", "8", "--repeats", "2", "--worlds", "2"]),
    "delta": ([], ["--hidden", "256", "--layers", "8", "--rounds", "2", "--block", "2"]),
    "async": ([], ["--steps", "20", "--rounds", "1", "--lags", "1"]),
}
RATIO_WORDS = ("ratio", "_vs_", "_over_", "speedup", "fraction", "share", "hit_rate")


def default_dir() -> Path:
    """``benchmarks/`` of the source checkout this package was installed from."""
    return Path(__file__).resolve().parents[2] / "benchmarks"


def last_json_object(text: str) -> dict:
    """The last top-level JSON object printed in ``text`` (scripts log before it).

    Examples:
        >>> last_json_object('log line\\n{"a": 1}\\nmore\\n{\\n  "b": 2\\n}\\n')
        {'b': 2}
    """
    decoder = json.JSONDecoder()
    for start in reversed(
        [i for i, c in enumerate(text) if c == "{" and (i == 0 or text[i - 1] == "\n")]
    ):
        try:
            obj, _ = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict):
            return obj
    raise ValueError("no JSON object in the output")


def ratios(result, prefix: str = "") -> dict[str, float]:
    """Numeric leaves whose key names a ratio, flattened to ``a.b.c`` keys.

    Examples:
        >>> ratios({"service": {"ratio_vs_raw": 0.98, "tok_s": 10}, "speedup": 2})
        {'service.ratio_vs_raw': 0.98, 'speedup': 2}
    """
    out: dict[str, float] = {}
    if isinstance(result, dict):
        for key, value in result.items():
            name = f"{prefix}{key}"
            if isinstance(value, dict):
                out.update(ratios(value, f"{name}."))
            elif isinstance(value, int | float) and any(w in str(key) for w in RATIO_WORDS):
                out[name] = value
    return out


def run_one(script: Path, args: list[str], timeout: float) -> dict:
    """Run one benchmark script; its JSON result, or the reason it has none."""
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, str(script), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timed out after {timeout:.0f} s (raise --timeout)"}
    seconds = round(time.perf_counter() - start, 1)
    try:
        result = last_json_object(proc.stdout)
    except ValueError:
        tail = (proc.stderr or proc.stdout)[-2000:]
        return {"ok": False, "seconds": seconds, "returncode": proc.returncode, "error": tail}
    return {
        "ok": proc.returncode == 0,
        "seconds": seconds,
        "ratios": ratios(result),
        "result": result,
    }


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "bench",
        help="run the benchmarks and print one JSON table",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "names",
        nargs="*",
        metavar="NAME",
        help=f"benchmarks to run, of {', '.join(BENCHMARKS)} (default: all)",
    )
    p.add_argument("--quick", action="store_true", help="small sizes and few rounds (minutes)")
    p.add_argument("--dir", type=Path, default=None, help="the benchmarks/ directory")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per benchmark")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    bench_dir = args.dir or default_dir()
    names = args.names or list(BENCHMARKS)
    unknown = sorted(set(names) - set(BENCHMARKS))
    if unknown:
        raise ConfigurationError(
            f"unknown benchmark {unknown[0]!r}; pick from {', '.join(BENCHMARKS)}."
        )
    missing = [n for n in names if not (bench_dir / f"bench_{n}.py").is_file()]
    if missing:
        raise ConfigurationError(
            f"no bench_{missing[0]}.py in {bench_dir}: the benchmarks ship with the source "
            "checkout; run from a clone of the repository or pass --dir PATH/benchmarks."
        )
    table = {}
    for name in (bar := tqdm(names, desc="bench", unit="benchmark")):
        bar.set_postfix(running=name)
        full, quick = BENCHMARKS[name]
        table[name] = run_one(
            bench_dir / f"bench_{name}.py", quick if args.quick else full, args.timeout
        )
        logger.info("bench_%s: %s", name, "ok" if table[name]["ok"] else "FAILED")
    print(json.dumps({"quick": args.quick, "benchmarks": table}, indent=2))
    return 0 if all(r["ok"] for r in table.values()) else 1

"""One benchmark run from two checkouts of the package, alternating, in one session: is a
change within noise of before?

Each round runs ``python benchmarks/<bench> <args>`` once in each tree (its own code on
``PYTHONPATH``), the older tree first in odd rounds and the newer first in even ones, back
to back; every numeric figure of the two JSON objects they print is then set side by side
(per tree: the median over rounds; the ratio head / base of the medians, and each round's).

    python benchmarks/compare_trees.py --base ../before --rounds 2 -- bench_sync.py --repeats 3

``--keys`` keeps the figures whose path contains one of the given words. Prints one JSON
object (last line).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
from pathlib import Path

from torchrl_vllm_ext.jobs.bench import last_json_object

logger = logging.getLogger("compare_trees")
HEAD = Path(__file__).resolve().parents[1]


def run(tree: Path, bench: str, args: list[str], timeout_s: float) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    command = [sys.executable, str(tree / "benchmarks" / bench), *args]
    logger.info("%s: %s", tree, " ".join(command[1:]))
    proc = subprocess.run(
        command, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout_s
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{bench} failed in {tree}:\n{proc.stderr[-3000:]}")
    return last_json_object(proc.stdout)


def numbers(obj, prefix: str = "") -> dict[str, float]:
    """Every numeric leaf of ``obj`` by its path (``a.b.0.c``).

    >>> numbers({"a": {"b": 1.5, "c": [2, "x"]}, "d": True})
    {'a.b': 1.5, 'a.c.0': 2.0}
    """
    if isinstance(obj, bool):
        return {}
    if isinstance(obj, (int, float)):
        return {prefix: float(obj)}
    items = (
        obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else []
    )
    out = {}
    for key, value in items:
        out.update(numbers(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def compare(runs: dict[str, list[dict]], keys: list[str]) -> dict:
    flat = {tree: [numbers(r) for r in rs] for tree, rs in runs.items()}
    common = set.intersection(*(set(f) for fs in flat.values() for f in fs))
    if keys:
        common = {k for k in common if any(word in k for word in keys)}
    table = {}
    for key in sorted(common):
        base = [f[key] for f in flat["base"]]
        head = [f[key] for f in flat["head"]]
        row = {"base": statistics.median(base), "head": statistics.median(head)}
        if row["base"]:
            row["head_over_base"] = row["head"] / row["base"]
            row["per_round"] = [h / b if b else None for b, h in zip(base, head, strict=True)]
        table[key] = row
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, required=True, help="the older checkout")
    parser.add_argument("--head", type=Path, default=HEAD, help="the newer (default: this one)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--keys", nargs="*", default=[], help="keep figures naming these")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    parser.add_argument("bench", help="a script of benchmarks/, e.g. bench_sync.py")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    opts = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    trees = {"base": opts.base.resolve(), "head": opts.head.resolve()}
    runs: dict[str, list[dict]] = {"base": [], "head": []}
    for round_ in range(opts.rounds):
        order = ["base", "head"] if round_ % 2 == 0 else ["head", "base"]
        for name in order:
            runs[name].append(run(trees[name], opts.bench, opts.args, opts.timeout))
    result = {
        "bench": opts.bench,
        "args": opts.args,
        "rounds": opts.rounds,
        "figures": compare(runs, opts.keys),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

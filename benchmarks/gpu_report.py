"""Run parts of the GPU tier and benches on a GPU machine and merge what they showed into
docs/gpu.md, each part sized for one ~9-minute lease (a replica start costs ~90 s there).

    python benchmarks/gpu_report.py --part tier [--part moe] [--part bench] [--out DIR]
                                    [--budget S] [-k EXPR]

Parts: ``tier`` (tests/gpu/test_gpu.py: two replicas sharing the GPU, IPC / storage / round
trips / sleep / a kill; 1 start + 1 restart), ``moe`` (tests/gpu/test_gpu_moe.py: 5 starts,
4 of them eager), ``bench`` (bench_sync: 1 start). Each part's rows replace that part's rows
in ``DIR/gpu.json`` (default ``docs/``) with the date, device, Python, vLLM, torch and commit
of the run, and ``DIR/gpu.md`` is rendered from all of them. ``--budget`` stops a part's
pytest with SIGINT after S seconds (it still writes its results; the tests it did not
reach are absent from its table). Exits 1 when a test failed or a bench did not run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARTS = {
    "tier": "tests/gpu/test_gpu.py",
    "moe": "tests/gpu/test_gpu_moe.py",
    "bench": None,  # benchmarks, not tests
}


def versions() -> dict:
    import torch
    import vllm

    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    dirty = subprocess.run(
        ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
    )
    return {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA",
        "gpus": torch.cuda.device_count(),
        "python": platform.python_version(),
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "date": datetime.date.today().isoformat(),
        "commit": (commit.stdout.strip() or "unknown")
        + ("+changes" if dirty.stdout.strip() else ""),
    }


def run_tests(path: str, budget_s: float | None, select: str | None = None) -> list[dict]:
    """Each test of ``path`` (those ``select``, a pytest ``-k`` expression, picks): name,
    outcome, seconds, message, recorded properties. Past ``budget_s`` pytest gets SIGINT."""
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "gpu.xml"
        cmd = [sys.executable, "-m", "pytest", path, "-v", "-p", "no:cacheprovider"]
        cmd += [f"--junitxml={junit}", "-o", "junit_logging=no"]
        if select:
            cmd += ["-k", select]
        proc = subprocess.Popen(cmd, cwd=ROOT)
        try:
            proc.wait(timeout=budget_s)
        except subprocess.TimeoutExpired:
            print(f"[gpu_report] {path}: budget {budget_s:.0f} s spent, interrupting", flush=True)
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                proc.kill()
        if not junit.exists():
            return [{"test": path, "outcome": "not run", "seconds": 0, "message": "no results"}]
        rows = junit_rows(ET.parse(junit))
        if proc.returncode not in (0, 1, 5):  # 2: interrupted (the budget), 3/4: pytest broke
            rows.append(
                {
                    "test": f"(the rest of {path})",
                    "outcome": "not run",
                    "seconds": 0,
                    "message": f"pytest exit {proc.returncode}"
                    + (f": budget {budget_s:.0f} s spent" if budget_s else ""),
                }
            )
        return rows


def junit_rows(tree: ET.ElementTree) -> list[dict]:
    rows = []
    for case in tree.iter("testcase"):
        if not case.get("name"):  # what pytest writes for the test a SIGINT stopped
            continue
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            node = case.find(kind)
            if node is not None:
                outcome = "skipped" if kind == "skipped" else "failed"
                message = (
                    (node.get("message") or "").splitlines()[0][:240] if node.get("message") else ""
                )
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        rows.append(
            {
                "test": case.get("name"),
                "outcome": outcome,
                "seconds": round(float(case.get("time", 0)), 1),
                "message": message,
                **({"properties": props} if props else {}),
            }
        )
    return rows


def run_bench(repeats: int) -> dict:
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "benchmarks/bench_sync.py", "--repeats", str(repeats)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        tail = out.stderr.strip().splitlines()
        return {"bench_sync": {"error": tail[-1] if tail else "failed"}}
    return {"bench_sync": json.loads(out.stdout), "seconds": round(time.perf_counter() - t0, 1)}


def render(parts: dict) -> str:
    lines = [
        "# GPU runs",
        "",
        "Generated by `python benchmarks/gpu_report.py` on a GPU machine; do not edit by hand.",
        "Each part below is the last run of that part, with the machine and commit it ran on.",
        "To run a part again (a GPU machine with the package installed: `./run.sh setup` picks",
        "the `gpu` extra where `nvidia-smi` sees a GPU): `python benchmarks/gpu_report.py",
        "--part tier --out DIR` (or `moe`, `bench`; each fits ~9 minutes), then copy",
        "`DIR/gpu.md` and `DIR/gpu.json` over `docs/`.",
        "",
    ]
    for name in PARTS:
        part = parts.get(name)
        if part is None:
            lines += [f"## {name}", "", "Not run yet.", ""]
            continue
        v = part["versions"]
        lines += [
            f"## {name}",
            "",
            f"- {v['device']} x{v['gpus']}; Python {v.get('python', '?')}, vLLM {v['vllm']}, "
            f"torch {v['torch']}, CUDA {v['cuda']}; {v['date']}, commit {v['commit']}",
            "",
        ]
        if "tests" in part:
            lines += ["| test | result | s | recorded |", "|---|---|---|---|"]
            for t in part["tests"]:
                result = t["outcome"] + (f": {t['message']}" if t["message"] else "")
                props = ", ".join(f"{k}={v}" for k, v in t.get("properties", {}).items())
                lines.append(
                    f"| `{t['test']}` | {result.replace('|', '/')} | {t['seconds']} | {props} |"
                )
            lines.append("")
        if "bench" in part:
            lines += ["```json", json.dumps(part["bench"], indent=2), "```", ""]
    return "\n".join(lines)


def failed(part: dict) -> bool:
    tests = part.get("tests", [])
    bench = part.get("bench", {})
    return any(t["outcome"] in ("failed", "not run") for t in tests) or any(
        isinstance(b, dict) and "error" in b for b in bench.values()
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", action="append", choices=list(PARTS), required=True)
    parser.add_argument("--out", type=Path, default=ROOT / "docs")
    parser.add_argument(
        "--budget",
        type=float,
        action="append",
        help="seconds for a test part: one for all parts, or one per --part, in order",
    )
    parser.add_argument("-k", dest="select", help="a pytest -k expression within the parts")
    parser.add_argument("--repeats", type=int, default=4, help="bench_sync pushes")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    known = ROOT / "docs" / "gpu.json"
    merged_path = args.out / "gpu.json"
    source = merged_path if merged_path.exists() else known
    parts = json.loads(source.read_text()).get("parts", {}) if source.exists() else {}
    budgets = args.budget or [None]
    if len(budgets) not in (1, len(args.part)):
        parser.error(f"{len(budgets)} --budget values for {len(args.part)} --part values")
    status, machine = 0, versions()
    for i, name in enumerate(args.part):
        part: dict = {"versions": machine}
        if PARTS[name]:
            part["tests"] = run_tests(PARTS[name], budgets[min(i, len(budgets) - 1)], args.select)
        else:
            part["bench"] = run_bench(args.repeats)
        parts[name] = part
        # write after every part: a lease that ends mid-run keeps what finished
        merged_path.write_text(json.dumps({"parts": parts}, indent=2) + "\n")
        (args.out / "gpu.md").write_text(render(parts))
        status |= failed(part)
    print(render({k: parts[k] for k in args.part}))
    return 1 if status else 0


if __name__ == "__main__":
    sys.exit(main())

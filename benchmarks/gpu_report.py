"""Run parts of the GPU tier and benches on a GPU machine and merge what they showed into
docs/gpu.md, each part sized for one ~9-minute lease (a replica start costs ~90 s there).

    python benchmarks/gpu_report.py --part tier [--part moe] [--part bench] [--out DIR]
                                    [--budget S] [-k EXPR] [--bench NAME ...]

Parts: ``tier`` (tests/gpu/test_gpu.py: two replicas sharing the GPU, IPC / storage / round
trips / sleep / a kill; 2 starts + 1 restart), ``moe`` (tests/gpu/test_gpu_moe.py: 5 starts,
4 of them eager), ``bench`` (benchmark scripts, in this order unless ``--bench`` names
others: ``start`` = bench_start.py, one replica then two sharing the GPU, 3 starts;
``policy`` = bench_policy.py, the service, the policy, raw ``vllm.LLM`` / ``AsyncLLM`` and
TorchRL's ``vLLMWrapper`` on the GPU, 3 engines started at once; ``sync`` = bench_sync.py, 1
start; also ``generate`` and ``ceiling``). Each part's rows replace that part's rows in
``DIR/gpu.json`` (default ``docs/``) with the date, device, Python, vLLM, torch and commit of
the run, and ``DIR/gpu.md`` is rendered from all of them; the bench part is written after
every script. ``--budget`` stops a part's pytest with SIGINT after S seconds (it still
writes its results; the tests it did not reach are absent from its table); in the bench
part it is the time of all its scripts: a script whose usual time no longer fits is
skipped, one that runs past what is left is stopped. Exits 1 when a test failed or a
bench did not run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
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
# name -> (script and arguments, its usual seconds on an H100/H200: vLLM starts ~90 s there)
BENCHES = {
    "start": (["benchmarks/bench_start.py"], 210),  # H200 2026-11-27: 192 s
    "policy": (["benchmarks/bench_policy.py"], 240),
    "sync": (["benchmarks/bench_sync.py", "--repeats", "{repeats}"], 130),  # H200: 102 s
    "generate": (["benchmarks/bench_generate.py"], 200),
    "ceiling": (["benchmarks/bench_ceiling.py"], 60),
}
DEFAULT_BENCHES = ("start", "policy", "sync")


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


def run_script(cmd: list[str], timeout: float | None, log: Path | None = None) -> dict:
    """Run one benchmark script in its own session (stopped as a group past ``timeout``:
    vLLM's engine processes go with it); its JSON object, or the reason it has none.
    ``log``: where its output goes (stdout, then stderr)."""
    from torchrl_vllm_ext.jobs.bench import last_json_object

    t0 = time.perf_counter()
    stopped = False
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            [sys.executable, *cmd], cwd=ROOT, stdout=out, stderr=err, start_new_session=True
        )
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            stopped = True
        finally:
            with_group_gone(proc.pid)  # what it left running, or all of it when stopped
            proc.wait()
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    if log is not None:
        log.write_text(stdout + "\n--- stderr ---\n" + stderr)
    tail = [line for line in stderr.strip().splitlines() if line.strip()]
    last = tail[-1][:300] if tail else "no output"
    try:  # a script stopped after it printed its figures (a slow exit) keeps them
        figures = last_json_object(stdout)
    except ValueError:
        if stopped:
            return {"error": f"stopped after {timeout:.0f} s (the part's budget); last: {last}"}
        return {"error": f"exit {proc.returncode}: {last}"}
    if stopped:
        return {**figures, "stopped_after_s": round(timeout, 1)}
    return {**figures, "seconds": round(time.perf_counter() - t0, 1)}


def with_group_gone(pgid: int) -> None:
    """Kill what a finished script left in its session (an engine process)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_benches(
    names, budget_s: float | None, repeats: int, on_result, log_dir: Path | None = None
) -> dict:
    """Run the benchmark scripts ``names`` in order within ``budget_s``; ``on_result(results)``
    after each (results are written as they come); each one's output in
    ``log_dir/bench-<name>.log``."""
    results: dict = {}
    deadline = None if budget_s is None else time.monotonic() + budget_s
    for name in names:
        cmd, usual_s = BENCHES[name]
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left < usual_s:
            results[name] = {"skipped": f"budget: {left:.0f} s left, it takes ~{usual_s} s"}
        else:
            print(f"[gpu_report] bench {name}: {' '.join(cmd)}", flush=True)
            log = log_dir / f"bench-{name}.log" if log_dir is not None else None
            results[name] = run_script([c.format(repeats=repeats) for c in cmd], left, log)
        on_result(results)
    return results


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
            lines += render_benches(part["bench"])
    return "\n".join(lines)


def render_benches(bench: dict) -> list[str]:
    """The bench part: start times, throughput tables, then each script's JSON."""
    lines: list[str] = []
    for name, result in bench.items():
        if not isinstance(result, dict):
            continue
        if "error" in result or "skipped" in result:
            lines += [
                f"### {name}",
                "",
                f"Not measured: {result.get('error') or result['skipped']}",
                "",
            ]
        elif name == "start":
            lines += render_start(result)
        elif name in ("policy", "generate", "ceiling"):
            lines += render_throughput(name, result)
        else:
            lines += [f"### {name}", "", "```json", json.dumps(result, indent=2), "```", ""]
    return lines


def gib(nbytes) -> str:
    return f"{nbytes / (1 << 30):.2f} GiB" if isinstance(nbytes, int | float) else "-"


def render_start(r: dict) -> list[str]:
    pins = list(r.get("two_sharing", {}).get("pins", {}).values())
    pinned = (
        f"pinned {gib(pins[0]['bytes'])}, measured by replica {pins[0]['by']} "
        f"{pins[0]['after_s']} s into its start"
        if pins
        else "no size pinned"
    )
    one_kv = list(r.get("one_replica", {}).get("kv_cache_bytes", {}).values())
    return [
        "### Start: one replica, then two sharing the GPU (bench_start.py)",
        "",
        f"gpus_per_replica={r.get('gpus_per_replica')}; {r.get('model', '')}",
        "",
        "| launch | s | KV cache |",
        "|---|---|---|",
        f"| one replica | {r['one_replica_s']} | {gib(one_kv[0]) if one_kv else '-'} |",
        f"| two sharing the GPU | {r['two_sharing_s']} | {pinned} |",
        "",
        f"Two / one: **{r['ratio_two_vs_one']}** (target <= {r.get('target_ratio', 1.3)}).",
        "",
    ]


def render_throughput(name: str, r: dict) -> list[str]:
    """Tokens/s per system, beside the raw engines (medians; paired ratios of the policy)."""
    systems = {  # each system's median (per-round lists end in "_tokens_per_s" too)
        k.removesuffix("_tokens_per_s"): v
        for k, v in r.items()
        if k.endswith("_tokens_per_s") and isinstance(v, int | float)
    }
    raw = r.get("raw_vllm_tokens_per_s") or r.get("raw_asyncllm_tokens_per_s")
    lines = [
        f"### Throughput: bench_{name}.py ({r.get('prompts')} prompts x {r.get('max_tokens')} "
        f"tokens, medians of {r.get('rounds')} rounds; {r.get('model', '')})",
        "",
        "| system | tokens/s | / raw vLLM | policy / it, paired |",
        "|---|---|---|---|",
    ]
    for system, tps in systems.items():
        paired = r.get(f"paired_median_policy_vs_{system}", "")
        share = f"{tps / raw:.3f}" if raw else "-"
        lines.append(f"| {system} | {tps:,.0f} | {share} | {paired} |")
    extra = {k: v for k, v in r.items() if k.startswith(("ratio_", "paired_ratio", "paired_"))}
    extra = {k: v for k, v in extra.items() if not k.startswith("paired_median_policy_vs_")}
    if extra:
        lines += ["", ", ".join(f"{k} = {v}" for k, v in extra.items())]
    return [*lines, ""]


def failed(part: dict) -> bool:
    tests = part.get("tests", [])
    bench = part.get("bench", {})
    return any(t["outcome"] in ("failed", "not run") for t in tests) or any(
        isinstance(b, dict) and ("error" in b or "skipped" in b) for b in bench.values()
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
    parser.add_argument("--logs", type=Path, help="write each bench script's output here")
    parser.add_argument(
        "--bench",
        action="append",
        choices=list(BENCHES),
        help=f"the bench part's scripts, in order (default: {' '.join(DEFAULT_BENCHES)})",
    )
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

    def write() -> None:
        # after every part and bench: a lease that ends mid-run keeps what finished
        merged_path.write_text(json.dumps({"parts": parts}, indent=2) + "\n")
        try:
            (args.out / "gpu.md").write_text(render(parts))
        except Exception as e:  # gpu.json has it all: a rendering slip costs no run
            print(f"gpu.md not rendered: {type(e).__name__}: {e}", file=sys.stderr)

    for i, name in enumerate(args.part):
        part: dict = {"versions": machine}
        parts[name] = part
        budget = budgets[min(i, len(budgets) - 1)]
        if PARTS[name]:
            part["tests"] = run_tests(PARTS[name], budget, args.select)
        else:
            names = args.bench or DEFAULT_BENCHES

            def partial(results, part=part):
                part["bench"] = dict(results)
                write()

            part["bench"] = run_benches(names, budget, args.repeats, partial, args.logs)
        write()
        status |= failed(part)
    print(render({k: parts[k] for k in args.part}))
    return 1 if status else 0


if __name__ == "__main__":
    sys.exit(main())

"""Error rates of the value check, per family, served dtype and tensor kind, in one run.

For each family of the matrix (``tests/helpers.FAMILY_MATRIX``: a tiny random instance)
and each served dtype, one replica and one storage scheme with the value check on every
push. Each push sets the trainer to the checkpoint plus seeded noise (``--step`` x
N(0, 1) on every parameter: a step the size of the tests' ``perturb``), then:

* **correct** pushes (``--pushes`` per trainer dtype: float32, and the same weights in
  bfloat16): every tensor loads; a push the check would refuse is a *false refusal*;
* **wrong** pushes (``--pushes`` per tensor kind: attention, MLP / expert, norm,
  embedding): one tensor of that kind (a different layer / expert each push) is left out
  of the load with the workers' test hook (``testing.worker``'s ``TORCHRL_VLLM_TEST_BREAK_LOADS``), so the
  replica keeps that tensor's previous value; a push the check passes is a *miss*.

Correct pushes run the scheme's own check with ``verify_tol`` out of reach, so that no push
restarts the replica; wrong pushes are pushed unchecked and then checked the way the
scheme checks (the same :func:`~torchrl_vllm_ext.weight_sync.verify.reference`, replica
probe and mean gap), since a wrong push may leave NaN in the served weights (vLLM's
layerwise reload of MoE models leaves a tensor it was not given uninitialised), which no
limit passes. The decision is then applied as the scheme applies it
(:attr:`~torchrl_vllm_ext.weight_sync.verify.Reference.limit`), and also at other
margins (``gap / noise`` is recorded).

    python benchmarks/bench_verify.py [--families qwen3 phi3] [--dtypes bfloat16 float32]
        [--pushes 20] [--step 0.05] [--out results.json]

Prints one line per family and dtype, and one JSON object last: per family and dtype,
false refusals, catches per kind, the largest correct gap / noise ratio and the smallest
wrong one, and the misses (tensor, gap, limit).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import statistics
import tempfile
import time
from pathlib import Path

import torch

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

KINDS = {  # kind -> checkpoint names it covers (weights only; norms before attention)
    "norm": r"(norm|ln_\w+|layer_norm)\.weight$",
    "embedding": r"(embed_tokens|wte|lm_head)\.weight$",
    "attention": r"(attn|attention)\.\w+\.weight$",
    "mlp": r"(mlp|experts|block_sparse_moe|fc1|fc2)\.[\w.]*weight$",
}
"""Tensor kinds of the wrong pushes, by the regex of their checkpoint names."""
UNREACHABLE = 1e9  # verify_tol: the scheme reports, the benchmark decides
MARGINS = (2.0, 3.0, 4.0, 5.0)


def kinds_of(names) -> dict[str, list[str]]:
    """Checkpoint tensor names by kind (first matching kind wins)."""
    out: dict[str, list[str]] = {k: [] for k in KINDS}
    for name in sorted(names):
        for kind, pattern in KINDS.items():
            if re.search(pattern, name):
                out[kind].append(name)
                break
    return out


def set_weights(trainer, base: dict, step: float, seed: int) -> None:
    """The trainer's parameters = checkpoint + step x N(0, 1), seeded."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in trainer.named_parameters():
            p.copy_(base[name] + torch.randn(p.shape, generator=g) * step)


def plan(kinds: dict[str, list[str]], pushes: int) -> list[tuple[str, str, str | None]]:
    """The run's pushes in order: (version, what, skipped tensor or None), kinds interleaved."""
    out = []
    for i in range(pushes):
        out.append((f"ok32-{i}", "correct_fp32_trainer", None))
        out.append((f"ok16-{i}", "correct_bf16_trainer", None))
        for kind, names in kinds.items():
            if names:
                out.append((f"bad-{kind}-{i}", kind, names[i % len(names)]))
    return out


def run_one(row: str, dtype: str, pushes: int, step: float, root: Path) -> dict:
    from tests.helpers import FAMILY_MATRIX, load_trainer
    from torchrl_vllm_ext import VLLMService, WeightSyncScheme
    from torchrl_vllm_ext.testing import make_tiny_model
    from torchrl_vllm_ext.testing.worker import BREAK_LOADS_ENV, TESTING_WORKER_EXTENSION
    from torchrl_vllm_ext.weight_sync.params import expected_specs
    from torchrl_vllm_ext.weight_sync.verify import Reference, mean_gap, probe_ids, reference

    spec = FAMILY_MATRIX[row]
    path = make_tiny_model(
        root / row, arch=spec.arch, tie_word_embeddings=spec.tie, seed=1, layout=spec.layout
    )
    trainer = load_trainer(path)
    # A bfloat16 trainer as one is loaded (its rotary frequencies stay float32).
    trainer16 = load_trainer(path, dtype=torch.bfloat16)
    base = {n: p.detach().clone() for n, p in trainer.named_parameters()}
    kinds = kinds_of(expected_specs(path))
    pushes_planned = plan(kinds, pushes)
    os.environ[BREAK_LOADS_ENV] = ",".join(f"{v}={t}" for v, _, t in pushes_planned if t)
    rows: list[dict] = []
    t0 = time.perf_counter()
    with VLLMService.launch(
        path,
        num_replicas=1,
        cpus_per_replica=1.0,
        dtype=dtype,
        max_model_len=256,
        enforce_eager=True,
        kv_cache_memory_bytes=64 << 20,
        health_check_interval=0,
        worker_extension_cls=TESTING_WORKER_EXTENSION,  # the broken loads
    ) as svc:
        start_s = time.perf_counter() - t0
        # One scheme per trainer dtype: storage slots keep the dtypes they were made for.
        options = {"transport": "storage", "verify": "always", "verify_tol": UNREACHABLE}
        ids = probe_ids(path)
        with (
            WeightSyncScheme(svc, **options) as scheme32,
            WeightSyncScheme(svc, **options) as scheme16,
        ):
            for i, (version, what, skipped) in enumerate(pushes_planned):
                set_weights(trainer, base, step, seed=1000 + i)
                weights, scheme = trainer, scheme32
                if what == "correct_bf16_trainer":
                    set_weights(trainer16, base, step, seed=1000 + i)
                    weights, scheme = trainer16, scheme16
                if skipped is None:
                    report = scheme.push(weights, version=version)
                    gap, noise = max(report.probe_gap.values()), report.probe_noise
                else:  # checked here: a NaN would restart the replica
                    scheme.verify = "never"
                    scheme.push(weights, version=version)
                    scheme.verify = "always"
                    expected = reference(trainer, ids, dtype)
                    (got,) = svc.run(svc.pool.call_all("probe_logprobs", ids)).results.values()
                    gap, noise = mean_gap(expected.logprobs, got), expected.noise
                limit = Reference([], noise, dtype).limit  # what the scheme allows
                rows.append(
                    {"what": what, "tensor": skipped, "gap": gap, "noise": noise, "limit": limit}
                )
    os.environ.pop(BREAK_LOADS_ENV, None)
    return summarize(row, dtype, rows, start_s, time.perf_counter() - t0)


def summarize(row: str, dtype: str, rows: list[dict], start_s: float, total_s: float) -> dict:
    from torchrl_vllm_ext.weight_sync.verify import TOLERANCE

    def refused(r, margin=None):
        limit = r["limit"] if margin is None else max(TOLERANCE, margin * r["noise"])
        return not r["gap"] <= limit

    correct = [r for r in rows if r["tensor"] is None]
    wrong = [r for r in rows if r["tensor"] is not None]
    out = {
        "family": row,
        "dtype": dtype,
        "correct": len(correct),
        "false_refusals": sum(refused(r) for r in correct),
        "correct_gap_median": statistics.median(r["gap"] for r in correct),
        "correct_gap_max": max(r["gap"] for r in correct),
        "wrong_nan": sum(r["gap"] != r["gap"] for r in wrong),
        "noise_median": statistics.median(r["noise"] for r in correct),
        "caught": {},  # a NaN gap counts as caught (no limit passes it)
        "pushes": {},
        "misses": [],
        "start_s": round(start_s, 1),
        "seconds": round(total_s, 1),
    }
    if dtype != "float32":  # fp32: noise 0, the limit is TOLERANCE
        out["correct_ratio_max"] = max(r["gap"] / r["noise"] for r in correct)
        out["false_refusals_at_margin"] = {
            str(m): sum(refused(r, m) for r in correct) for m in MARGINS
        }
        out["caught_at_margin"] = {str(m): sum(refused(r, m) for r in wrong) for m in MARGINS}
    for kind in KINDS:
        mine = [r for r in wrong if r["what"] == kind]
        out["pushes"][kind] = len(mine)
        out["caught"][kind] = sum(refused(r) for r in mine)
        out["misses"] += [
            {"tensor": r["tensor"], "gap": r["gap"], "limit": r["limit"]}
            for r in mine
            if not refused(r)
        ]
    for kind in KINDS:
        mine = [r["gap"] for r in wrong if r["what"] == kind]
        mine = [g for g in mine if g == g]  # NaN: caught whatever the limit
        out.setdefault("wrong_gap_min", {})[kind] = min(mine) if mine else None
    return out


def totals(results: list[dict]) -> dict:
    """Per served dtype: correct pushes, false refusals, and per kind caught / pushed."""
    out: dict = {}
    for r in results:
        t = out.setdefault(r["dtype"], {"correct": 0, "false_refusals": 0, "caught": {}})
        t["correct"] += r["correct"]
        t["false_refusals"] += r["false_refusals"]
        for kind, n in r["pushes"].items():
            caught, pushed = t["caught"].get(kind, (0, 0))
            t["caught"][kind] = (caught + r["caught"][kind], pushed + n)
    return out


def main(args) -> dict:
    from tests.helpers import FAMILY_MATRIX

    families = args.families or list(FAMILY_MATRIX)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-verify-") as root:
        for row in families:
            for dtype in args.dtypes:
                r = run_one(row, dtype, args.pushes, args.step, Path(root))
                results.append(r)
                print(
                    f"{row:14s} {dtype:9s} false refusals {r['false_refusals']}/{r['correct']}"
                    f"  caught {r['caught']} of {r['pushes']}"
                    f"  correct gap max {r['correct_gap_max']:.3g}"
                    f"  ({r['seconds']:.0f} s)",
                    flush=True,
                )
                if args.out is not None:  # written as it goes: a long run can be read early
                    args.out.write_text(json.dumps({"results": results}, indent=1))
    return {
        "benchmark": "verify_error_rates",
        "pushes_per_kind": args.pushes,
        "step": args.step,
        "totals": totals(results),
        "results": results,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", help="rows of the family matrix (default: all)")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--pushes", type=int, default=20, help="pushes per kind (default 20)")
    parser.add_argument("--step", type=float, default=0.05, help="noise std per push (0.05)")
    parser.add_argument("--out", type=Path, help="also write the results here as they come")
    logging.basicConfig(level=logging.WARNING)
    args = parser.parse_args()
    print(json.dumps(main(args)))

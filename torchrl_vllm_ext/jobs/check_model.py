"""torchrl-vllm check-model PATH: is this architecture served and synced exactly?

Run it once on a model before a long run:

    torchrl-vllm check-model MODEL_DIR [--transports storage broadcast] [--lora] [--output DIR]
        [--dtype bfloat16]

One replica on MODEL_DIR in float32 (--dtype: the dtype it serves), then, against
transformers on the same weights:

1. serve: the replica's log-probs of a fixed sequence (the weight sync's probe) and of 8
   greedily generated tokens equal transformers' within --tol (max |gap|);
2. storage, broadcast: every trainer parameter perturbed (seeded noise), pushed through
   the transport with the value check on; the replica's log-probs then equal the
   perturbed model's again;
3. lora (--lora, a second replica with LoRA on): a random PEFT adapter on every linear
   layer pushed with AdapterSync; its log-probs equal the PEFT model's.

In 16-bit (--dtype bfloat16 / float16) "equal" is the value check's rule: mean |gap| to
transformers in float32 within 3 times the rounding noise transformers itself shows in
that dtype; the pushes run the scheme's default check, which must pass; the checks are
named bf16_serve, ... (fp16_), the support table's 16-bit columns.

It prints one line per check and, last, one JSON object (also written to
DIR/<model>.json; the log, vLLM's and the replica's lines included, goes to
DIR/torchrl-vllm.log unless -v); exit status 0 when every check passed, 1 otherwise, 2 on
a typed error. Where vLLM cannot start the model, the serve check fails with vLLM's own
error and the others are not run. --render RESULTS.json [--into DOC] prints (or writes
between the document's markers) the support table from such results (a list of them, or
the family matrix's {"families": [...]}) instead.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from torchrl_vllm_ext.jobs.support_table import (
    engine_reason,
    load_results,
    render_table,
    replace_table,
)
from torchrl_vllm_ext.weight_sync.transports import registry

logger = logging.getLogger(__name__)

TRANSPORTS = registry.names(cpu=True, composite=False)
"""The transports a check pushes with: those CPU replicas can use (GPU-only ones: tests/gpu)."""
TOLERANCE = 1e-4
"""Max |replica - transformers| log-prob in float32 (the tests' bound)."""
DTYPES = {"float32": "", "bfloat16": "bf16_", "float16": "fp16_"}
"""Served dtypes and the prefix of their checks' names."""
GENERATED_TOKENS = 8
ENGINE_KWARGS = {"dtype": "float32", "max_model_len": 256, "enforce_eager": True}
"""The replica's engine arguments: exact (fp32), short context, no graph capture."""
LORA_RANK = 8


@dataclass
class Check:
    """One cell of the support table."""

    ok: bool | None = None
    """Passed, failed, or ``None``: not run (``error`` says why)."""
    gap: float | None = None
    """Max |replica - transformers| log-prob seen by the check."""
    error: str | None = None
    """Why it failed or was not run (vLLM's own message where the engine refused)."""
    seconds: float = 0.0
    engine: bool = False
    """vLLM itself refused (its start-up error): an engine limit, not this package's."""
    probe_gap: float | None = None
    """Push checks: the scheme's own value check (``SyncReport.probe_gap``, mean gap)."""


@dataclass
class ModelCheck:
    """What :func:`check_model` found for one model."""

    model: str
    architecture: str
    checks: dict[str, Check] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return all(c.ok is not False for c in self.checks.values()) and any(
            c.ok for c in self.checks.values()
        )

    def to_json(self) -> dict:
        return {**asdict(self), "ok": self.ok}


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "check-model",
        help="serve a model on one replica, score it against transformers, push round trips",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", nargs="?", help="local Hugging Face model directory")
    p.add_argument(
        "--transports",
        nargs="+",
        default=list(TRANSPORTS),
        choices=TRANSPORTS,
        help="weight-sync transports to round-trip (default: both)",
    )
    p.add_argument("--lora", action="store_true", help="also push a LoRA adapter (2nd replica)")
    p.add_argument(
        "--tol", type=float, default=TOLERANCE, help=f"max |gap| in float32 ({TOLERANCE:g})"
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=list(DTYPES),
        help="the dtype the replica serves (default float32)",
    )
    p.add_argument(
        "--output",
        type=Path,
        default=Path("check-model"),
        help="directory of the log file and the JSON result (default ./check-model)",
    )
    p.add_argument(
        "--render", type=Path, metavar="RESULTS", help="print the support table of RESULTS"
    )
    p.add_argument(
        "--into", type=Path, metavar="DOC", help="with --render: replace DOC's table (markers)"
    )
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from torchrl_vllm_ext.errors import ConfigurationError

    if args.render is not None:
        table = render_table(load_results(args.render))
        if args.into is None:
            print(table)
        else:
            args.into.write_text(replace_table(args.into.read_text(), table))
        return 0
    if args.model is None:
        raise ConfigurationError("check-model needs a model directory (or --render RESULTS).")
    from torchrl_vllm_ext.jobs.logs import job_log_file

    args.output.mkdir(parents=True, exist_ok=True)
    log_file = None if args.verbose else job_log_file(args.output)
    result = check_model(
        args.model,
        transports=args.transports,
        lora=args.lora,
        tol=args.tol,
        dtype=args.dtype,
        log_file=log_file,
    )
    for name, check in result.checks.items():
        print(_line(name, check))
    out = result.to_json()
    (args.output / f"{Path(args.model).name}.json").write_text(json.dumps(out, indent=1))
    print(json.dumps(out))
    return 0 if result.ok else 1


def _line(name: str, check: Check) -> str:
    state = {True: "ok", False: "FAILED", None: "not run"}[check.ok]
    gap = "" if check.gap is None else f"  max |gap| {check.gap:.1e}"
    why = f"  ({check.error})" if check.error else ""
    return f"{name:10s} {state}{gap}{why}"


# ---------------------------------------------------------------------------- the checks
def check_model(
    model: str | Path,
    transports=TRANSPORTS,
    lora: bool = False,
    tol: float = TOLERANCE,
    dtype: str = "float32",
    **launch_kwargs,
) -> ModelCheck:
    """Serve ``model`` on one replica, score it against transformers, round-trip pushes.

    ``launch_kwargs`` go to :meth:`VLLMService.launch` (e.g. ``cpus_per_replica``,
    ``kv_cache_memory_bytes``); the engine serves ``dtype`` (``tol``: the float32 bound;
    16-bit checks use the value check's rule). Never raises for a failed check: each is a
    :class:`Check` of the result, named with the dtype's prefix (``bf16_serve``, ...).
    """
    from torchrl_vllm_ext.errors import ConfigurationError

    if dtype not in DTYPES:
        raise ConfigurationError(f"dtype={dtype!r} is not one of {list(DTYPES)}.")
    launch_kwargs = {**launch_kwargs, "dtype": dtype}
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from torchrl_vllm_ext.weight_sync.verify import reference_attention

    judge = Judge(dtype, tol)
    serve, lora_name = DTYPES[dtype] + "serve", DTYPES[dtype] + "lora"

    model = Path(model)
    start = time.perf_counter()
    config = AutoConfig.from_pretrained(model)
    result = ModelCheck(str(model), (config.architectures or [type(config).__name__])[0])
    trainer = AutoModelForCausalLM.from_pretrained(
        model, dtype=torch.float32, **reference_attention(config)
    ).eval()
    with _one_replica(model, launch_kwargs, result.checks, serve) as service:
        if service is not None:
            _run(result.checks, serve, lambda: _serve_gap(service, trainer, judge))
            for i, transport in enumerate(transports):  # also after a serve mismatch
                _run(
                    result.checks,
                    DTYPES[dtype] + transport,
                    lambda t=transport, s=i + 1: _push_gap(service, trainer, t, s, judge),
                )
        else:
            for transport in transports:
                result.checks[DTYPES[dtype] + transport] = Check(
                    error="not run: the model was not served"
                )
    if lora:
        if result.checks[serve].engine:  # vLLM refused the model itself
            result.checks[lora_name] = Check(error="not run: the model was not served")
        else:
            lora_kwargs = {**launch_kwargs, "enable_lora": True, "max_lora_rank": LORA_RANK}
            with _one_replica(model, lora_kwargs, result.checks, lora_name) as service:
                if service is not None:
                    _run(result.checks, lora_name, lambda: _lora_gap(service, model, judge))
    result.seconds = time.perf_counter() - start
    return result


@contextmanager
def _one_replica(model, launch_kwargs: dict, checks: dict, name: str):
    """A one-replica service for a ``with`` block, shut down at its end; ``None`` (and the
    check ``name`` failed with vLLM's reason) when vLLM cannot start the model."""
    from torchrl_vllm_ext import VLLMService
    from torchrl_vllm_ext.errors import ReplicaStartupError

    options = {"health_check_interval": 0, **ENGINE_KWARGS, **launch_kwargs}
    t0 = time.perf_counter()
    try:
        service = VLLMService.launch(model, num_replicas=1, **options)
    except ReplicaStartupError as e:
        logger.warning("%s: vLLM could not start %s: %s", name, model, e)
        reason = f"vLLM: {engine_reason(e)}"
        checks[name] = Check(False, error=reason, seconds=time.perf_counter() - t0, engine=True)
        yield None
        return
    try:
        yield service
    finally:
        service.shutdown()


def _run(checks: dict, name: str, fn) -> None:
    t0 = time.perf_counter()
    probe_gap = None
    try:
        ok, gap, error, *rest = fn()
        probe_gap = rest[0] if rest else None
    except Exception as e:  # a failed check is a result, with the typed error's message
        logger.exception("check %s failed", name)
        ok, gap, error = False, None, f"{type(e).__name__}: {e}"
    checks[name] = Check(ok, gap, error, time.perf_counter() - t0, probe_gap=probe_gap)


def _verdict(gap: float, tol: float, what: str = "max") -> tuple[bool, float, str | None]:
    ok = gap <= tol  # False for NaN
    return ok, gap, None if ok else f"{what} |gap| {gap:.3g} > {tol:.3g}"


@dataclass(frozen=True)
class Judge:
    """How a check compares the replica's log-probs with transformers' in the served dtype:
    max |gap| <= ``tol`` in float32; in 16-bit the value check's rule (mean |gap| to
    float32 within :attr:`~torchrl_vllm_ext.weight_sync.verify.Reference.limit`)."""

    dtype: str
    tol: float

    def __call__(self, model, ids: list[int], got: list[float], last: int = 0):
        """The verdict on ``got``, the replica's log-probs of ``ids[1:]`` (or of the last
        ``last`` of them)."""
        from torchrl_vllm_ext.weight_sync.verify import mean_gap, model_logprobs, reference

        if self.dtype == "float32":
            ref = model_logprobs(model, ids)
            return _verdict(_gap(ref[-last:] if last else ref, got), self.tol)
        expected = reference(model, ids, self.dtype)
        ref = expected.logprobs[-last:] if last else expected.logprobs
        return _verdict(mean_gap(ref, got), expected.limit, "mean")


def _scored(service, ids: list[int], lora=None) -> list[float]:
    """The replica's log-probs of ``ids[1:]``."""
    (data,) = service.generate_request_data(
        [ids], {"max_tokens": 1, "prompt_logprobs": 0}, lora=lora
    )
    return [float(x) for x in data.prompt_logprobs[1:]]


def _gap(reference: list[float], got: list[float]) -> float:
    if len(reference) != len(got):
        return math.nan
    return max((abs(a - b) for a, b in zip(reference, got, strict=True)), default=0.0)


def _serve_gap(service, trainer, judge: Judge):
    """Scored probe and greedily generated tokens against transformers (the worse)."""
    from torchrl_vllm_ext.weight_sync.verify import probe_ids

    ids = probe_ids(service.config.model)
    scored = judge(trainer, ids, _scored(service, ids))
    (data,) = service.generate_request_data(
        [ids[:8]], {"max_tokens": GENERATED_TOKENS, "temperature": 0.0, "ignore_eos": True}
    )
    sample = data.samples[0]
    full = ids[:8] + [int(t) for t in sample.token_ids]
    got = [float(x) for x in sample.logprobs]
    generated = judge(trainer, full, got, last=len(got))
    failed = [v for v in (scored, generated) if not v[0]]
    return failed[0] if failed else max(scored, generated, key=lambda v: v[1])


def perturb(model, seed: int) -> None:
    """Seeded noise on every parameter (a stand-in for a training step; the tests use it too)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


def _push_gap(service, trainer, transport: str, seed: int, judge: Judge):
    """Perturb, push with the value check (its default limit), then score the probe again."""
    from torchrl_vllm_ext import WeightSyncScheme
    from torchrl_vllm_ext.weight_sync.verify import probe_ids

    service.run(service.pool.wait_ready())  # a replica a failed check restarted is back
    perturb(trainer, seed)
    with WeightSyncScheme(service, transport=transport, verify="always") as scheme:
        report = scheme.push(trainer, version=f"check-{transport}")
    ids = probe_ids(service.config.model)
    verdict = judge(trainer, ids, _scored(service, ids))
    logger.info(
        "%s push: probe gap %s (limit %.3g), |gap| %.2e",
        transport,
        report.probe_gap,
        report.probe_limit,
        verdict[1],
    )
    return (*verdict, max(report.probe_gap.values(), default=None))


def _lora_gap(service, model_dir: Path, judge: Judge):
    """A random PEFT adapter on every linear layer, pushed with AdapterSync."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from torchrl_vllm_ext import AdapterSync
    from torchrl_vllm_ext.weight_sync.verify import probe_ids, reference_attention

    config = AutoConfig.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, **reference_attention(config)
    )
    config = LoraConfig(
        r=LORA_RANK, lora_alpha=2 * LORA_RANK, target_modules="all-linear", lora_dropout=0.0
    )
    adapter = get_peft_model(base, config)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in adapter.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.05)
    adapter.eval()
    ids = probe_ids(model_dir)
    with AdapterSync(service, "check", keep=1) as sync:
        sync.push(adapter, 1)
        got = _scored(service, ids, lora=sync.current)
    return judge(adapter, ids, got)


if __name__ == "__main__":
    from torchrl_vllm_ext.cli import main

    sys.exit(main(["check-model", *sys.argv[1:]]))

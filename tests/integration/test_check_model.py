"""``torchrl-vllm check-model`` on real vLLM-CPU: a model that works passes every check
(exit 0); a push that does not arrive fails its check (exit 1); a model vLLM-CPU cannot
serve fails with vLLM's own reason."""

from __future__ import annotations

import json
import os

import pytest

from torchrl_vllm_ext.cli import build_parser
from torchrl_vllm_ext.jobs import check_model, support_table
from torchrl_vllm_ext.testing import make_tiny_model
from torchrl_vllm_ext.testing.worker import BREAK_LOADS_ENV, TESTING_WORKER_EXTENSION

from ..helpers import CPU_TRANSPORTS, CPUS_PER_REPLICA


def run_check(capsys, *argv) -> tuple[int, dict]:
    args = build_parser().parse_args(["check-model", *map(str, argv)])
    code = check_model.run(args)
    return code, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_check_model_passes_a_served_family(tmp_path, capsys, ray_cluster):
    path = make_tiny_model(tmp_path / "phi3", arch="phi3", tie_word_embeddings=False, seed=2)
    code, result = run_check(capsys, path, "--lora", "--output", tmp_path / "out", "-v")
    assert code == 0, result
    assert result["architecture"] == "Phi3ForCausalLM" and result["ok"]
    for name in ("serve", *CPU_TRANSPORTS, "lora"):
        assert result["checks"][name]["ok"] is True, name
        assert result["checks"][name]["gap"] < check_model.TOLERANCE
    for name in CPU_TRANSPORTS:  # the scheme's own value check ran too
        assert result["checks"][name]["probe_gap"] < check_model.TOLERANCE
    assert json.loads((tmp_path / "out" / "phi3.json").read_text()) == result
    table = support_table.render_table([result]).splitlines()
    assert table[2].startswith(f"| {path.name} | Phi3ForCausalLM | yes (")


# Slow: by default test_families.py[phi3-bf16] pushes Phi-3 to bf16 replicas through the
# same value check (which must pass), and the bfloat16 case of
# test_check_model_fails_a_push_that_does_not_arrive runs the command's bf16 cells.
@pytest.mark.slow
def test_check_model_passes_phi3_served_in_bfloat16(tmp_path, capsys, ray_cluster):
    # Phi-3 in bf16: the push the old fixed 16-bit tolerance refused although it arrived.
    path = make_tiny_model(tmp_path / "phi3", arch="phi3", tie_word_embeddings=False, seed=2)
    code, result = run_check(capsys, path, "--dtype", "bfloat16", "--output", tmp_path, "-v")
    assert code == 0, result
    assert set(result["checks"]) == {"bf16_serve", "bf16_storage", "bf16_broadcast"}
    assert all(c["ok"] for c in result["checks"].values()), result
    table = support_table.render_table([result]).splitlines()
    assert table[2].count("yes (") == 3


# float32 is slow: the command's failed-check path is the same for both dtypes (the
# bfloat16 case runs it by default), and the scheme's value check refusing a float32 load
# that missed a tensor runs by default in test_moe_sync.py::test_broken_load_fails_by_value.
@pytest.mark.parametrize("dtype", [pytest.param("float32", marks=pytest.mark.slow), "bfloat16"])
def test_check_model_fails_a_push_that_does_not_arrive(tmp_path, capsys, ray_cluster, dtype):
    path = make_tiny_model(tmp_path / "qwen3", arch="qwen3", seed=2)
    # The replica's worker leaves one tensor out of the storage push's load.
    os.environ[BREAK_LOADS_ENV] = "check-storage=model.layers.1.self_attn.o_proj.weight"
    try:
        checked = check_model.check_model(
            path,
            transports=("storage",),
            dtype=dtype,
            cpus_per_replica=CPUS_PER_REPLICA,
            worker_extension_cls=TESTING_WORKER_EXTENSION,
        )
        code, result = int(not checked.ok), checked.to_json()
    finally:
        del os.environ[BREAK_LOADS_ENV]
    prefix = check_model.DTYPES[dtype]
    assert code == 1
    assert result["checks"][prefix + "serve"]["ok"] is True
    storage = result["checks"][prefix + "storage"]
    assert storage["ok"] is False and "probe sequence differ" in storage["error"]
    assert prefix + "broadcast" not in result["checks"]


def test_check_model_reports_vllms_reason(tmp_path, ray_cluster):
    # head_dim 24: vLLM-CPU's attention has no kernel for it.
    path = make_tiny_model(tmp_path / "m", arch="llama", hidden_size=96, head_dim=24)
    result = check_model.check_model(path, cpus_per_replica=CPUS_PER_REPLICA)
    serve = result.checks["serve"]
    assert serve.ok is False and serve.engine
    assert "Unsupported CPU attention" in serve.error and "engine arguments" not in serve.error
    assert result.checks["storage"].ok is None and not result.ok
    row = support_table.render_table([result.to_json()]).splitlines()[2]
    assert "| no (vLLM) |" in row and "Unsupported CPU attention" in row

"""Weight sync of MoE models (Mixtral, Qwen3-MoE): exact after every push, from the
checkpoint's names and from transformers' fused ones, on both transports; a load that
misses a tensor fails the push by value (the probe), not OK by label; a load that fails
half-way restarts the replica instead of serving the mix.

One replica per model, shared by the module's tests (each model starts once). The default
run takes the mixtral row; the qwen3_moe row runs with ``--runslow``: the push's path is the
same for both (transformers' conversion mapping, vLLM's layerwise reload, the scheme's and
pool's failure handling), and tests/unit/test_checkpoint_names.py maps qwen3_moe's fused
experts onto its checkpoint names by default (as the model-family matrix runs a subset of
its rows by default).
"""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from torchrl_vllm_ext import WeightSyncError, WeightSyncScheme
from torchrl_vllm_ext.testing import make_tiny_model
from torchrl_vllm_ext.testing.worker import BREAK_LOADS_ENV, FAIL_HALF_WAY, TESTING_WORKER_EXTENSION

from ..helpers import CPU_TRANSPORTS, assert_replicas_match, launch, perturb, wait_ready

BROKEN = "broken"  # the version whose load the test hook breaks
SKIPPED = "model.layers.1.self_attn.o_proj.weight"
HALF = "half-written"  # the version whose load the test hook fails after half the tensors


@pytest.fixture(
    scope="module", params=["mixtral", pytest.param("qwen3_moe", marks=pytest.mark.slow)]
)
def moe(request, tmp_path_factory, ray_cluster):
    """(arch, model dir, service with one replica, trainer, schemes by transport)."""
    arch = request.param
    path = make_tiny_model(tmp_path_factory.mktemp("moe") / arch, arch=arch, seed=1)
    # Set while the module runs: a replica restarted by one test breaks the next one's
    # load too (only these two versions; the restarts themselves load the served one).
    os.environ[BREAK_LOADS_ENV] = f"{BROKEN}={SKIPPED},{HALF}={FAIL_HALF_WAY}"
    try:
        service = launch(path, num_replicas=1, worker_extension_cls=TESTING_WORKER_EXTENSION)
        trainer = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        schemes = {
            t: WeightSyncScheme(service, transport=t, verify="always") for t in CPU_TRANSPORTS
        }
        yield arch, path, service, trainer, schemes
        for scheme in schemes.values():
            scheme.close()
        service.shutdown()
    finally:
        del os.environ[BREAK_LOADS_ENV]


def checkpoint_tensors(model, out_dir) -> dict[str, torch.Tensor]:
    """The tensors ``save_pretrained`` writes (the checkpoint's per-expert names)."""
    model.save_pretrained(out_dir, safe_serialization=True)
    return load_file(str(out_dir / "model.safetensors"))


def test_moe_model_is_served_like_transformers(moe):
    # First in the module: nothing pushed yet, the replica serves the checkpoint.
    arch, _, service, trainer, _ = moe
    gap = assert_replicas_match(service, trainer, service.weight_version)
    print(f"{arch} served checkpoint: max |replica - transformers| log-prob {gap:.2e}")


@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
@pytest.mark.parametrize("names", ["checkpoint", "transformers"])
def test_moe_push_is_exact(moe, transport, names, tmp_path):
    arch, _, service, trainer, schemes = moe
    perturb(trainer, seed=10 * (transport == "broadcast") + (names == "transformers"))
    version = f"{transport}-{names}"
    weights = checkpoint_tensors(trainer, tmp_path) if names == "checkpoint" else trainer
    report = schemes[transport].push(weights, version=version)
    gap = assert_replicas_match(service, trainer, version)
    assert set(report.probe_gap) == set(service.replica_ids)
    assert max(report.probe_gap.values()) < 1e-4
    print(f"{arch} {transport} {names}: max |replica - trainer| log-prob {gap:.2e}")


@pytest.mark.parametrize("bad", ["missing", "shape"])
def test_bad_fused_expert_tensor_is_refused(moe, bad):
    _, _, service, trainer, schemes = moe
    before = service.weight_version
    state = dict(trainer.state_dict())
    fused = "model.layers.1.mlp.experts.down_proj"
    if bad == "missing":
        del state[fused]
    else:
        state[fused] = state[fused][:, :, :-32]
    with pytest.raises(WeightSyncError, match=f"{fused!r} (is missing|has shape)"):
        schemes["storage"].push(state, version="never")
    assert service.weight_version == before


def test_broken_load_fails_by_value(moe):
    """The test hook leaves one tensor out of the load of version BROKEN: every worker
    still reports the version, and only the probe can tell."""
    _, _, service, trainer, schemes = moe
    before = service.weight_version
    scheme = schemes["storage"]
    scheme.push(trainer, version=before + "-again")  # the storage scheme is the live one
    assert_replicas_match(service, trainer, before + "-again")
    pushed = {k: v.clone() for k, v in trainer.state_dict().items()}
    perturb(trainer, seed=7)
    with pytest.raises(WeightSyncError, match="probe sequence differ"):
        scheme.push(trainer, version=BROKEN)
    # The replica served weights nobody pushed: restarted at the last verified version.
    wait_ready(service, 1)
    trainer.load_state_dict(pushed)
    assert_replicas_match(service, trainer, before + "-again")


def test_a_load_that_fails_half_way_restarts_the_replica(moe):
    """The test hook writes half the tensors of version HALF, then fails: the replica holds
    a mix of two versions, so it is not resumed but restarted at the served version."""
    _, _, service, trainer, schemes = moe
    scheme = schemes["storage"]
    good = service.weight_version + "-good"
    scheme.push(trainer, version=good)
    pushed = {k: v.clone() for k, v in trainer.state_dict().items()}
    perturb(trainer, seed=11)
    with pytest.raises(WeightSyncError, match="had begun writing it") as err:
        scheme.push(trainer, version=HALF)
    assert "failed half-way" in str(err.value) and "restarted" in str(err.value)
    wait_ready(service, 1)
    assert service.weight_version == good
    trainer.load_state_dict(pushed)
    assert_replicas_match(service, trainer, good)

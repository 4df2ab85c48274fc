"""transformers' fused MoE names -> the checkpoint's, and the value check's reference model
(no vLLM): what a push sends is what ``save_pretrained`` writes."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from torchrl_vllm_ext.errors import WeightSyncError
from torchrl_vllm_ext.testing import make_tiny_model
from torchrl_vllm_ext.weight_sync.checkpoint_names import CheckpointNames
from torchrl_vllm_ext.weight_sync.params import expected_specs, validate
from torchrl_vllm_ext.weight_sync.verify import ReferenceModel, model_logprobs, probe_ids


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def moe(request, tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("m") / request.param, arch=request.param)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
    return path, model, CheckpointNames(path, expected_specs(path))


def test_fused_experts_map_onto_what_save_pretrained_writes(moe, tmp_path):
    _path, model, names = moe
    state = model.state_dict()
    assert names.needed(state) and any("experts.gate_up_proj" in n for n in state)
    sent = validate(names.to_checkpoint(state), names.expected)
    model.save_pretrained(tmp_path, safe_serialization=True)
    written = load_file(str(tmp_path / "model.safetensors"))
    assert set(sent) == set(written)
    assert all(torch.equal(sent[n], written[n]) for n in written)


@pytest.mark.parametrize("bad", ["missing", "shape"])
def test_a_missing_or_misshaped_fused_tensor_is_named(moe, bad):
    _, model, names = moe
    state = dict(model.state_dict())
    fused = "model.layers.0.mlp.experts.gate_up_proj"
    if bad == "missing":
        del state[fused]
    else:
        state[fused] = state[fused][:3]
    with pytest.raises(WeightSyncError, match=f"'{fused}' (is missing|has shape)"):
        names.to_checkpoint(state)


def test_the_reference_model_scores_checkpoint_tensors_like_the_trainer(moe):
    path, model, names = moe
    sent = validate(names.to_checkpoint(model.state_dict()), names.expected)
    reference = ReferenceModel(path, names.checkpoint_writers)
    ids = probe_ids(path)
    assert reference.logprobs(sent, ids) == pytest.approx(model_logprobs(model, ids), abs=1e-6)

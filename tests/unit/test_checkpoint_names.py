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


def _sent(path, weights):
    """What a push of ``weights`` sends (the scheme's validate step)."""
    names = CheckpointNames(path, expected_specs(path))
    tensors = {k: v.detach() for k, v in weights.items()}
    if names.needed(tensors):
        tensors = names.to_checkpoint(tensors)
    return validate(tensors, names.expected, optional=names.stale(tensors)), names


@pytest.mark.parametrize("arch", ["gpt2", "opt"])
def test_published_layouts_take_the_trainers_names(arch, tmp_path):
    # GPT-2's and OPT's published checkpoints: base-model names (no transformer. / model.
    # prefix), GPT-2's attention-mask buffers saved. Both engines load them; so must a push.
    path = make_tiny_model(tmp_path / arch, arch=arch, layout="hub", seed=4)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    state = model.state_dict()
    for weights in (state, {k: v.clone() for k, v in state.items()}):  # module, FSDP-like copy
        sent, names = _sent(path, weights)
        assert set(sent) == set(names.expected) - names.stale(sent)
    stale = names.stale({})
    assert stale == {n for n in names.expected if ".attn.bias" in n or "masked_bias" in n}
    assert (arch == "gpt2") == bool(stale)
    # Values, by name: the checkpoint's tensors are the module's.
    ckpt = load_file(str(path / "model.safetensors"))
    for name, t in sent.items():
        torch.testing.assert_close(t, ckpt[name], atol=0, rtol=0)
    # A real tensor missing is still named, as the checkpoint spells it.
    partial = {k: v for k, v in state.items() if not k.endswith("layers.1.fc1.weight")}
    partial = {k: v for k, v in partial.items() if not k.endswith("h.1.mlp.c_fc.weight")}
    with pytest.raises(
        WeightSyncError, match=r"(h\.1\.mlp\.c_fc|decoder\.layers\.1\.fc1)\.weight' is"
    ):
        _sent(path, partial)
    # The value check's reference model takes the pushed tensors under those names.
    ids = probe_ids(path)
    reference = ReferenceModel(path, names.checkpoint_writers)
    assert reference.logprobs(sent, ids) == model_logprobs(model, ids)


@pytest.mark.parametrize("arch", ["gpt2", "opt", "gemma2"])
def test_a_tied_head_pushed_as_its_own_copy_is_accepted(arch, tmp_path):
    # A gathered (FSDP) or cloned state dict holds the tied LM head as a separate tensor;
    # the checkpoint stores none, whatever its embedding is named (wte, decoder.embed_tokens).
    path = make_tiny_model(tmp_path / arch, arch=arch, tie_word_embeddings=True)
    state = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    sent, names = _sent(path, {k: v.clone() for k, v in state.items()})
    assert "lm_head.weight" not in sent and set(sent) == set(names.expected)

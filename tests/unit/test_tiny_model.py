import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from torchrl_vllm_ext.testing import FAMILIES, make_tiny_model


@pytest.mark.parametrize(
    ("arch", "tie", "dtype"),
    [
        ("qwen2", True, "float32"),
        ("llama", False, "bfloat16"),
        ("mixtral", False, "float32"),
        ("qwen3_moe", False, "float32"),
    ],
)
def test_tiny_model_loads_in_transformers(tmp_path, arch, tie, dtype):
    path = make_tiny_model(tmp_path / "m", arch=arch, tie_word_embeddings=tie, dtype=dtype, seed=3)
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert model.config.model_type == arch
    assert model.config.tie_word_embeddings is tie
    assert model.dtype == getattr(torch, dtype)
    assert (model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()) is tie
    ids = tok("hello world")["input_ids"]
    assert tok.decode(ids) == "hello world"
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat.endswith("<|im_start|>assistant\n")
    # Qwen2.5's tokens: EOS (and pad) <|endoftext|>, chat turns end with <|im_end|>.
    assert tok.eos_token == tok.pad_token == "<|endoftext|>"
    assert model.config.eos_token_id == tok.eos_token_id
    assert "hi<|im_end|>" in chat
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert torch.isfinite(logits).all() and logits.shape[-1] == len(tok)


def test_tiny_model_is_cached_and_deterministic(tmp_path):
    a = make_tiny_model(tmp_path / "a", seed=5)
    stamp = (a / "model.safetensors").stat().st_mtime_ns
    assert make_tiny_model(tmp_path / "a", seed=5) == a
    assert (a / "model.safetensors").stat().st_mtime_ns == stamp, "same arguments reuse the model"
    b = make_tiny_model(tmp_path / "b", seed=5)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert json.loads((a / "tokenizer.json").read_text()) == json.loads(
        (b / "tokenizer.json").read_text()
    )
    make_tiny_model(tmp_path / "a", seed=6)  # other arguments rebuild in place
    assert (a / "model.safetensors").read_bytes() != (b / "model.safetensors").read_bytes()


def test_tiny_model_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="arch='bert'"):
        make_tiny_model(tmp_path / "x", arch="bert")
    (tmp_path / "occupied").mkdir()
    (tmp_path / "occupied" / "file.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not a tiny model"):
        make_tiny_model(tmp_path / "occupied")


# The structure each family must have in transformers (what the matrix then serves).
STRUCTURE = {
    "qwen3": lambda c: c.head_dim == 32,
    "llama3": lambda c: c.rope_parameters["rope_type"] == "llama3",
    "gemma2": lambda c: c.attn_logit_softcapping and c.final_logit_softcapping,
    "gemma3_text": lambda c: set(c.layer_types) == {"sliding_attention", "full_attention"},
    "granite": lambda c: c.embedding_multiplier != 1.0 and c.logits_scaling != 1.0,
    "gpt2": lambda c: c.n_embd == 128 and c.n_layer == 2,
    "opt": lambda c: c.ffn_dim == 256 and c.word_embed_proj_dim == 128,
}


@pytest.mark.parametrize("arch", sorted(FAMILIES))
@pytest.mark.parametrize("tie", [True, False])
def test_every_family_builds_with_its_structure(tmp_path, arch, tie):
    path = make_tiny_model(tmp_path / "m", arch=arch, tie_word_embeddings=tie, seed=2)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    config = model.config
    assert config.model_type == arch.replace("llama3", "llama")
    assert type(model).__name__ == FAMILIES[arch].model_cls
    assert config.hidden_size == 128 and config.num_hidden_layers == 2
    assert config.hidden_size // config.num_attention_heads in (32, 64)  # vLLM-CPU head sizes
    tied = model.get_output_embeddings().weight.data_ptr() == (
        model.get_input_embeddings().weight.data_ptr()
    )
    assert tied is tie
    assert STRUCTURE.get(arch, lambda c: True)(config)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([list(range(5, 45))])).logits[0], -1)
    entropy = -(logp.exp() * logp).sum(-1).mean()
    assert torch.isfinite(logp).all() and 1.0 < entropy < 6.0, "peaked, not degenerate"


def test_tiny_tokenizer_has_a_pad_word_like_qwens(tmp_path):
    # TorchRL's GRPO scripts replace a pad equal to EOS with "PAD", a word of Qwen's vocabulary.
    tok = AutoTokenizer.from_pretrained(make_tiny_model(tmp_path / "m"))
    tok.pad_token = "PAD"
    assert isinstance(tok.pad_token_id, int) and tok.pad_token_id != tok.eos_token_id

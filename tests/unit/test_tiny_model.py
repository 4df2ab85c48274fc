import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from torchrl_vllm_ext.testing import make_tiny_model


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
    assert tok.eos_token == "<|im_end|>" and model.config.eos_token_id == tok.eos_token_id
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
    with pytest.raises(ValueError, match="arch='gpt2'"):
        make_tiny_model(tmp_path / "x", arch="gpt2")
    (tmp_path / "occupied").mkdir()
    (tmp_path / "occupied" / "file.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not a tiny model"):
        make_tiny_model(tmp_path / "occupied")

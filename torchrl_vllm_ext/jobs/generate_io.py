"""Inputs of ``torchrl-vllm generate`` (formats in :mod:`.generate`), read, checked and
tokenised before any engine starts; errors name the JSONL line or the memmap row.

>>> parse_jsonl_line('{"prompt": "hi", "id": 7}', 1)
('prompt', 'hi', '7', set())
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import torch
from tensordict import TensorDict

from torchrl_vllm_ext.errors import ConfigurationError, InvalidRequestError
from torchrl_vllm_ext.wrappers.inputs import check_vocab, read_tokens, tokenize
from torchrl_vllm_ext.wrappers.padding import left_mask, left_pad, lengths_of

logger = logging.getLogger(__name__)

KINDS = {  # the key that carries a line's prompt -> the check of its value, and the fix
    "prompt": (lambda v: isinstance(v, str) and v, "a non-empty string"),
    "messages": (
        lambda v: isinstance(v, list) and v and all(map(_is_message, v)),
        'a non-empty list of {"role": str, "content": str} objects',
    ),
    "prompt_token_ids": (
        lambda v: isinstance(v, list) and v and all(map(_is_token_id, v)),
        "a non-empty list of non-negative ints",
    ),
}


def _is_message(m) -> bool:
    return isinstance(m, dict) and all(isinstance(m.get(k), str) for k in ("role", "content"))


def _is_token_id(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0


@dataclass
class Prompts:
    """An input's prompts in order: ids, the texts they came from, row ids, content digest."""

    kind: str
    token_ids: list[np.ndarray]
    texts: list[str] | None
    ids: list[str] | None
    digest: str

    def __len__(self) -> int:
        return len(self.token_ids)

    @cached_property
    def lengths(self) -> np.ndarray:
        return lengths_of(self.token_ids)


def read_prompts(path: str | Path, tokenizer, pad_token_id: int | None = None) -> Prompts:
    """Read ``path`` (a JSONL file or a memmapped TensorDict directory) into :class:`Prompts`."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ConfigurationError(
            f"--input {str(path)!r} does not exist; pass a JSONL file or a TensorDict.memmap dir."
        )
    try:
        if p.is_dir():
            prompts = read_memmap(p, pad_token_id)
        else:
            prompts = read_jsonl(p.read_bytes(), tokenizer, source=str(path))
    except OSError as e:
        raise ConfigurationError(f"--input {str(path)!r}: {e}; check its permissions.") from None
    check_vocab(prompts.token_ids, "--input", None)  # no row without tokens
    return prompts


def parse_jsonl_line(line: str, lineno: int, source: str = "input"):
    """One JSONL line -> ``(kind, value, id, ignored keys)``; errors name the line and the fix."""
    where = f"{source} line {lineno}"
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise InvalidRequestError(
            f"{where} is not valid JSON ({e.msg} at column {e.colno}); each line must be one "
            'object such as {"prompt": "..."}.'
        ) from None
    if not isinstance(obj, dict):
        raise InvalidRequestError(
            f'{where} is a JSON {type(obj).__name__}, not an object; write {{"prompt": "..."}}.'
        )
    present = [k for k in KINDS if k in obj]
    if len(present) != 1:
        raise InvalidRequestError(
            f"{where} must have exactly one of {list(KINDS)}, it has "
            f"{' and '.join(present) or 'none of them'} (keys: {sorted(obj)}); give each line "
            "one prompt."
        )
    kind, row_id = present[0], obj.get("id")
    check, expected = KINDS[kind]
    if not check(obj[kind]):
        raise InvalidRequestError(f'{where}: "{kind}" must be {expected}, got {obj[kind]!r:.80}.')
    if row_id is not None and (not isinstance(row_id, str | int) or isinstance(row_id, bool)):
        raise InvalidRequestError(f"{where}: id={row_id!r} must be a string or an integer.")
    return kind, obj[kind], None if row_id is None else str(row_id), set(obj) - {kind, "id"}


def read_jsonl(raw: bytes, tokenizer, source: str = "input") -> Prompts:
    """Parse and tokenise JSONL bytes (see the module doc)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise InvalidRequestError(
            f"{source} line {line} is not UTF-8 (byte {e.start}); save the file as UTF-8."
        ) from None
    lines = [(n, line) for n, line in enumerate(text.splitlines(), start=1) if line.strip()]
    if not lines:
        raise InvalidRequestError(
            f'{source} holds no prompts; write one JSON object per line, e.g. {{"prompt": "hi"}}.'
        )
    linenos, kinds, values, ids, extra = zip(
        *((n, *parse_jsonl_line(line, n, source)) for n, line in lines), strict=True
    )
    first = {k: linenos[kinds.index(k)] for k in dict.fromkeys(kinds)}
    if len(first) > 1:
        mixed = ", ".join(f"{k!r} (first at line {n})" for k, n in first.items())
        raise InvalidRequestError(
            f"{source} mixes prompt kinds: {mixed}; one file holds one kind, so split it."
        )
    if set().union(*extra):
        logger.warning("%s: ignoring keys %s", source, sorted(set().union(*extra)))
    seen: dict = {}  # every line has an id, all distinct, or no line has one
    for row_id, n in zip(ids, linenos, strict=True):
        if (row_id is None) != (ids[0] is None):
            has = ("no", "one") if row_id is None else ("an", "none")
            raise InvalidRequestError(
                f'{source} line {n} has {has[0]} "id" but line {linenos[0]} has {has[1]}; give '
                "every line an id or none."
            )
        if row_id is not None and seen.setdefault(row_id, n) != n:
            raise InvalidRequestError(
                f"{source} line {n} repeats id {row_id!r} of line {seen[row_id]}; ids must be unique."
            )
    kind, texts = kinds[0], None
    if kind == "prompt_token_ids":
        token_ids = [np.asarray(v, dtype=np.int64) for v in values]
    else:
        texts = (
            list(values) if kind == "prompt" else render_chats(values, tokenizer, linenos, source)
        )
        token_ids = tokenize(tokenizer, texts, add_special_tokens=kind == "prompt")
    row_ids = None if ids[0] is None else list(ids)
    return Prompts(kind, token_ids, texts, row_ids, hashlib.sha256(raw).hexdigest())


def render_chats(chats, tokenizer, linenos, source: str) -> list[str]:
    """Chat histories -> prompt strings through the tokenizer's chat template."""
    out = []
    for chat, n in zip(chats, linenos, strict=True):
        try:
            out.append(
                tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            )
        except Exception as e:  # jinja raises many types; the line number is what helps
            raise InvalidRequestError(
                f"{source} line {n}: the chat template rejected these messages ({e}); check the "
                'roles and their order, or use {"prompt": ...} lines for a model without one.'
            ) from e
    return out


def read_memmap(path: Path, pad_token_id: int | None) -> Prompts:
    """Token ids of a memmapped TensorDict (the accepted layouts are in :mod:`.generate`)."""
    try:
        td = TensorDict.load_memmap(path)
    except Exception as e:  # tensordict raises several types for a damaged directory
        raise ConfigurationError(
            f"--input {str(path)!r} could not be loaded as a memory-mapped TensorDict ({e}); "
            "save one with td.memmap(path) or pass a JSONL file."
        ) from e
    if td.batch_dims != 1:
        raise InvalidRequestError(
            f"--input {str(path)!r} has batch size {tuple(td.batch_size)}; it needs one batch "
            "dim (one row per prompt): reshape it with td.reshape(-1) before saving."
        )
    ids = read_tokens(td, ("tokens", "prompt"), ("masks", "all_attention_mask"), pad_token_id)
    digest = hashlib.sha256(np.concatenate([lengths_of(ids), *ids]).tobytes()).hexdigest()
    return Prompts("memmap", ids, None, None, digest)


def policy_input(prompts: Prompts, lo: int, hi: int, pad: int, seed: int):
    """Rows ``[lo, hi)`` as left-padded tokens with their mask, each seeded by its index."""
    tokens = torch.from_numpy(left_pad(prompts.token_ids[lo:hi], pad, np.int64))
    mask = left_mask(prompts.lengths[lo:hi])
    source = {("tokens", "prompt"): tokens, ("masks", "all_attention_mask"): mask}
    return TensorDict({**source, "seed": torch.arange(lo, hi) + seed}, batch_size=[hi - lo])

"""Inputs of ``torchrl-vllm generate``, read, checked and tokenised before any engine starts.

JSONL: one object per line, all of one kind: ``{"prompt": "text"}`` (tokenised with the
tokenizer's special tokens, as the policy's text mode), ``{"messages": [{"role": ...,
"content": ...}, ...]}`` (rendered by the chat template with the generation prompt, then
tokenised without special tokens, as the history mode) or ``{"prompt_token_ids": [...]}``.
An optional ``"id"`` (str or int) is given on every line or none, and unique. Other keys
are ignored with a warning, blank lines skipped; errors name the 1-based line.

Memmap: a ``TensorDict.memmap`` directory of batch ``(N,)`` with int token ids under
``("tokens", "prompt")``: padded with a bool mask ``("masks", "all_attention_mask")``,
padded without a mask (no position may hold the pad id), or ragged (a lazy stack).

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
from typing import Any

import numpy as np

from torchrl_vllm_ext.errors import ConfigurationError, InvalidRequestError
from torchrl_vllm_ext.wrappers.inputs import check_vocab, read_tokens, tokenize
from torchrl_vllm_ext.wrappers.padding import lengths_of

logger = logging.getLogger(__name__)

KINDS = ("prompt", "messages", "prompt_token_ids")
"""Row kinds of a JSONL input, by the key that carries the prompt."""
TOKEN_KEY, MASK_KEY = ("tokens", "prompt"), ("masks", "all_attention_mask")
"""Where a memmapped input holds its token ids and, if padded, their mask."""
_VALUE_HELP = {
    "prompt": '"prompt" must be a non-empty string',
    "messages": '"messages" must be a non-empty list of {"role": str, "content": str} objects',
    "prompt_token_ids": '"prompt_token_ids" must be a non-empty list of non-negative ints',
}


@dataclass
class Prompts:
    """Every prompt of an input, tokenised, in input order."""

    kind: str
    """``prompt``, ``messages``, ``prompt_token_ids`` (JSONL) or ``memmap``."""
    token_ids: list[np.ndarray]
    """int64 token ids of each row."""
    texts: list[str] | None
    """The text each row's ids came from (chat-templated for ``messages``); None for ids."""
    ids: list[str] | None
    """The rows' ``"id"`` values as str, or None when the input gives none."""
    digest: str
    """sha256 of the input's content: a resumed run must see the same input."""

    def __len__(self) -> int:
        return len(self.token_ids)

    @cached_property
    def lengths(self) -> np.ndarray:
        """Prompt length of each row."""
        return lengths_of(self.token_ids)


def read_prompts(path: str | Path, tokenizer, pad_token_id: int | None = None) -> Prompts:
    """Read ``path`` (a JSONL file or a memmapped TensorDict directory) into :class:`Prompts`."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ConfigurationError(
            f"--input {str(path)!r} does not exist; pass a JSONL file of prompts or the "
            "directory of a memory-mapped TensorDict (TensorDict.memmap)."
        )
    try:
        if p.is_dir():
            prompts = read_memmap(p, pad_token_id)
        else:
            prompts = read_jsonl(p.read_bytes(), tokenizer, source=str(path))
    except OSError as e:
        raise ConfigurationError(
            f"--input {str(path)!r} cannot be read ({e}); check its permissions."
        ) from None
    check_vocab(prompts.token_ids, "--input", None)  # no empty row
    return prompts


def parse_jsonl_line(
    line: str, lineno: int, source: str = "input"
) -> tuple[str, Any, str | None, set]:
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
            f"{where} is a JSON {type(obj).__name__}, not an object; write "
            '{"prompt": "..."}, {"messages": [...]} or {"prompt_token_ids": [...]}.'
        )
    present = [k for k in KINDS if k in obj]
    if len(present) != 1:
        raise InvalidRequestError(
            f"{where} must have exactly one of {list(KINDS)}, it has "
            f"{' and '.join(present) or 'none of them'} (keys: {sorted(obj)}); give each line "
            "one prompt."
        )
    kind, row_id = present[0], obj.get("id")
    value = obj[kind]
    if kind == "prompt":
        ok = isinstance(value, str) and value
    else:
        item = _is_message if kind == "messages" else _is_token_id
        ok = isinstance(value, list) and value and all(map(item, value))
    if not ok:
        raise InvalidRequestError(f"{where}: {_VALUE_HELP[kind]}, got {value!r:.80}.")
    if row_id is not None and (not isinstance(row_id, str | int) or isinstance(row_id, bool)):
        raise InvalidRequestError(
            f"{where}: id={row_id!r} must be a string or an integer (or left out)."
        )
    return kind, value, None if row_id is None else str(row_id), set(obj) - {kind, "id"}


def _is_message(m: Any) -> bool:
    return isinstance(m, dict) and all(isinstance(m.get(k), str) for k in ("role", "content"))


def _is_token_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0


def read_jsonl(raw: bytes, tokenizer, source: str = "input") -> Prompts:
    """Parse and tokenise JSONL bytes (see the module doc)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise InvalidRequestError(
            f"{source} line {line} is not UTF-8 (byte {e.start}); save the file as UTF-8."
        ) from None
    rows = [
        (n, *parse_jsonl_line(line, n, source))
        for n, line in enumerate(text.splitlines(), start=1)
        if line.strip()
    ]
    if not rows:
        raise InvalidRequestError(
            f'{source} holds no prompts; write one JSON object per line, e.g. {{"prompt": "hello"}}.'
        )
    first = {}  # kind -> its first line
    for n, kind, *_ in rows:
        first.setdefault(kind, n)
    if len(first) > 1:
        kinds = ", ".join(f"{k!r} (first at line {n})" for k, n in first.items())
        raise InvalidRequestError(
            f"{source} mixes prompt kinds: {kinds}; one file holds one kind, so split it into one "
            "file per kind."
        )
    linenos, kinds, values, ids, extra = zip(*rows, strict=True)
    if set().union(*extra):
        logger.warning("%s: ignoring keys %s", source, sorted(set().union(*extra)))
    kind = kinds[0]
    texts = None
    if kind == "prompt_token_ids":
        token_ids = [np.asarray(v, dtype=np.int64) for v in values]
    else:
        texts = (
            list(values) if kind == "prompt" else render_chats(values, tokenizer, linenos, source)
        )
        token_ids = tokenize(tokenizer, texts, add_special_tokens=kind == "prompt")
    ids = _check_ids(ids, linenos, source)
    return Prompts(kind, token_ids, texts, ids, hashlib.sha256(raw).hexdigest())


def _check_ids(ids, linenos, source: str) -> list[str] | None:
    """The ids if every line has one, all distinct; None if no line has one."""
    seen: dict[str | None, int] = {}
    for row_id, n in zip(ids, linenos, strict=True):
        if (row_id is None) != (ids[0] is None):
            has = ("no", "one") if row_id is None else ("an", "none")
            raise InvalidRequestError(
                f'{source} line {n} has {has[0]} "id" but line {linenos[0]} has {has[1]}; give '
                "every line an id or none."
            )
        if row_id is not None and row_id in seen:
            raise InvalidRequestError(
                f"{source} line {n} repeats id {row_id!r} of line {seen[row_id]}; ids must be unique."
            )
        seen[row_id] = n
    return None if ids[0] is None else list(ids)


def render_chats(chats, tokenizer, linenos, source: str) -> list[str]:
    """Chat histories -> prompt strings through the tokenizer's chat template."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise InvalidRequestError(
            f'{source} holds "messages" but the model\'s tokenizer has no chat template; use '
            '{"prompt": "..."} lines or a model with a chat template.'
        )
    out = []
    for chat, n in zip(chats, linenos, strict=True):
        try:
            out.append(
                tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            )
        except Exception as e:  # jinja raises many types; the line number is what helps
            raise InvalidRequestError(
                f"{source} line {n}: the chat template rejected these messages ({e}); check the "
                "roles and their order."
            ) from e
    return out


def read_memmap(path: Path, pad_token_id: int | None) -> Prompts:
    """Token ids of a memmapped TensorDict (see the module doc for the accepted layouts)."""
    from tensordict import TensorDict

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
    if TOKEN_KEY not in td.keys(True):
        raise InvalidRequestError(
            f"--input {str(path)!r} has no key {TOKEN_KEY}; it has "
            f"{sorted(map(str, td.keys(True, True)))}. Put the int token ids there (with a bool "
            f"mask under {MASK_KEY} if they are padded)."
        )
    token_ids = read_tokens(td, TOKEN_KEY, MASK_KEY, pad_token_id)
    negative = [i for i, t in enumerate(token_ids) if (t < 0).any()]
    if negative:
        raise InvalidRequestError(
            f"--input {str(path)!r} row {negative[0]} holds a negative token id; token ids must be >= 0."
        )
    h = hashlib.sha256(lengths_of(token_ids).tobytes())  # the lengths, then every id
    for t in token_ids:
        h.update(np.ascontiguousarray(t, dtype=np.int64).tobytes())
    return Prompts("memmap", token_ids, None, None, h.hexdigest())

"""Inputs of ``torchrl-vllm generate``: JSONL prompts or a memory-mapped TensorDict of token ids.

Everything is read, checked and tokenised before any engine starts, so a bad line fails
in a second instead of after a replica launch, and the output can be preallocated at
its exact width (the longest prompt).

JSONL (``--input prompts.jsonl``): one JSON object per line, every line of the same kind:

- ``{"prompt": "text"}``: tokenised as :class:`~torchrl_vllm_ext.VLLMPolicy`'s text mode
  does (``tokenizer(text)``, special tokens added by the tokenizer).
- ``{"messages": [{"role": "user", "content": "..."}, ...]}``: a chat history, rendered by
  the tokenizer's chat template with the generation prompt, then tokenised without
  added special tokens (the policy's history mode).
- ``{"prompt_token_ids": [1, 2, 3]}``: used as given.

An optional ``"id"`` (str or int) names the row; give it on every line or on none, and
keep it unique. Other keys are ignored (with one warning). Blank lines are skipped;
errors name the file's own 1-based line number.

Memmap (``--input DIR``): a directory written by ``TensorDict.memmap`` with batch size
``(N,)`` that holds int token ids under ``("tokens", "prompt")``: a padded ``(N, L)``
tensor with a bool mask ``("masks", "all_attention_mask")`` of the same shape (True =
real token, either padding side), a padded tensor without mask (then every position is
a token and the pad id must not occur), or ragged rows (a memmapped lazy stack).

>>> from torchrl_vllm_ext.jobs.generate_io import parse_jsonl_line
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
from torchrl_vllm_ext.wrappers.inputs import read_tokens, tokenize
from torchrl_vllm_ext.wrappers.padding import lengths_of

logger = logging.getLogger(__name__)

KINDS = ("prompt", "messages", "prompt_token_ids")
"""Row kinds of a JSONL input, by the key that carries the prompt."""
TOKEN_KEY = ("tokens", "prompt")
"""Where a memmapped input holds its token ids (TorchRL's LLM layout)."""
MASK_KEY = ("masks", "all_attention_mask")
"""Where a memmapped input may hold the bool mask of its padded token ids."""


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
        """Prompt length of each row (computed once: every chunk slices it)."""
        return lengths_of(self.token_ids)


def read_prompts(path: str | Path, tokenizer, pad_token_id: int | None = None) -> Prompts:
    """Read ``path`` (a JSONL file or a memmapped TensorDict directory) into :class:`Prompts`."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ConfigurationError(
            f"--input {str(path)!r} does not exist; pass a JSONL file of prompts or the "
            "directory of a memory-mapped TensorDict (TensorDict.memmap)."
        )
    if p.is_dir():
        return read_memmap(p, pad_token_id)
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise ConfigurationError(
            f"--input {str(path)!r} cannot be read ({e.strerror}); check its permissions."
        ) from None
    return read_jsonl(raw, tokenizer, source=str(path))


# ---------------------------------------------------------------------------- JSONL
def parse_jsonl_line(
    line: str, lineno: int, source: str = "input"
) -> tuple[str, Any, str | None, set[str]]:
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
        found = "none of them" if not present else " and ".join(present)
        raise InvalidRequestError(
            f"{where} must have exactly one of {list(KINDS)}, it has {found} (keys: "
            f"{sorted(obj)}); give each line one prompt."
        )
    kind = present[0]
    value = obj[kind]
    if not _value_ok(kind, value):
        raise InvalidRequestError(f"{where}: {_VALUE_HELP[kind]}, got {value!r:.80}.")
    row_id = obj.get("id")
    if row_id is not None and (not isinstance(row_id, str | int) or isinstance(row_id, bool)):
        raise InvalidRequestError(
            f"{where}: id={row_id!r} must be a string or an integer (or left out)."
        )
    return kind, value, None if row_id is None else str(row_id), set(obj) - {kind, "id"}


def _value_ok(kind: str, value: Any) -> bool:
    if kind == "prompt":
        return isinstance(value, str) and bool(value)
    item = _is_message if kind == "messages" else _is_token_id
    return isinstance(value, list) and bool(value) and all(map(item, value))


def _is_message(m: Any) -> bool:
    return isinstance(m, dict) and all(isinstance(m.get(k), str) for k in ("role", "content"))


def _is_token_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0


_VALUE_HELP = {
    "prompt": '"prompt" must be a non-empty string',
    "messages": '"messages" must be a non-empty list of {"role": str, "content": str} objects',
    "prompt_token_ids": '"prompt_token_ids" must be a non-empty list of non-negative ints',
}


def read_jsonl(raw: bytes, tokenizer, source: str = "input") -> Prompts:
    """Parse and tokenise JSONL bytes; every line must be of one kind (see the module doc)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise InvalidRequestError(
            f"{source} line {line} is not UTF-8 (byte {e.start}); save the file as UTF-8."
        ) from None
    kinds: dict[str, int] = {}
    values, ids, linenos = [], [], []
    extra: set[str] = set()
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        kind, value, row_id, unknown = parse_jsonl_line(line, lineno, source)
        kinds.setdefault(kind, lineno)
        if len(kinds) > 1:
            first = ", ".join(f"{k!r} (first at line {n})" for k, n in kinds.items())
            raise InvalidRequestError(
                f"{source} mixes prompt kinds: {first}; one file holds one kind, so split it "
                "into one file per kind."
            )
        extra |= unknown
        values.append(value)
        ids.append(row_id)
        linenos.append(lineno)
    if not values:
        raise InvalidRequestError(
            f"{source} holds no prompts; write one JSON object per line, e.g. "
            '{"prompt": "hello"}.'
        )
    if extra:
        logger.warning(
            "%s: ignoring keys %s (only %s and 'id' are read)", source, sorted(extra), list(KINDS)
        )
    kind = next(iter(kinds))
    row_ids = _check_ids(ids, linenos, source)
    texts = None
    if kind == "prompt_token_ids":
        token_ids = [np.asarray(v, dtype=np.int64) for v in values]
    else:
        texts = values if kind == "prompt" else render_chats(values, tokenizer, linenos, source)
        token_ids = tokenize(tokenizer, texts, add_special_tokens=kind == "prompt")
        for t, lineno in zip(token_ids, linenos, strict=True):
            if t.size == 0:
                raise InvalidRequestError(
                    f"{source} line {lineno} tokenises to no tokens; give a non-empty prompt."
                )
    return Prompts(kind, token_ids, texts, row_ids, hashlib.sha256(raw).hexdigest())


def _check_ids(ids: list[str | None], linenos: list[int], source: str) -> list[str] | None:
    given = [i is not None for i in ids]
    if not any(given):
        return None
    if not all(given):
        raise InvalidRequestError(
            f'{source} line {linenos[given.index(False)]} has no "id" while other lines have '
            "one; give every line an id or none."
        )
    seen: dict[str, int] = {}
    for row_id, lineno in zip(ids, linenos, strict=True):
        if row_id in seen:
            raise InvalidRequestError(
                f"{source} line {lineno} repeats id {row_id!r} of line {seen[row_id]}; ids must be "
                "unique."
            )
        seen[row_id] = lineno
    return ids  # type: ignore[return-value]


def render_chats(chats: list[list[dict]], tokenizer, linenos: list[int], source: str) -> list[str]:
    """Chat histories -> prompt strings through the tokenizer's chat template."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise InvalidRequestError(
            f'{source} holds "messages" but the model\'s tokenizer has no chat template; use '
            '{"prompt": "..."} lines or a model with a chat template.'
        )
    out = []
    for chat, lineno in zip(chats, linenos, strict=True):
        try:
            out.append(
                tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            )
        except Exception as e:  # jinja raises many types; the line number is what helps
            raise InvalidRequestError(
                f"{source} line {lineno}: the chat template rejected these messages ({e}); "
                "check the roles and their order."
            ) from e
    return out


# ---------------------------------------------------------------------------- memmap
def read_memmap(path: Path, pad_token_id: int | None) -> Prompts:
    """Token ids of a memmapped TensorDict (see the module doc for the accepted layouts)."""
    from tensordict import TensorDict

    if not (path / "meta.json").is_file():
        raise ConfigurationError(
            f"--input {str(path)!r} is a directory without meta.json, so not a memory-mapped "
            "TensorDict; save one with td.memmap(path) or pass a JSONL file."
        )
    try:
        td = TensorDict.load_memmap(path)
    except Exception as e:  # tensordict raises several types for a damaged directory
        raise ConfigurationError(
            f"--input {str(path)!r} could not be loaded with TensorDict.load_memmap ({e}); "
            "re-save it with td.memmap(path)."
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
    for i, t in enumerate(token_ids):
        if t.size == 0:
            raise InvalidRequestError(
                f"--input {str(path)!r} row {i} has no tokens (its mask is all False); drop it."
            )
        if (t < 0).any():
            raise InvalidRequestError(
                f"--input {str(path)!r} row {i} holds a negative token id {int(t.min())}."
            )
    h = hashlib.sha256(lengths_of(token_ids).tobytes())  # lengths, then every id
    for t in token_ids:
        h.update(np.ascontiguousarray(t, dtype=np.int64).tobytes())
    return Prompts("memmap", token_ids, None, None, h.hexdigest())

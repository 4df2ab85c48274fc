"""Read a batch of prompts (or scored sequences) out of a TensorDict, with typed errors.

Every reader returns one int64 numpy array per batch element, in row-major order of
the batch dims, without any per-token Python loop: padded tensors are cut with their
mask in one boolean index, nested tensors through their values and offsets, lazy
stacks through their rows' own tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from tensordict import TensorDictBase

from torchrl_vllm_ext.engine.validation import out_of_vocabulary
from torchrl_vllm_ext.errors import InvalidInputTypeError, InvalidRequestError

NestedKey = str | tuple[str, ...]


def key_str(key: NestedKey) -> str:
    return repr(key if isinstance(key, str) else tuple(key))


def rows_of(td: TensorDictBase) -> list[TensorDictBase]:
    """The 0-dim elements of ``td`` in row-major order (a lazy stack's own rows, not copies)."""
    if td.batch_dims == 0:
        return [td]
    return [r for sub in td.unbind(0) for r in rows_of(sub)]


def read_tokens(
    td: TensorDictBase,
    key: NestedKey,
    mask_key: NestedKey | None,
    pad_token_id: int | None,
) -> list[np.ndarray]:
    """Token-id sequences under ``key``: padded + mask, nested/jagged, or ragged lazy rows.

    A padded tensor without a mask is accepted only when it holds no ``pad_token_id``
    (every position is then a real token); otherwise the padding would be ambiguous.
    """
    if key not in td.keys(include_nested=True):
        raise InvalidRequestError(
            f"the input TensorDict has no key {key_str(key)}; it has "
            f"{sorted(map(str, td.keys(True, True)))}. Put the token ids there (int64), or build "
            "the policy with the input_mode that matches your data."
        )
    n = max(1, int(np.prod(td.batch_size)))
    try:
        value = td.get(key)
    except RuntimeError:  # ragged rows of a lazy stack cannot be stacked
        value = None
    if value is None or (isinstance(value, torch.Tensor) and value.is_nested):
        return _from_ragged(td, key, value, n)
    _check_int(value, key)
    tokens = value.reshape(n, value.shape[-1]) if value.ndim else value.reshape(1, 1)
    mask = _matching_mask(td, mask_key, value.shape)
    if mask is None:
        if pad_token_id is not None and bool((tokens == pad_token_id).any()):
            raise InvalidRequestError(
                f"{key_str(key)} is a padded tensor of shape {tuple(value.shape)} that contains the "
                f"pad id {pad_token_id}, and no attention mask of that shape was found under "
                f"{key_str(mask_key)} (a mask of another shape there is an earlier output's, "
                "e.g. after reusing a TensorDict a policy already wrote into). Put a bool mask "
                "(True = real token, same shape) there, or pass ragged tokens (a lazy stack or "
                "a nested tensor) instead."
            )
        return list(tokens.numpy().astype(np.int64, copy=False))
    mask = mask.reshape(tokens.shape).bool()
    lengths = mask.sum(-1).tolist()
    flat = tokens[mask].numpy().astype(np.int64, copy=False)
    return np.split(flat, np.cumsum(lengths)[:-1])


def _matching_mask(td: TensorDictBase, mask_key: NestedKey | None, shape) -> torch.Tensor | None:
    """The mask under ``mask_key`` if it is shaped like the tokens, else None.

    TorchRL's ``all_attention_mask`` describes ``tokens.full``; after a step, collectors
    carry the previous step's mask (prompt + response, possibly ragged) into the next
    reset, where it does not describe the new prompt. Such a mask is not this input's.
    """
    if mask_key is None:
        return None
    try:
        mask = td.get(mask_key, None)
    except RuntimeError:  # ragged rows: a previous step's mask, not one for these tokens
        return None
    if mask is None or mask.shape != shape:
        return None
    return mask


def _from_ragged(td, key, value, n) -> list[np.ndarray]:
    if value is not None:  # a nested tensor (jagged or strided)
        _check_int(value, key)
        if value.layout == torch.jagged:
            offsets = value.offsets().numpy()
            flat = value.values().numpy().astype(np.int64, copy=False)
            return np.split(flat, offsets[1:-1])
        return [t.numpy().astype(np.int64, copy=False) for t in value.unbind(0)]
    rows = td.get(key, as_list=True)
    out = list(flatten_rows(rows))
    if len(out) != n:
        raise InvalidRequestError(
            f"{key_str(key)} holds {len(out)} sequences for a batch of {n}; give one per element."
        )
    for t in out:
        _check_int(t, key)
        if t.ndim != 1:
            raise InvalidRequestError(
                f"{key_str(key)} has a row of shape {tuple(t.shape)}; each row must be 1-D token ids."
            )
    return [t.numpy().astype(np.int64, copy=False) for t in out]


def flatten_rows(rows):
    """Leaves of nested lists, in order (``td.get(key, as_list=True)`` of a >1-D lazy stack)."""
    for r in rows:
        if isinstance(r, list | tuple):
            yield from flatten_rows(r)
        else:
            yield r


def _check_int(t: torch.Tensor, key) -> None:
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise InvalidRequestError(
            f"{key_str(key)} has dtype {t.dtype}; token ids must be integers "
            "(cast with .long(), e.g. td[key] = td[key].long())."
        )


def check_vocab(prompts: Sequence[np.ndarray], key: NestedKey, max_token_id: int | None) -> None:
    """Reject empty sequences and ids outside ``[0, max_token_id]``, naming the key and row."""
    if not prompts:
        raise InvalidRequestError(f"{key_str(key)}: the batch is empty; pass at least one row.")
    lengths = np.fromiter((p.size for p in prompts), dtype=np.int64, count=len(prompts))
    if (lengths == 0).any():
        row = int(np.argmin(lengths))
        raise InvalidRequestError(
            f"{key_str(key)} row {row} is empty (after removing padding); every sequence needs "
            "at least one token."
        )
    if max_token_id is None:
        return
    bad = out_of_vocabulary(prompts, max_token_id)
    if bad is not None:
        row, token = bad
        raise InvalidRequestError(
            f"{key_str(key)} row {row} contains token id {token}, outside the model's "
            f"vocabulary [0, {max_token_id}]; check that the tokenizer matches the served model."
        )


def read_texts(td: TensorDictBase, key: NestedKey) -> list[str]:
    """Strings under ``key`` (NonTensorData / NonTensorStack), flattened row-major."""
    if key not in td.keys(include_nested=True):
        raise InvalidRequestError(
            f"the input TensorDict has no key {key_str(key)}; put the prompt strings there "
            '(e.g. TensorDict({"text": Text(prompt=["..."], batch_size=[1])}, batch_size=[1])).'
        )
    value = td.get(key)
    texts = value.tolist() if hasattr(value, "tolist") else value
    texts = [texts] if isinstance(texts, str) else list(flatten_rows(texts))
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise InvalidInputTypeError(
                f"{key_str(key)} row {i} is a {type(t).__name__}, not a str; text mode needs strings."
            )
    return texts


def read_histories(rows: Sequence[TensorDictBase], key: NestedKey) -> list[Any]:
    """The ``History`` (messages dim only) under ``key`` of each 0-dim row."""
    from torchrl.data.llm import History

    out = []
    for i, row in enumerate(rows):
        history = row.get(key, None)
        if history is None:
            raise InvalidRequestError(
                f"the input TensorDict has no key {key_str(key)} (row {i}); put a torchrl History "
                "there: ChatHistory(prompt=History.from_chats([[{'role': 'user', 'content': ...}]]))."
            )
        if not isinstance(history, History):
            raise InvalidInputTypeError(
                f"{key_str(key)} is a {type(history).__name__}, not a torchrl.data.llm.History; "
                "build it with History.from_chats([[{'role': 'user', 'content': ...}], ...])."
            )
        if history.batch_dims != 1:
            raise InvalidRequestError(
                f"{key_str(key)} row {i} has batch dims {tuple(history.batch_size)}; each batch "
                "element needs a History with exactly one dim (its messages)."
            )
        out.append(history)
    return out


def tokenize(tokenizer, texts: Sequence[str], add_special_tokens: bool = True) -> list[np.ndarray]:
    """Token ids of each text as int64 arrays (one tokenizer call for the batch).

    Text prompts get the tokenizer's special tokens; chat-templated text already holds
    them (``add_special_tokens=False``), as in TorchRL's wrappers.
    """
    ids = tokenizer(list(texts), add_special_tokens=add_special_tokens)["input_ids"]
    return [np.asarray(x, dtype=np.int64) for x in ids]


class PolicyInput(NamedTuple):
    """One call's sequences, read out of the input TensorDict."""

    token_ids: list[np.ndarray]
    """int64 ids of each batch element, row-major."""
    texts: list[str] | None
    """The text the ids came from (chat-templated in history mode); None in tokens mode."""
    histories: list[Any] | None
    """The ``History`` of each element in history mode, else None."""
    assistant_masks: list[torch.Tensor] | None = None
    """Scoring a history: per element, bool True at the tokens of assistant turns (the
    chat template's generation blocks, as TorchRL computes them); else None."""


def read_input(
    td: TensorDictBase,
    key: NestedKey,
    mode: str,
    *,
    tokenizer=None,
    mask_key: NestedKey | None = None,
    pad_token_id: int | None = None,
    add_generation_prompt: bool = True,
    chat_template_kwargs: dict | None = None,
    tokens_key: NestedKey | None = None,
) -> PolicyInput:
    """The sequences under ``key`` in input ``mode`` (tokens, text or history), tokenised.

    ``tokens_key`` (history mode): when the input holds token ids there (TorchRL's
    ``IncrementalTokenizer`` keeps them), they are the engine's input as they are, and the
    history is only rendered for the text outputs: the tokens sampled in earlier turns
    are never re-tokenised.
    """
    if mode == "tokens":
        return PolicyInput(read_tokens(td, key, mask_key, pad_token_id), None, None)
    if mode == "text":
        texts = read_texts(td, key)
        return PolicyInput(tokenize(tokenizer, texts), texts, None)
    histories = read_histories(rows_of(td), key)
    template = {"tokenizer": tokenizer, "add_generation_prompt": add_generation_prompt}
    template.update(chat_template_kwargs or {})
    texts = [h.apply_chat_template(**template) for h in histories]
    if tokens_key is not None and tokens_key in td.keys(include_nested=True):
        return PolicyInput(read_tokens(td, tokens_key, None, pad_token_id), texts, histories)
    ids = tokenize(tokenizer, texts, add_special_tokens=False)
    masks = None
    if not add_generation_prompt:  # scoring: which tokens the assistant wrote
        masks = []
        for h, expect in zip(histories, ids, strict=True):
            enc = h.apply_chat_template(
                **template,
                tokenize=True,
                padding=False,
                return_dict=True,
                return_assistant_tokens_mask=True,
            )
            if enc["input_ids"].tolist() != expect.tolist():
                raise InvalidRequestError(
                    f"{key_str(key)}: the chat template tokenises differently from its rendered "
                    "text, so the assistant mask would not align; check the tokenizer's chat "
                    "template (chat_template_kwargs)."
                )
            masks.append(enc["assistant_masks"].reshape(-1).bool())
    return PolicyInput(ids, texts, histories, masks)

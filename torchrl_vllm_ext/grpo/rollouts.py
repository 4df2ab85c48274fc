"""RolloutRecorder: every GRPO sample, written step by step into a memory-mapped TensorDict."""

from __future__ import annotations

from pathlib import Path

import torch
from tensordict import TensorDict, TensorDictBase
from torch.nn.utils.rnn import pad_sequence

from torchrl_vllm_ext.collectors.partial import has_token_versions, token_spans
from torchrl_vllm_ext.collectors.staleness import sample_versions
from torchrl_vllm_ext.wrappers.inputs import flatten_rows
from torchrl_vllm_ext.wrappers.layout import (
    END_FROM_KEY,
    END_VERSION_KEY,
    NO_TOKEN_VERSION,
    TOKEN_VERSION_KEY,
    VERSION_KEY,
)


def _padded(rows, width: int, value) -> torch.Tensor:
    """Ragged 1-D rows -> ``(len(rows), width)``, cut or padded with ``value``."""
    out = pad_sequence([r[:width] for r in rows], batch_first=True, padding_value=value)
    if out.shape[1] < width:
        out = torch.nn.functional.pad(out, (0, width - out.shape[1]), value=value)
    return out


def response_rows(data: TensorDictBase, key) -> list[torch.Tensor]:
    """Each sample's response values under ``key``, unpadded, in either TorchRL layout.

    Ragged rows come as they are; a padded layout's right-padded rows are cut to the
    sample's response length (its ``("masks", "all_assistant_mask")`` count).
    """
    value = data.get(key, as_list=True)
    if not isinstance(value, torch.Tensor):
        return list(flatten_rows(value))
    lengths = data.get(("masks", "all_assistant_mask")).sum(-1).reshape(-1).tolist()
    return [row[:n] for row, n in zip(value.reshape(len(lengths), -1), lengths, strict=True)]


class RolloutRecorder:
    """A ``(steps, rows)`` memmapped TensorDict at ``path``, allocated once, filled per step.

    Keys: ``prompt`` (int64 ids), ``response`` (int64, padded with -1),
    ``response_log_probs`` (float32, padded with 0), ``reward``, ``advantage``,
    ``weight_version`` (the engine version the row's request was admitted at: the oldest
    weights that made it), ``weight_version_end`` and ``weight_version_end_from`` (the
    version it finished at and its first token made by it: a push in flight fell inside
    the generation when they differ), ``token_weight_version`` (int64 like ``response``,
    padded with -1: the version that made each token, the policy's when it writes them,
    else the oldest the three keys allow;
    ``exact_spans(row["token_weight_version"])`` turns it into exact
    version spans), ``consumed_version`` (the trainer's version when it trained on the
    row), ``stale_tokens`` (response tokens left out of the loss as past the staleness
    bound) and ``step``.
    Rows of a step are written in place, so an interrupted run keeps the finished steps
    (``recorded`` of them; later steps stay zero), and memory stays flat.

    Examples:
        >>> rec = RolloutRecorder(tmp_path / "rollouts", steps=10, rows=4,
        ...                       prompt_len=3, response_len=2)  # doctest: +SKIP
        >>> TensorDict.load_memmap(tmp_path / "rollouts")["reward"].shape  # doctest: +SKIP
        torch.Size([10, 4])
    """

    def __init__(self, path: Path, *, steps: int, rows: int, prompt_len: int, response_len: int):
        self.path = Path(path)
        self.response_len = response_len
        self.recorded = 0
        self.td = TensorDict(
            {
                "prompt": torch.zeros(steps, rows, prompt_len, dtype=torch.int64),
                "response": torch.full((steps, rows, response_len), -1, dtype=torch.int64),
                "response_log_probs": torch.zeros(steps, rows, response_len),
                "reward": torch.zeros(steps, rows),
                "advantage": torch.zeros(steps, rows),
                "weight_version": torch.zeros(steps, rows, dtype=torch.int64),
                "weight_version_end": torch.zeros(steps, rows, dtype=torch.int64),
                "weight_version_end_from": torch.zeros(steps, rows, dtype=torch.int64),
                "token_weight_version": torch.full(
                    (steps, rows, response_len), NO_TOKEN_VERSION, dtype=torch.int64
                ),
                "consumed_version": torch.full((steps, rows), -1, dtype=torch.int64),
                "stale_tokens": torch.zeros(steps, rows, dtype=torch.int64),
                "step": torch.full((steps, rows), -1, dtype=torch.int64),
            },
            batch_size=(steps, rows),
        ).memmap_(self.path)

    def record(
        self,
        step: int,
        batch: TensorDictBase,
        *,
        consumed_version: int | None = None,
        stale_tokens: torch.Tensor | None = None,
    ) -> None:
        """Write the collector's ``batch`` (with ``"advantage"`` set) as step ``step``,
        trained on at the trainer's ``consumed_version`` (-1: not given) with
        ``stale_tokens`` per row left out of the loss (0: none)."""
        data = batch.reshape(-1)
        responses = response_rows(data, ("tokens", "response"))
        log_probs = response_rows(data, ("log_probs", "response"))
        n = len(responses)
        versions = sample_versions(data, VERSION_KEY)
        if data.get(END_VERSION_KEY, None) is not None:
            ends = sample_versions(data, END_VERSION_KEY)
            end_from = data.get(END_FROM_KEY).reshape(-1).long()
        else:  # a policy that records no end version: every token made at the start one
            ends, end_from = versions, torch.zeros(n, dtype=torch.int64)
        row = TensorDict(
            {
                "prompt": data.get(("tokens", "prompt")).reshape(len(responses), -1),
                "response": _padded(responses, self.response_len, -1),
                "response_log_probs": _padded(log_probs, self.response_len, 0.0).float(),
                "reward": data.get(("next", "reward")).reshape(-1).float(),
                "advantage": data.get("advantage").reshape(-1).float(),
                "weight_version": versions,
                "weight_version_end": ends,
                "weight_version_end_from": end_from,
                "token_weight_version": _padded(
                    _token_versions(data, versions, ends, end_from, responses),
                    self.response_len,
                    NO_TOKEN_VERSION,
                ),
                "consumed_version": torch.full(
                    (n,), -1 if consumed_version is None else int(consumed_version)
                ),
                "stale_tokens": (
                    torch.zeros(n, dtype=torch.int64)
                    if stale_tokens is None
                    else stale_tokens.reshape(-1).long()
                ),
                "step": torch.full((n,), step, dtype=torch.int64),
            },
            batch_size=(n,),
        )
        self.td[step].update_(row)
        self.recorded = step + 1


def _token_versions(data, starts, ends, end_from, responses) -> list[torch.Tensor]:
    """Each row's per-token versions: the policy's, or (a policy that writes only the
    three per-sample keys) each token's oldest possible version."""
    if has_token_versions(data):
        return response_rows(data, TOKEN_VERSION_KEY)
    rows = []
    for s, e, k, r in zip(
        starts.tolist(), ends.tolist(), end_from.tolist(), responses, strict=True
    ):
        row = torch.empty(len(r), dtype=torch.int64)
        for span in token_spans(s, e, k, len(r)):
            row[span.token_from : span.token_to] = span.first_version
        rows.append(row)
    return rows


__all__ = ["RolloutRecorder", "response_rows"]

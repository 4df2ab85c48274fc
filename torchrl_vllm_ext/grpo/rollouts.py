"""RolloutRecorder: every GRPO sample, written step by step into a memory-mapped TensorDict."""

from __future__ import annotations

from pathlib import Path

import torch
from tensordict import TensorDict, TensorDictBase
from torch.nn.utils.rnn import pad_sequence

from torchrl_vllm_ext.wrappers.inputs import flatten_rows


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
    ``weight_version`` (the engine version that sampled the row) and ``step``.
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
                "step": torch.full((steps, rows), -1, dtype=torch.int64),
            },
            batch_size=(steps, rows),
        ).memmap_(self.path)

    def record(self, step: int, batch: TensorDictBase) -> None:
        """Write the collector's ``batch`` (with ``"advantage"`` set) as step ``step``."""
        data = batch.reshape(-1)
        responses = response_rows(data, ("tokens", "response"))
        log_probs = response_rows(data, ("log_probs", "response"))
        versions = [int(v) for v in data.get(("vllm", "weight_version")).flatten().tolist()]
        row = TensorDict(
            {
                "prompt": data.get(("tokens", "prompt")).reshape(len(responses), -1),
                "response": _padded(responses, self.response_len, -1),
                "response_log_probs": _padded(log_probs, self.response_len, 0.0).float(),
                "reward": data.get(("next", "reward")).reshape(-1).float(),
                "advantage": data.get("advantage").reshape(-1).float(),
                "weight_version": torch.tensor(versions, dtype=torch.int64),
                "step": torch.full((len(responses),), step, dtype=torch.int64),
            },
            batch_size=(len(responses),),
        )
        self.td[step].update_(row)
        self.recorded = step + 1


__all__ = ["RolloutRecorder", "response_rows"]

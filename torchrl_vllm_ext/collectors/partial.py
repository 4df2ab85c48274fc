"""Partial rollouts: samples whose tokens came from two weight versions.

With ``pause_mode="keep"`` a weight push does not stop the generations in flight: they
resume with the new weights (their KV cache, computed with the old ones, is kept). Such a
sample says so in three keys the policy writes: ``("vllm", "weight_version")`` (the
version it was admitted at: the oldest weights that touched it), ``("vllm",
"weight_version_end")`` and ``("vllm", "weight_version_end_from")``, the index of its
first response token generated with the end version. :func:`mask_stale_tokens` takes the
tokens older than a staleness bound out of the loss, keeping the rest of the sample.
"""

from __future__ import annotations

import torch
from tensordict import TensorDictBase

from torchrl_vllm_ext.collectors.staleness import check_lag, sample_versions
from torchrl_vllm_ext.wrappers.inputs import flatten_rows
from torchrl_vllm_ext.wrappers.layout import END_FROM_KEY, END_VERSION_KEY, VERSION_KEY

ASSISTANT_MASK = ("masks", "all_assistant_mask")


def stale_prefix(td: TensorDictBase, current_version: int, max_policy_lag: int) -> torch.Tensor:
    """Per sample, how many leading response tokens are more than ``max_policy_lag``
    versions behind ``current_version`` (int64, shaped like the batch; ``-1``: all).

    Tokens before ``weight_version_end_from`` count as the start version's (the oldest
    that could have made them), the others as the end version's.
    """
    lag = check_lag(max_policy_lag)
    start = sample_versions(td, VERSION_KEY)
    end = sample_versions(td, END_VERSION_KEY)
    end_from = td.get(END_FROM_KEY).reshape(td.batch_size).long()
    cut = torch.where(current_version - start > lag, end_from, torch.zeros_like(end_from))
    return torch.where(current_version - end > lag, torch.full_like(cut, -1), cut)


def _keep(mask: torch.Tensor, cut: torch.Tensor) -> torch.Tensor:
    """``mask`` without its first ``cut`` True entries along the last dim (``-1``: all)."""
    order = mask.long().cumsum(-1)  # 1, 2, ... at the response tokens
    return mask & (order > cut.unsqueeze(-1)) & (cut.unsqueeze(-1) >= 0)


def mask_stale_tokens(
    td: TensorDictBase, current_version: int, max_policy_lag: int, mask_key=ASSISTANT_MASK
) -> TensorDictBase:
    """Take response tokens more than ``max_policy_lag`` versions old out of ``mask_key``
    (the mask TorchRL's losses average over), in place; returns ``td``.

    Works on the policy's padded and ragged layouts, any batch shape. A sample entirely
    over the bound keeps no token; one that a ``keep`` push spanned keeps the tokens made
    with its end version when only its start version is too old.

    Examples:
        >>> from tensordict import TensorDict, NonTensorStack
        >>> td = TensorDict({("masks", "all_assistant_mask"): torch.tensor(
        ...     [[False, True, True, True], [False, True, True, True]])}, batch_size=[2])
        >>> _ = td.set(("vllm", "weight_version"), NonTensorStack("1", "2"))
        >>> _ = td.set(("vllm", "weight_version_end"), NonTensorStack("2", "2"))
        >>> _ = td.set(("vllm", "weight_version_end_from"), torch.tensor([2, 0]))
        >>> _ = mask_stale_tokens(td, current_version=2, max_policy_lag=0)
        >>> td["masks", "all_assistant_mask"].tolist()
        [[False, False, False, True], [False, True, True, True]]
    """
    cut = stale_prefix(td, int(current_version), max_policy_lag).reshape(-1)
    value = td.get(mask_key, as_list=True)
    if isinstance(value, torch.Tensor):
        flat = value.reshape(-1, value.shape[-1])
        td.set(mask_key, _keep(flat, cut).reshape(value.shape))
        return td
    for row, c in zip(flatten_rows(value), cut.unbind(0), strict=True):
        row.copy_(_keep(row, c))  # the lazy stack's own tensor: written in place
    return td


__all__ = ["END_FROM_KEY", "END_VERSION_KEY", "mask_stale_tokens", "stale_prefix"]

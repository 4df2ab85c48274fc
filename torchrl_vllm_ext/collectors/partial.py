"""Partial rollouts: samples whose tokens came from more than one weight version.

With ``pause_mode="keep"`` a weight push does not stop the generations in flight: they
resume with the new weights (their KV cache, computed with the old ones, is kept). The
policy writes the version that made each response token, ``("vllm",
"token_weight_version")`` (shaped like the response), and three per-sample keys: ``("vllm",
"weight_version")`` (the version it was admitted at: the oldest weights that touched it),
``("vllm", "weight_version_end")`` and ``("vllm", "weight_version_end_from")``, the index
of its first response token generated with the end version. :func:`mask_stale_tokens`
takes the tokens older than a staleness bound out of the loss, keeping the rest of the
sample: exactly those tokens when the per-token key is there, else (rows from a policy
that writes only the three) every token before ``end_from`` as the start version's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tensordict import TensorDictBase

from torchrl_vllm_ext.collectors.staleness import check_lag, sample_versions
from torchrl_vllm_ext.wrappers.inputs import flatten_rows
from torchrl_vllm_ext.wrappers.layout import (
    END_FROM_KEY,
    END_VERSION_KEY,
    NO_TOKEN_VERSION,
    TOKEN_VERSION_KEY,
    VERSION_KEY,
)

ASSISTANT_MASK = ("masks", "all_assistant_mask")
FULL_LOG_PROBS = ("log_probs", "full")


@dataclass(frozen=True)
class VersionSpan:
    """Response tokens ``[token_from, token_to)`` of one sample, made by weights of a
    version in ``[first_version, last_version]``."""

    first_version: int
    """The oldest version that may have made these tokens (the one the bound reads)."""
    last_version: int
    """The newest (above ``first_version`` where pushes fell inside the span)."""
    token_from: int
    token_to: int


def version_runs(versions: Sequence[int] | torch.Tensor) -> list[tuple[int, int, int]]:
    """Runs of equal versions in a sample's per-token versions: ``(version, token_from,
    token_to)``, in order.

    Examples:
        >>> version_runs([3, 3, 4, 5, 5])
        [(3, 0, 2), (4, 2, 3), (5, 3, 5)]
        >>> version_runs([])
        []
    """
    values = versions.tolist() if isinstance(versions, torch.Tensor) else list(versions)
    runs, begin = [], 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[begin]:
            runs.append((int(values[begin]), begin, i))
            begin = i
    return runs


def token_spans(start: int, end: int, end_from: int, length: int) -> list[VersionSpan]:
    """A sample's response tokens as version spans, from the three per-sample keys alone
    (rows from a policy that does not write ``("vllm", "token_weight_version")``; with
    it, :func:`exact_spans`).

    The version a request was admitted at (``start``), the one it finished at (``end``)
    and the first token made with ``end`` (``end_from``) give one span when no push fell
    inside the generation, two when some did. Tokens before ``end_from`` were made by
    ``start`` up to ``end - 1`` (several versions when more than one push fell inside:
    the three keys do not say where each began, so the span names the range and the
    bound reads its oldest).

    Examples:
        >>> token_spans(3, 3, 0, 4)
        [VersionSpan(first_version=3, last_version=3, token_from=0, token_to=4)]
        >>> [(s.first_version, s.last_version, s.token_from, s.token_to)
        ...  for s in token_spans(3, 5, 2, 4)]
        [(3, 4, 0, 2), (5, 5, 2, 4)]
    """
    if end == start or end_from <= 0:
        version = end if end_from <= 0 else start
        return [VersionSpan(version, version, 0, length)]
    if end_from >= length:  # finished before the push: no token of ``end``'s
        return [VersionSpan(start, end - 1, 0, length)]
    return [VersionSpan(start, end - 1, 0, end_from), VersionSpan(end, end, end_from, length)]


def exact_spans(token_versions: Sequence[int] | torch.Tensor) -> list[VersionSpan]:
    """A sample's response tokens as exact version spans, one per run of equal versions,
    from its per-token versions (the policy's ``("vllm", "token_weight_version")`` row,
    or a recorder's; the padding, ``NO_TOKEN_VERSION``, is left out).

    Examples:
        >>> [(s.first_version, s.token_from, s.token_to)
        ...  for s in exact_spans([3, 4, 4, 5, 5, -1])]
        [(3, 0, 1), (4, 1, 3), (5, 3, 5)]
    """
    versions = torch.as_tensor(token_versions)
    runs = version_runs(versions[versions != NO_TOKEN_VERSION])
    return [VersionSpan(v, v, begin, stop) for v, begin, stop in runs]


def has_token_versions(td: TensorDictBase) -> bool:
    """Whether ``td``'s rows carry ``("vllm", "token_weight_version")``."""
    return TOKEN_VERSION_KEY in td.keys(include_nested=True)


def sample_token_versions(td: TensorDictBase) -> list[torch.Tensor]:
    """Each sample's per-token versions (``("vllm", "token_weight_version")``), flat
    over the batch, padded or ragged, without the padding (``NO_TOKEN_VERSION``).

    Examples:
        >>> from tensordict import TensorDict
        >>> td = TensorDict({("vllm", "token_weight_version"): torch.tensor(
        ...     [[1, 2, 2], [2, -1, -1]])}, batch_size=[2])
        >>> [r.tolist() for r in sample_token_versions(td)]
        [[1, 2, 2], [2]]
    """
    return [row[row != NO_TOKEN_VERSION] for row in _rows(td.get(TOKEN_VERSION_KEY, as_list=True))]


def stale_prefix(td: TensorDictBase, current_version: int, max_policy_lag: int) -> torch.Tensor:
    """Per sample, how many leading response tokens are more than ``max_policy_lag``
    versions behind ``current_version`` (int64, shaped like the batch; ``-1``: all).

    With ``("vllm", "token_weight_version")``: the tokens whose own version is past the
    bound (a prefix: versions only grow along a sample). Without: tokens before
    ``weight_version_end_from`` count as the start version's (the oldest that could have
    made them), the others as the end version's.
    """
    lag = check_lag(max_policy_lag)
    if has_token_versions(td):
        bound = current_version - lag
        counts = []
        for row in sample_token_versions(td):
            stale = int((row < bound).sum())
            counts.append(-1 if stale == row.numel() and stale else stale)
        return torch.tensor(counts, dtype=torch.int64).reshape(td.batch_size)
    start = sample_versions(td, VERSION_KEY)
    end = sample_versions(td, END_VERSION_KEY)
    end_from = td.get(END_FROM_KEY).reshape(td.batch_size).long()
    cut = torch.where(current_version - start > lag, end_from, torch.zeros_like(end_from))
    return torch.where(current_version - end > lag, torch.full_like(cut, -1), cut)


def _keep(mask: torch.Tensor, cut: torch.Tensor) -> torch.Tensor:
    """``mask`` without its first ``cut`` True entries along the last dim (``-1``: all)."""
    order = mask.long().cumsum(-1)  # 1, 2, ... at the response tokens
    return mask & (order > cut.unsqueeze(-1)) & (cut.unsqueeze(-1) >= 0)


def _past(mask: torch.Tensor, stale: torch.Tensor) -> torch.Tensor:
    """The entries of ``mask`` at response tokens flagged ``stale`` (response-shaped,
    the last ``stale.shape[-1]`` positions of ``mask``: TorchRL's ``full`` is the prompt
    then the response, padded or not)."""
    out = torch.zeros_like(mask)
    out[..., mask.shape[-1] - stale.shape[-1] :] = stale
    return mask & out


def _stale_positions(
    td: TensorDictBase, current_version: int, max_policy_lag: int, masks
) -> torch.Tensor | list[torch.Tensor]:
    """The True entries of ``masks`` (a padded tensor, or a ragged value: one row each)
    at response tokens made by weights more than ``max_policy_lag`` versions behind:
    ``(N, T)`` for a padded mask, else one 1-D row per sample."""
    per_token = has_token_versions(td)
    if per_token:
        check_lag(max_policy_lag)
        bound = int(current_version) - max_policy_lag
        versions = td.get(TOKEN_VERSION_KEY, as_list=True)
    else:
        cut = stale_prefix(td, int(current_version), max_policy_lag).reshape(-1)
    if isinstance(masks, torch.Tensor):
        flat = masks.reshape(-1, masks.shape[-1]).bool()
        if per_token:
            return _past(flat, versions.reshape(flat.shape[0], -1) < bound)
        return flat & ~_keep(flat, cut)
    rows = [m.bool() for m in _rows(masks)]
    if per_token:
        stale = [v < bound for v in _rows(versions)]
        return [_past(m, s) for m, s in zip(rows, stale, strict=True)]
    return [m & ~_keep(m, c) for m, c in zip(rows, cut.unbind(0), strict=True)]


def mask_stale_tokens(
    td: TensorDictBase, current_version: int, max_policy_lag: int, mask_key=ASSISTANT_MASK
) -> TensorDictBase:
    """Take response tokens more than ``max_policy_lag`` versions old out of ``mask_key``
    (the mask TorchRL's losses average over), in place; returns ``td``.

    Works on the policy's padded and ragged layouts, any batch shape. A sample entirely
    over the bound keeps no token; one that ``keep`` pushes spanned keeps the tokens made
    by versions within the bound: read from ``("vllm", "token_weight_version")`` when the
    rows carry it, else (the three per-sample keys) only its end version's tokens when its
    start version is too old.

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
        >>> _ = td.set(("vllm", "token_weight_version"), torch.tensor([[0, 1, 2], [2, 2, -1]]))
        >>> _ = td.set(("masks", "all_assistant_mask"), torch.tensor(
        ...     [[False, True, True, True], [False, True, True, False]]))
        >>> _ = mask_stale_tokens(td, current_version=2, max_policy_lag=1)  # exact: version 0 out
        >>> td["masks", "all_assistant_mask"].tolist()
        [[False, False, True, True], [False, True, True, False]]
    """
    value = td.get(mask_key, as_list=True)
    stale = _stale_positions(td, current_version, max_policy_lag, value)
    if isinstance(value, torch.Tensor):
        flat = value.reshape(-1, value.shape[-1])
        td.set(mask_key, (flat & ~stale).reshape(value.shape))
        return td
    for row, past in zip(_rows(value), stale, strict=True):
        row.copy_(row & ~past)  # the lazy stack's own tensor: written in place
    return td


def _rows(value):
    """1-D views of every sample's values: a lazy stack's leaves, each a row or (a stack
    of padded batches) rows of its own."""
    for leaf in flatten_rows(value):
        if leaf.dim() > 1:
            yield from leaf.reshape(-1, leaf.shape[-1]).unbind(0)
        else:
            yield leaf


@dataclass(frozen=True)
class StaleTokens:
    """What :func:`exclude_stale_tokens` took out of one batch."""

    samples: int
    """Samples with no token left (every token past the bound)."""
    tokens: int
    """Response tokens taken out, those samples' included."""
    kept_tokens: int
    """Response tokens left for the loss."""
    per_sample: torch.Tensor
    """Tokens taken out of each sample (int64, flat)."""


def exclude_stale_tokens(
    td: TensorDictBase,
    current_version: int,
    max_policy_lag: int,
    *,
    log_probs_key=FULL_LOG_PROBS,
    mask_key=ASSISTANT_MASK,
) -> StaleTokens:
    """Take response tokens more than ``max_policy_lag`` versions old out of TorchRL's
    GRPO / PPO losses, in place: their behaviour log-prob (``log_probs_key``, the
    engine's) becomes NaN, which TorchRL's ``GRPOLoss`` reads as "no score" and leaves
    out of its mask (the ratio, the clip, the token mean and the KL terms).

    ``mask_key`` (the response positions in ``("tokens", "full")``) is left as it is: the
    ``sft`` masking strategy does not read it. Padded and ragged layouts.

    Examples:
        >>> from tensordict import TensorDict, NonTensorStack
        >>> td = TensorDict({("masks", "all_assistant_mask"): torch.tensor(
        ...     [[False, True, True, True], [False, True, True, True]]),
        ...     ("log_probs", "full"): torch.zeros(2, 4)}, batch_size=[2])
        >>> _ = td.set(("vllm", "weight_version"), NonTensorStack("1", "0"))
        >>> _ = td.set(("vllm", "weight_version_end"), NonTensorStack("2", "0"))
        >>> _ = td.set(("vllm", "weight_version_end_from"), torch.tensor([2, 0]))
        >>> out = exclude_stale_tokens(td, current_version=2, max_policy_lag=0)
        >>> out.samples, out.tokens, out.kept_tokens
        (1, 5, 1)
        >>> td["log_probs", "full"].isnan().tolist()
        [[False, True, True, False], [False, True, True, True]]
    """
    masks = td.get(mask_key, as_list=True)
    log_probs = td.get(log_probs_key, as_list=True)
    stale = _stale_positions(td, current_version, max_policy_lag, masks)
    if isinstance(masks, torch.Tensor):
        if stale.any():
            values = log_probs.reshape(stale.shape).masked_fill(stale, float("nan"))
            td.set(log_probs_key, values.reshape(log_probs.shape))
        per_sample, responses = stale.sum(-1), masks.reshape(stale.shape).bool().sum(-1)
    else:
        counts, sizes = [], []
        for mask, lp, past in zip(_rows(masks), _rows(log_probs), stale, strict=True):
            lp.masked_fill_(past, float("nan"))  # a view of the lazy stack's own tensor
            counts.append(int(past.sum()))
            sizes.append(int(mask.bool().sum()))
        per_sample, responses = torch.tensor(counts), torch.tensor(sizes)
    whole = (per_sample == responses) & (responses > 0)
    return StaleTokens(
        samples=int(whole.sum()),
        tokens=int(per_sample.sum()),
        kept_tokens=int((responses - per_sample).sum()),
        per_sample=per_sample.long(),
    )


__all__ = [
    "END_FROM_KEY",
    "END_VERSION_KEY",
    "TOKEN_VERSION_KEY",
    "StaleTokens",
    "VersionSpan",
    "exclude_stale_tokens",
    "has_token_versions",
    "mask_stale_tokens",
    "sample_token_versions",
    "stale_prefix",
    "token_spans",
    "version_runs",
]

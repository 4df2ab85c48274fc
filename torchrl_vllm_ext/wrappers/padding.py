"""Vectorised ragged <-> padded helpers: no per-token Python loop anywhere.

A batch of 1-D sequences is handled as one concatenated array plus its lengths;
padding is one scatter at computed positions.

>>> import numpy as np
>>> left_pad([np.array([1, 2]), np.array([3])], fill=0, dtype=np.int64)
array([[1, 2],
       [0, 3]])
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def lengths_of(arrays: Sequence) -> np.ndarray:
    """Length of each sequence, int64."""
    return np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(arrays))


def cat(arrays: Sequence[np.ndarray], dtype) -> np.ndarray:
    """The sequences end to end as one ``dtype`` array (empty for no sequence)."""
    if not len(arrays):
        return np.zeros(0, dtype=dtype)
    return np.concatenate(arrays).astype(dtype, copy=False)


def positions(lengths: np.ndarray) -> np.ndarray:
    """Position of every element inside its segment: ``[0..L0-1, 0..L1-1, ...]``."""
    total = int(lengths.sum())
    starts = np.cumsum(lengths) - lengths
    return np.arange(total) - np.repeat(starts, lengths)


def starts_of(lengths: np.ndarray) -> np.ndarray:
    """Offset of each segment in the concatenation."""
    return np.cumsum(lengths) - lengths


def pad_flat(
    flat: np.ndarray, lengths: np.ndarray, fill, *, left: bool, width: int | None = None
) -> np.ndarray:
    """Segments of ``flat`` (concatenated, ``lengths``) as rows of a ``(n, width)`` array.

    ``left=True`` aligns each row to the right (left padding, prompts); ``width``
    defaults to the longest segment.
    """
    n = len(lengths)
    width = int(lengths.max(initial=0)) if width is None else width
    out = np.full((n, width), fill, dtype=flat.dtype)
    row_start = np.arange(n) * width + (width - lengths if left else 0)
    out.reshape(-1)[np.repeat(row_start, lengths) + positions(lengths)] = flat
    return out


def left_pad(arrays: Sequence[np.ndarray], fill, dtype, width: int | None = None) -> np.ndarray:
    """Sequences as rows of a dense array, padded on the left (prompts)."""
    return pad_flat(cat(arrays, dtype), lengths_of(arrays), fill, left=True, width=width)


def left_mask(lengths: np.ndarray, width: int | None = None) -> torch.Tensor:
    """Bool ``(n, width)``: True at the real tokens of left-padded rows."""
    lengths = torch.as_tensor(lengths)
    width = int(lengths.max()) if width is None else width
    return torch.arange(width) >= (width - lengths)[:, None]


__all__ = [
    "cat",
    "left_mask",
    "left_pad",
    "lengths_of",
    "pad_flat",
    "positions",
    "starts_of",
]

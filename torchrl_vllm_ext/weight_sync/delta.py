"""Delta pushes: only what changed since the version a replica holds, in the served dtype.

An RL step at a small learning rate moves fp32 master weights by far less than a bf16 ulp,
so most served (bf16) values of a new version are those of the last one. A delta compares
the new version's served-dtype bytes with a base version's, bit for bit, and sends per
tensor nothing (unchanged), the changed positions and their values, or the whole tensor
when more than :data:`DENSE_SHARE` of it changed. Plain functions over flat uint8 buckets
(the packed transports' unit, :mod:`.transports.packing`), run where the buckets are
(CPU or GPU), in chunks that stay in cache:

- :func:`diff_and_sum` (sender): what of one bucket to send, as a
  :class:`~.specs.BucketDelta` and one uint8 payload (values, then positions), and how
  much the bucket's checksum changed;
- :func:`apply_bucket` (receiver): the payload written into the base bucket it holds, as
  two batched calls (one ``_foreach_copy_`` of the whole tensors, one ``index_put_`` of the
  positions); the bucket's checksum, that of the whole new bucket, is then compared;
- :func:`bucket_change` (receiver): what changed, for the pause to write only that into
  the served parameters (:mod:`.loading.scatter`);

Storage sends no deltas: its slots hold whole versions in the served dtype (half an fp32
push's bytes). A slot is written in 4 KB pages and a step's few changed values fall in
nearly every page, so writing only those dirties nearly every page and reads the slot
besides: slower than writing it whole (measured: ``benchmarks/README.md``).

The comparison is of bits (``-0.0`` and ``0.0`` differ, a NaN never equals itself: a push
is finite anyway), so a base plus its delta is the new version bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torchrl_vllm_ext.weight_sync.loading.scatter import BucketChange
from torchrl_vllm_ext.weight_sync.params import torch_dtype
from torchrl_vllm_ext.weight_sync.specs import BucketDelta, BucketSpec

DENSE_SHARE = 0.1
"""A tensor with more than this share of its elements changed is sent whole. A changed bf16
element costs its value and a 4-byte position (three times the value), and the receiver
writes it by position, which costs more than copying the tensor whole past about this
share (measured: ``benchmarks/README.md``, ``bench_delta.py --dense-shares``)."""

WORTH_SHARE = 0.5
"""A delta whose payload exceeds this share of the full update's bytes is not sent: the
full update goes instead (float32 serving, where every value changes, or a first step)."""

CHUNK = 1 << 20
"""Elements compared at a time on the CPU (a few MB: the comparison's scratch stays in
cache, faster than comparing whole buckets; ``benchmarks/README.md``)."""

_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def words(buffer: torch.Tensor, dtype: str | torch.dtype) -> torch.Tensor:
    """A uint8 ``buffer`` as integers of ``dtype``'s width: compared bit for bit."""
    itemsize = (torch_dtype(dtype) if isinstance(dtype, str) else dtype).itemsize
    return buffer.view(torch.uint8).view(_WORDS[itemsize])


def _spans(bucket: BucketSpec) -> list[tuple[int, int]]:
    """``(first element, elements)`` of each tensor of ``bucket``."""
    out, start = [], 0
    for spec in bucket.tensors:
        numel = 1
        for d in spec.shape:
            numel *= d
        out.append((start, numel))
        start += numel
    return out


def changed_positions(new: torch.Tensor, old: torch.Tensor) -> tuple[torch.Tensor, int | None]:
    """The positions (int64, ascending) where the 1-D integer tensors differ, and by how
    much the wrapped sum of their int64 words changed (a checksum's change,
    :func:`~.params.device_checksums`) when the tensors are whole aligned words (else
    None). Narrow elements are compared 8 bytes at a time (4 bf16 values per word: a
    quarter of the comparisons), then the lanes of the changed words."""
    per = 8 // new.element_size()
    whole = new.numel() - new.numel() % per
    aligned = new.storage_offset() % per == 0 and old.storage_offset() % per == 0
    if per == 1 or not whole or not aligned:
        return _differing(new, old), None
    new_words, old_words = new[:whole].view(torch.int64), old[:whole].view(torch.int64)
    words = _differing(new_words, old_words)
    now, was = new_words.index_select(0, words), old_words.index_select(0, words)
    # the changed lanes of each changed word (little-endian: element k in bits 16k.. of bf16)
    bits, flipped = 64 // per, now ^ was
    lanes = [((flipped >> (bits * k)) & ((1 << bits) - 1)) != 0 for k in range(per)]
    word, lane = torch.stack(lanes, dim=1).nonzero(as_tuple=True)
    found = words[word] * per + lane
    if whole < new.numel():
        found = torch.cat([found, _differing(new[whole:], old[whole:]) + whole])
        return found, None
    return found, int((now - was).sum())


def _differing(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """The positions where ``new`` and ``old`` differ, element by element: in chunks on the CPU (cache), at once
    on a GPU (each chunk's ``nonzero`` would be a host sync)."""
    found = []
    chunk = CHUNK if new.device.type == "cpu" else max(new.numel(), 1)
    for start in range(0, new.numel(), chunk):
        stop = min(start + chunk, new.numel())
        where = _true_positions(torch.ne(new[start:stop], old[start:stop]))
        if where.numel():
            found.append(where + start)
    if not found:
        return new.new_empty(0, dtype=torch.int64)
    return torch.cat(found)


def _true_positions(mask: torch.Tensor) -> torch.Tensor:
    """``mask.nonzero()`` of a 1-D bool tensor, mostly False: its bytes are scanned 8 at a
    time (one int64 each), then the lanes of the words holding a True (``nonzero`` over
    every byte costs as much as the comparison that made them)."""
    whole = mask.numel() - mask.numel() % 8
    if not whole:
        return mask.nonzero().squeeze(1)
    groups = mask[:whole].view(torch.int64)
    hit = groups.nonzero().squeeze(1)
    if hit.numel() * 4 > groups.numel():  # dense enough: the lanes cost more than a scan
        return mask.nonzero().squeeze(1)
    value = groups.index_select(0, hit)
    lanes = torch.stack([((value >> (8 * k)) & 0xFF) != 0 for k in range(8)], dim=1)
    row, lane = lanes.nonzero(as_tuple=True)
    found = hit[row] * 8 + lane
    if whole < mask.numel():
        found = torch.cat([found, mask[whole:].nonzero().squeeze(1) + whole])
    return found


def diff_and_sum(
    new: torch.Tensor, old: torch.Tensor, bucket: BucketSpec, dense_share: float = DENSE_SHARE
) -> tuple[BucketDelta, torch.Tensor, int | None]:
    """What of bucket ``new`` (uint8, this version) differs from ``old`` (the base's bytes
    of the same layout): its :class:`BucketDelta`, its payload (uint8: the dense tensors'
    values, then the changed values, then their positions, each part 8-byte aligned), and
    how much the bucket's checksum changed from ``old``'s to ``new``'s (the changed words'
    new values less their old ones, summed where the comparison read them; None: a bucket
    of partial words, summed whole by the caller).

    Examples:
        >>> from torchrl_vllm_ext.weight_sync.specs import TensorSpec
        >>> spec = BucketSpec("float32", (TensorSpec("a", "float32", (20,)),
        ...                               TensorSpec("b", "float32", (2,))), 88, 0)
        >>> old = torch.zeros(22).view(torch.uint8)
        >>> new = torch.zeros(22)
        >>> new[2], new[20:] = 5.0, 1.0  # 1 of a's 20 values, all of b
        >>> new = new.view(torch.uint8)
        >>> delta, payload, _ = diff_and_sum(new, old, spec)
        >>> delta.dense, delta.positions
        (((20, 2),), 1)
        >>> held = old.clone()
        >>> [t.tolist() for t in apply_bucket(held, spec, delta, payload)]  # a's changed value
        [[2], [5.0]]
        >>> torch.equal(held, new)
        True
    """
    a, b = words(new, bucket.dtype), words(old, bucket.dtype)
    positions, sum_change = changed_positions(a, b)
    if bucket.nbytes % 8:
        sum_change = None
    spans = _spans(bucket)
    dense: list[tuple[int, int]] = []
    if positions.numel():
        ends = torch.tensor([s + n for s, n in spans], dtype=torch.int64, device=a.device)
        owner = torch.searchsorted(ends, positions, right=True)
        counts = torch.bincount(owner, minlength=len(spans)).tolist()  # one sync
        whole = [i for i, c in enumerate(counts) if c > dense_share * spans[i][1]]
        if whole:
            dense = [spans[i] for i in whole]
            mask = torch.zeros(len(spans), dtype=torch.bool, device=a.device)
            mask[whole] = True
            positions = positions[~mask[owner]]
    index_dtype = torch.int32 if a.numel() < 2**31 else torch.int64
    parts = [a[s : s + n] for s, n in dense]
    parts.append(a.index_select(0, positions))
    values = torch.cat(parts).view(torch.uint8)
    payload = torch.cat([_aligned(values), _aligned(positions.to(index_dtype).view(torch.uint8))])
    delta = BucketDelta(tuple(dense), int(positions.numel()), str(index_dtype).split(".")[-1])
    return delta, payload, sum_change


def payload_bytes(bucket: BucketSpec, delta: BucketDelta) -> int:
    """Bytes of ``delta``'s payload (0: the bucket is unchanged and sends nothing)."""
    itemsize = torch_dtype(bucket.dtype).itemsize
    values = (sum(n for _, n in delta.dense) + delta.positions) * itemsize
    index = delta.positions * (8 if delta.index_dtype == "int64" else 4)
    return _round8(values) + _round8(index)


def apply_bucket(
    held: torch.Tensor, bucket: BucketSpec, delta: BucketDelta, payload: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write ``delta``'s ``payload`` into ``held`` (uint8, the base version's bucket):
    one batched copy of the whole tensors, one ``index_put_`` of the changed positions;
    returns those positions and their values (views of ``payload``, the values in the
    bucket's dtype)."""
    w = words(held, bucket.dtype)
    values, positions = split_payload(bucket, delta, payload)
    n_dense = sum(n for _, n in delta.dense)
    if delta.dense:
        dsts, srcs, at = [], [], 0
        for start, numel in delta.dense:
            dsts.append(w[start : start + numel])
            srcs.append(values[at : at + numel])
            at += numel
        torch._foreach_copy_(dsts, srcs)
    if delta.positions:
        w.index_put_((positions,), values[n_dense:])
    return positions, values[n_dense:].view(torch_dtype(bucket.dtype))


def split_payload(
    bucket: BucketSpec, delta: BucketDelta, payload: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``delta``'s ``payload`` as its values (the dense tensors', then the changed ones, as
    integers of the dtype's width) and its positions (views of ``payload``)."""
    itemsize = torch_dtype(bucket.dtype).itemsize
    n_values = sum(n for _, n in delta.dense) + delta.positions
    values = words(payload[: n_values * itemsize], bucket.dtype)
    offset = _round8(n_values * itemsize)
    index_dtype = torch.int64 if delta.index_dtype == "int64" else torch.int32
    index_bytes = delta.positions * index_dtype.itemsize
    return values, payload[offset : offset + index_bytes].view(index_dtype)


def bucket_change(
    bucket: BucketSpec, delta: BucketDelta, positions: torch.Tensor, values: torch.Tensor
) -> BucketChange:
    """What ``delta`` changed of ``bucket``: what the pause scatters into the served
    parameters (``positions``, ``values``: :func:`apply_bucket`'s)."""
    spans = _spans(bucket)
    dense = set(delta.dense)
    return BucketChange(
        names=tuple(spec.name for spec in bucket.tensors),
        numels=tuple(n for _, n in spans),
        positions=positions,
        values=values,
        whole=frozenset(
            s.name for s, span in zip(bucket.tensors, spans, strict=True) if span in dense
        ),
    )


@dataclass(frozen=True)
class Touched:
    """The int64 words of a bucket a delta may change: runs of them (its dense tensors'),
    and single words (its changed positions', none inside a run), each once."""

    runs: tuple[tuple[int, int], ...]
    words: torch.Tensor


def touched_words(bucket: BucketSpec, delta: BucketDelta, positions: torch.Tensor):
    """The :class:`Touched` words of ``bucket`` that ``delta`` may change, or None when its
    bytes are not whole words (its checksum is then computed whole). Linear in what
    changed: the positions are ascending, so are their words."""
    if bucket.nbytes % 8:
        return None
    itemsize = torch_dtype(bucket.dtype).itemsize
    runs: list[list[int]] = []
    for start, numel in delta.dense:  # ascending, disjoint; neighbours may share a word
        first, stop = start * itemsize // 8, -(-(start + numel) * itemsize // 8)
        if runs and first <= runs[-1][1]:
            runs[-1][1] = max(runs[-1][1], stop)
        else:
            runs.append([first, stop])
    words = torch.unique_consecutive(
        positions.to(torch.int64).mul_(itemsize).div_(8, rounding_mode="floor")
    )
    if runs and words.numel():  # a position's word shared with a dense tensor: counted once
        edges = torch.tensor([x for run in runs for x in run], device=words.device)
        words = words[torch.searchsorted(edges, words, right=True) % 2 == 0]
    return Touched(tuple((a, b) for a, b in runs), words)


def words_sum(buffer: torch.Tensor, touched: Touched) -> int:
    """The wrapped int64 sum of ``buffer``'s (uint8, whole words) ``touched`` words: the
    part of its checksum (:func:`~.params.device_checksums`) they make up."""
    w = buffer.view(torch.int64)
    total = w.index_select(0, touched.words.to(buffer.device)).sum()
    for first, stop in touched.runs:
        total = total + w[first:stop].sum()
    return int(total)


def checksum_after(before: int, old_words: int, new_words: int) -> int:
    """A bucket's checksum once the words that summed to ``old_words`` now sum to
    ``new_words`` (the checksum is their sum mod 2**64: one pass over what changed, not over
    the bucket).

    Examples:
        >>> from torchrl_vllm_ext.weight_sync.params import device_checksums
        >>> old = torch.arange(16, dtype=torch.int64); new = old.clone(); new[3] = -5
        >>> words = Touched((), torch.tensor([3]))
        >>> total = checksum_after(device_checksums([old])[0], words_sum(old.view(torch.uint8),
        ...     words), words_sum(new.view(torch.uint8), words))
        >>> total == device_checksums([new])[0]
        True
    """
    return (before + new_words - old_words) % (1 << 64)


def _round8(n: int) -> int:
    return n + (-n % 8)


def _aligned(raw: torch.Tensor) -> torch.Tensor:
    """``raw`` (uint8) padded with zeros to a multiple of 8 bytes."""
    pad = -raw.numel() % 8
    return torch.cat([raw, raw.new_zeros(pad)]) if pad else raw

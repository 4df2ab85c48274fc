"""The output directory of ``torchrl-vllm generate``: filled chunk by chunk, resumable.

Names are fixed here (nothing a user gives becomes a path), and each is refused if it is
a symbolic link or resolves outside the directory::

    DIR/                      created 0700
      run.json                the run's fingerprint, written last when the run starts
      data/                   the tensor fields: a memory-mapped TensorDict allocated once
      chunks/rows-LO-HI.json  the string fields of rows [LO, HI) (texts, finish reasons...)

A chunk is stored in two steps: 1) its tensors into ``data/`` in place, then fsync;
2) its chunk file (tmp file, fsync, rename), which commits it. A row is done exactly when
a chunk file covers it, so a kill at any moment leaves at worst rows written but not
done, which the resumed run generates again. Strings stay out of ``data/`` (a memmapped
TensorDict cannot update them in place), so ``data/`` is never rewritten;
:func:`load_output` joins the two.

>>> chunks_left(10, [(0, 4)], 4)
[(4, 8), (8, 10)]
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from torchrl_vllm_ext._files import fsync_path, write_json_atomic
from torchrl_vllm_ext.errors import ConfigurationError

logger = logging.getLogger(__name__)

FORMAT = 2
"""Version of this directory layout, part of every fingerprint."""
RUN, DATA, CHUNKS = "run.json", "data", "chunks"
_CHUNK = re.compile(r"rows-(\d{12})-(\d{12})\.json")


@dataclass(frozen=True)
class Layout:
    """Shape of the output: every row is stored padded to fixed widths."""

    rows: int
    """Input rows ``N``."""
    samples: int
    """Samples per row ``G``; the batch is ``(N,)`` for 1, ``(N, G)`` otherwise."""
    prompt_width: int
    """Width of ``tokens.prompt``: the longest prompt (left-padded)."""
    max_tokens: int
    """Width of ``tokens.response`` (right-padded)."""

    @property
    def batch(self) -> torch.Size:
        return torch.Size([self.rows] if self.samples == 1 else [self.rows, self.samples])


def schema(layout: Layout):
    """A TensorDict of the output's tensor fields (expanded scalars: no memory)."""
    from tensordict import MetaData, TensorDict
    from torchrl.modules.llm.policies import LogProbs, Masks, Tokens

    b, wp, t = layout.batch, layout.prompt_width, layout.max_tokens

    def empty(dtype, *width):
        return torch.zeros((), dtype=dtype).expand(*b, *width)

    cls = {"padded": MetaData(True, batch_size=b), "batch_size": b}
    long, f32, bool_ = torch.long, torch.float32, torch.bool
    fields = {
        "tokens": Tokens(
            prompt=empty(long, wp), response=empty(long, t), full=empty(long, wp + t), **cls
        ),
        "log_probs": LogProbs(response=empty(f32, t), full=empty(f32, wp + t), **cls),
        "masks": Masks(
            all_attention_mask=empty(bool_, wp + t), all_assistant_mask=empty(bool_, wp + t), **cls
        ),
        "row": empty(long),
    }
    return TensorDict(fields, batch_size=b)


def chunks_left(rows: int, done, chunk_size: int) -> list[tuple[int, int]]:
    """The ``[lo, hi)`` chunks (at most ``chunk_size`` rows) of the rows not in ``done``."""
    todo = np.zeros(rows + 2, dtype=np.int8)  # row i at i + 1, a 0 at either end
    todo[1:-1] = 1
    for lo, hi in done:
        todo[lo + 1 : hi + 1] = 0
    runs = np.flatnonzero(np.diff(todo)).reshape(-1, 2).tolist()  # [lo, hi) of rows to do
    return [(a, min(a + chunk_size, hi)) for lo, hi in runs for a in range(lo, hi, chunk_size)]


def inside(root: Path, *parts: str) -> Path:
    """``root / parts``, refused if it is a symbolic link or resolves outside ``root``."""
    path = root.joinpath(*parts)
    if path.is_symlink() or not path.resolve().is_relative_to(root):
        what = (
            "is a symbolic link" if path.is_symlink() else "resolves outside the output directory"
        )
        raise ConfigurationError(
            f"{str(path)!r} {what} ({str(root)!r} holds only what generate writes); remove the "
            "link or pick a new --output directory."
        )
    return path


class OutputDir:
    """A resumable output directory (see the module docstring).

    >>> out = OutputDir.open("out", Layout(2, 1, 3, 4), {"input": "..."})  # doctest: +SKIP
    >>> out.remaining(chunk_size=64)  # doctest: +SKIP
    [(0, 2)]
    """

    def __init__(self, root: Path, layout: Layout):
        from tensordict import TensorDict

        self.root, self.layout = root, layout
        self.done = list(_chunk_files(root))
        self.data = TensorDict.load_memmap(inside(root, DATA))  # tensors, written in place

    @classmethod
    def open(cls, path, layout: Layout, fingerprint: dict, *, overwrite=False) -> OutputDir:
        """Resume the run in ``path`` if it has this fingerprint, else start one there.

        ``overwrite`` discards the run ``path`` holds. A different run (without
        ``overwrite``) or files generate did not write raise ``ConfigurationError``.
        """
        root = _make_root(path)
        fingerprint = {"format": FORMAT, **fingerprint, **asdict(layout)}
        try:
            old = _read_run(root)
        except ConfigurationError:
            if not overwrite:
                raise
            old = {}
        foreign = sorted(e.name for e in root.iterdir() if not _own(e.name))
        if old is None and foreign:
            raise ConfigurationError(
                f"--output {str(root)!r} is not empty ({foreign[:5]}) and holds no generate run "
                "to resume; pick an empty or new directory."
            )
        if old is not None and old != fingerprint and not overwrite:
            keys = sorted(
                k for k in set(old) | set(fingerprint) if old.get(k) != fingerprint.get(k)
            )
            diff = "; ".join(f"{k}: {old.get(k)!r} there, {fingerprint.get(k)!r} now" for k in keys)
            raise ConfigurationError(
                f"--output {str(root)!r} holds a run with other inputs or settings ({diff}); pick "
                "a new --output directory to keep it, or pass --overwrite to discard it."
            )
        if old is None or overwrite:
            _start(root, layout, fingerprint)
        for tmp in inside(root, CHUNKS).glob(".rows-*.tmp"):  # of a killed chunk write
            tmp.unlink()
        out = cls(root, layout)
        if out.rows_done:
            logger.info("resuming %s: %d of %d rows done", root, out.rows_done, layout.rows)
        return out

    @property
    def rows_done(self) -> int:
        return sum(hi - lo for lo, hi in self.done)

    @property
    def complete(self) -> bool:
        return self.rows_done == self.layout.rows

    def remaining(self, chunk_size: int) -> list[tuple[int, int]]:
        return chunks_left(self.layout.rows, self.done, chunk_size)

    def write_chunk(self, lo: int, hi: int, tensors: dict, strings: dict[str, list]) -> None:
        """Store rows ``[lo, hi)``: 1) tensors in place + fsync, 2) the chunk file (commit)."""
        targets = [self.data.get(key) for key in tensors]
        for target, (key, value) in zip(targets, tensors.items(), strict=True):
            if value.shape != target[lo:hi].shape:
                raise ValueError(f"chunk [{lo}, {hi}) {key!r}: shape {tuple(value.shape)}")
            target[lo:hi] = value
        for target in targets:
            fsync_path(target.filename)  # also the pages written through the memmap
        write_json_atomic(inside(self.root, CHUNKS, f"rows-{lo:012d}-{hi:012d}.json"), strings)
        self.done.append((lo, hi))


def load_output(path: str | Path):
    """The finished output of ``torchrl-vllm generate --output path`` as one TensorDict.

    The memmapped tensors of ``path/data`` (tokens, log-probs, masks, row) with the string
    fields of the chunk files: ``text`` (prompt, response, full), ``("vllm",
    "weight_version")``, ``("vllm", "finish_reason")`` and ``id`` (when the input has ids).
    """
    from tensordict import NonTensorData, NonTensorStack, TensorDict
    from torchrl.modules.llm.policies import Text  # also registers Tokens, LogProbs, Masks

    root = Path(path).expanduser().resolve()
    run = _read_run(root)
    files = _chunk_files(root) if run else {}
    done = sum(hi - lo for lo, hi in files)
    if not run or done != run["rows"] or chunks_left(done, files, max(done, 1)):
        raise ConfigurationError(
            f"{str(path)!r} holds no finished generate output ({done} rows done); run (or "
            "resume) torchrl-vllm generate with --output there first."
        )
    td = TensorDict.load_memmap(inside(root, DATA))
    g, cols = run["samples"], {}
    for _, file in sorted(files.items()):
        for name, values in json.loads(file.read_text()).items():
            cols.setdefault(name, []).extend(values)
    for name in ("prompt", "id"):  # per row -> per sample
        cols[name] = [v for v in cols.get(name, []) for _ in range(g)]
    cols["full"] = [p + r for p, r in zip(cols["prompt"], cols["response"], strict=True)]

    def strings(values: list):
        if all(v == values[0] for v in values):
            return NonTensorData(values[0], batch_size=td.batch_size)  # one value, not N
        rows = values if g == 1 else [values[i : i + g] for i in range(0, len(values), g)]
        return NonTensorStack.from_list(rows)

    text = {k: strings(cols[k]) for k in ("prompt", "response", "full")}
    td.set("text", Text(**text, batch_size=td.batch_size))
    td.set(("vllm", "weight_version"), strings(cols["weight_version"]))
    td.set(("vllm", "finish_reason"), strings(cols["finish_reason"]))
    if cols["id"]:
        td.set("id", strings(cols["id"]))
    return td


def _own(name: str) -> bool:
    """Whether generate writes ``name`` at the top of the output directory."""
    return name in (RUN, DATA, CHUNKS) or (name.startswith(f".{RUN}.") and name.endswith(".tmp"))


def _chunk_files(root: Path) -> dict[tuple[int, int], Path]:
    """The committed chunks, ``(lo, hi) -> file``."""
    chunks = inside(root, CHUNKS)
    names = [p.name for p in chunks.iterdir()] if chunks.is_dir() else []
    matches = [m for m in map(_CHUNK.fullmatch, names) if m]
    return {(int(m[1]), int(m[2])): inside(chunks, m[0]) for m in matches}


def _make_root(path: str | Path) -> Path:
    root = Path(path).expanduser().absolute()
    if root.exists() and not root.is_dir():
        raise ConfigurationError(
            f"--output {str(path)!r} exists and is not a directory; pass a directory (it is "
            "created if missing)."
        )
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not os.access(root, os.W_OK | os.X_OK):
            raise PermissionError(13, "not writable")
    except OSError as e:
        raise ConfigurationError(
            f"--output {str(path)!r} cannot be written ({e.strerror}); pick a writable location."
        ) from None
    return root.resolve()


def _read_run(root: Path) -> dict[str, Any] | None:
    path = inside(root, RUN)
    if not path.exists():
        return None
    try:
        run = json.loads(path.read_text())
        if not isinstance(run, dict) or not {"format", "rows", "samples"} <= set(run):
            raise ValueError("not a generate run file")
    except (OSError, ValueError) as e:  # JSONDecodeError is a ValueError
        raise ConfigurationError(
            f"{str(path)!r} cannot be read as a generate run ({e!r}); pass --overwrite to start "
            "the run again."
        ) from None
    return run


def _start(root: Path, layout: Layout, fingerprint: dict) -> None:
    """Clear what a previous run left, preallocate ``data/``, then write ``run.json``."""
    for name in sorted((e.name for e in root.iterdir() if _own(e.name)), key=lambda n: n != RUN):
        path = inside(root, name)  # run.json first: without it, the rest is ours to clear
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    schema(layout).memmap_like(inside(root, DATA))
    os.chmod(root / DATA, 0o700)
    inside(root, CHUNKS).mkdir(mode=0o700)
    write_json_atomic(inside(root, RUN), fingerprint)  # last: the run exists from here on

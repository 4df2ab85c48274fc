"""The output directory of ``torchrl-vllm generate``: a preallocated memory-mapped TensorDict
filled chunk by chunk in place, and the bookkeeping that makes the job resumable.

Layout; every name is fixed here and nothing a user gives (ids, prompts) becomes a path.
Each path is checked to be no symbolic link and to resolve inside the directory::

    DIR/                      created 0700
      data/                   the output: load_output(DIR), or TensorDict.load_memmap(DIR /
                              "data") after ``import torchrl.modules.llm.policies``
      progress.json           rows done, the run's fingerprint, "complete"
      schema.json             data/'s meta.json files as allocated (restored before a retry)
      strings/rows-LO-HI.json string fields of finished chunks, until the run completes

Per chunk, in this order, so a kill at any moment never leaves a row marked done that
was not written: 1) tensors into ``data/`` in place, then fsync; 2) the chunk's strings
(tmp file, fsync, rename); 3) ``progress.json`` with the chunk's rows (tmp, fsync, rename).
A row not marked done is generated again on resume and overwritten.

Strings (text, versions, finish reasons, ids) cannot be updated in place in a memmapped
TensorDict (tensordict keeps them as JSON), so they land in ``data/`` once, when every
row is done; ``data/`` is complete when ``progress.json`` says ``"complete": true``.

>>> from torchrl_vllm_ext.jobs.generate_store import chunks_left
>>> chunks_left(10, [[0, 4]], 4)
[(4, 8), (8, 10)]
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from torchrl_vllm_ext._files import fsync_path
from torchrl_vllm_ext.errors import ConfigurationError

logger = logging.getLogger(__name__)

FORMAT = 1
"""Version of this directory layout, part of every fingerprint."""
DATA, DATA_TMP = "data", "data.tmp"
PROGRESS, SCHEMA, STRINGS = "progress.json", "schema.json", "strings"
OWN_NAMES = frozenset(
    {DATA, DATA_TMP, PROGRESS, SCHEMA, STRINGS, f".{PROGRESS}.tmp", f".{SCHEMA}.tmp"}
)
STRING_FIELDS = (
    ("text", "prompt"),
    ("text", "response"),
    ("text", "full"),
    ("vllm", "weight_version"),
    ("vllm", "finish_reason"),
    ("id",),
)
"""Non-tensor output fields, written once at the end (``id`` only when the input has ids)."""
_SIDECAR = re.compile(r"rows-(\d{12})-(\d{12})\.json")


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
    """Width of ``tokens.response``: ``max_tokens`` (right-padded)."""

    @property
    def batch(self) -> torch.Size:
        return torch.Size([self.rows] if self.samples == 1 else [self.rows, self.samples])


def schema(layout: Layout):
    """A TensorDict of the output's tensor fields (expanded scalars: no memory)."""
    from tensordict import MetaData, TensorDict
    from torchrl.modules.llm.policies import LogProbs, Masks, Tokens

    b, wp, t = layout.batch, layout.prompt_width, layout.max_tokens

    def empty(dtype, *shape):
        return torch.zeros((), dtype=dtype).expand(*b, *shape)

    padded = MetaData(True, batch_size=b)
    long, f32 = torch.long, torch.float32
    return TensorDict(
        {
            "tokens": Tokens(
                prompt=empty(long, wp),
                response=empty(long, t),
                full=empty(long, wp + t),
                padded=padded,
                batch_size=b,
            ),
            "log_probs": LogProbs(
                response=empty(f32, t), full=empty(f32, wp + t), padded=padded, batch_size=b
            ),
            "masks": Masks(
                all_attention_mask=empty(torch.bool, wp + t),
                all_assistant_mask=empty(torch.bool, wp + t),
                padded=padded,
                batch_size=b,
            ),
            "row": empty(long),
        },
        batch_size=b,
    )


# ---------------------------------------------------------------------------- pure helpers
def merge_ranges(ranges: list[list[int]]) -> list[list[int]]:
    """Sorted, merged ``[lo, hi)`` ranges."""
    out: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return out


def chunks_left(rows: int, done: list[list[int]], chunk_size: int) -> list[tuple[int, int]]:
    """The ``[lo, hi)`` chunks (at most ``chunk_size`` rows) of the rows not in ``done``."""
    chunks, start = [], 0
    for lo, hi in [*merge_ranges(done), [rows, rows]]:
        for a in range(start, lo, chunk_size):
            chunks.append((a, min(a + chunk_size, lo)))
        start = max(start, hi)
    return chunks


def covered(lo: int, hi: int, done: list[list[int]]) -> bool:
    return any(a <= lo and hi <= b for a, b in done)


def fingerprint_diff(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """Human-readable differences between two fingerprints."""
    return [
        f"{k}: {old.get(k)!r} there, {new.get(k)!r} now"
        for k in sorted(set(old) | set(new))
        if old.get(k) != new.get(k)
    ]


def inside(root: Path, *parts: str) -> Path:
    """``root / parts``, refused if it is a symbolic link or resolves outside ``root``."""
    path = root.joinpath(*parts)
    if path.is_symlink():
        raise ConfigurationError(
            f"{str(path)!r} is a symbolic link; the output directory holds only the files "
            "generate writes. Remove the link or pick a new --output directory."
        )
    if not path.resolve().is_relative_to(root):
        raise ConfigurationError(
            f"{str(path)!r} resolves to {str(path.resolve())!r}, outside the output directory "
            f"{str(root)!r}; pick a new --output directory."
        )
    return path


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write ``obj`` so that readers see the old file or the new one, never a torn one."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


# ---------------------------------------------------------------------------- the directory
class OutputDir:
    """A resumable output directory (see the module docstring for its layout).

    Args:
        root: the directory, resolved.
        layout: the output's shape.
        state: the content of ``progress.json``.

    Examples:
        >>> from torchrl_vllm_ext.jobs.generate_store import Layout, OutputDir
        >>> layout = Layout(rows=2, samples=1, prompt_width=3, max_tokens=4)
        >>> out = OutputDir.open("gen-out", layout, {"input": "..."})  # doctest: +SKIP
        >>> out.remaining(chunk_size=64)  # doctest: +SKIP
        [(0, 2)]
    """

    def __init__(self, root: Path, layout: Layout, state: dict):
        self.root = root
        self.layout = layout
        self.state = state
        self._data = None

    # ------------------------------------------------------------------ opening
    @classmethod
    def open(
        cls,
        path: str | Path,
        layout: Layout,
        fingerprint: Mapping[str, Any],
        *,
        overwrite: bool = False,
    ) -> OutputDir:
        """Resume the run in ``path`` if it has the same fingerprint, else start one.

        ``overwrite`` discards whatever run ``path`` holds and starts again. Raises
        :class:`~torchrl_vllm_ext.errors.ConfigurationError` if ``path`` holds a different
        run (without ``overwrite``) or files that generate did not write.
        """
        root = _make_root(path)
        fingerprint = {"format": FORMAT, **fingerprint, **asdict(layout)}
        state = _read_progress(inside(root, PROGRESS))
        if state is None:
            foreign = sorted(e.name for e in root.iterdir() if e.name not in OWN_NAMES)
            if foreign:
                raise ConfigurationError(
                    f"--output {str(root)!r} is not empty ({foreign[:5]}) and holds no generate "
                    "run to resume; pick an empty or new directory."
                )
        elif state.get("fingerprint") != fingerprint and not overwrite:
            diff = fingerprint_diff(state.get("fingerprint") or {}, fingerprint)
            raise ConfigurationError(
                f"--output {str(root)!r} holds a run with other inputs or settings ("
                f"{'; '.join(diff)}); pick a new --output directory to keep it, or pass "
                "--overwrite to discard it."
            )
        if state is None or overwrite:
            state = _start(root, layout, fingerprint)
        elif _count(state):
            logger.info("resuming %s: %d of %d rows done", root, _count(state), layout.rows)
        out = cls(root, layout, state)
        out._tidy()
        return out

    def _tidy(self) -> None:
        """Put the directory back into the state its progress file describes."""
        strings = inside(self.root, STRINGS)
        if self.complete:
            if strings.exists():  # killed between the last progress write and the cleanup
                shutil.rmtree(strings)
            return
        strings.mkdir(mode=0o700, exist_ok=True)
        for path in strings.iterdir():
            m = _SIDECAR.fullmatch(path.name)
            # A chunk's strings are written before its rows are marked done: a kill in
            # between leaves a file for rows that will be generated again.
            if m is None or not covered(int(m[1]), int(m[2]), self.done):
                path.unlink()
        self._restore_meta()

    def _restore_meta(self) -> None:
        # A kill while finish() rewrites data/'s meta.json files could leave them torn;
        # the allocation-time copies describe the tensors, which are never moved.
        data = inside(self.root, DATA)
        for name in ("text", "vllm", "id"):
            if (data / name).is_dir():
                shutil.rmtree(data / name)
        snapshot = json.loads(inside(self.root, SCHEMA).read_text())
        for rel, text in snapshot.items():
            target = inside(data, *Path(rel).parts)
            if not target.is_file() or target.read_text() != text:
                target.write_text(text)

    # ------------------------------------------------------------------ state
    @property
    def data_path(self) -> Path:
        return self.root / DATA

    @property
    def done(self) -> list[list[int]]:
        return self.state["done"]

    @property
    def rows_done(self) -> int:
        return _count(self.state)

    @property
    def complete(self) -> bool:
        return bool(self.state["complete"])

    def remaining(self, chunk_size: int) -> list[tuple[int, int]]:
        return chunks_left(self.layout.rows, self.done, chunk_size)

    @property
    def data(self):
        """The memmapped output TensorDict (tensors writable in place)."""
        if self._data is None:
            from tensordict import TensorDict

            self._data = TensorDict.load_memmap(inside(self.root, DATA))
        return self._data

    # ------------------------------------------------------------------ writing
    def write_chunk(
        self,
        lo: int,
        hi: int,
        tensors: Mapping[Any, torch.Tensor],
        strings: Mapping[str, list],
        tokens: int,
    ) -> None:
        """Store rows ``[lo, hi)`` and then mark them done (see the module docstring)."""
        data = self.data
        files = []
        # 1) tensors, in place
        for key, value in tensors.items():
            target = data.get(key)
            if value.shape != target[lo:hi].shape:
                raise ValueError(
                    f"chunk [{lo}, {hi}) field {key!r} has shape {tuple(value.shape)}, the output "
                    f"holds {tuple(target[lo:hi].shape)}"
                )
            target[lo:hi] = value
            files.append(target.filename)
        for name in files:
            fsync_path(name)  # also the pages written through the memmap
        # 2) the chunk's strings
        for name, values in strings.items():
            if len(values) != hi - lo:
                raise ValueError(f"chunk [{lo}, {hi}) has {len(values)} {name!r} values")
        sidecar = inside(self.root, STRINGS, f"rows-{lo:012d}-{hi:012d}.json")
        write_json_atomic(sidecar, {"lo": lo, "hi": hi, "fields": dict(strings)})
        # 3) mark the rows done
        self.state["done"] = merge_ranges([*self.done, [lo, hi]])
        self.state["tokens"] += int(tokens)
        write_json_atomic(inside(self.root, PROGRESS), self.state)

    def finish(self) -> None:
        """Write the string fields into ``data/`` once every row is done; mark complete."""
        from tensordict import TensorDict

        if self.complete:
            return
        left = self.remaining(self.layout.rows or 1)
        if left:
            raise RuntimeError(f"rows {left} are not generated yet; finish() comes last")
        fields = self._gather_strings()
        self._data = None
        self._restore_meta()
        data = TensorDict.load_memmap(inside(self.root, DATA))
        b = self.layout.batch
        text = {k[1]: _strings(v, b) for k, v in fields.items() if k[0] == "text"}
        if text:
            from torchrl.modules.llm.policies import Text

            data.set("text", Text(**text, batch_size=b))
        for key, values in fields.items():
            if key[0] != "text":
                data.set(key, _strings(values, b))
        data.memmap_(prefix=inside(self.root, DATA), existsok=True)
        self.state["complete"] = True
        write_json_atomic(inside(self.root, PROGRESS), self.state)
        shutil.rmtree(inside(self.root, STRINGS))

    def _gather_strings(self) -> dict[tuple[str, ...], list]:
        n = self.layout.rows
        fields: dict[tuple[str, ...], list] = {}
        seen = [False] * n
        for path in sorted(inside(self.root, STRINGS).iterdir()):
            chunk = json.loads(path.read_text())
            lo, hi = chunk["lo"], chunk["hi"]
            for name, values in chunk["fields"].items():
                column = fields.setdefault(tuple(name.split(".")), [None] * n)
                column[lo:hi] = values
            seen[lo:hi] = [True] * (hi - lo)
        if not all(seen):
            missing = seen.index(False)
            raise ConfigurationError(
                f"{str(self.root)!r}: the text of row {missing} is missing although the row is "
                "marked done (files removed by hand?); rerun with --overwrite."
            )
        return fields


def load_output(path: str | Path):
    """The finished output TensorDict of ``torchrl-vllm generate --output path``.

    Same as ``TensorDict.load_memmap(path / "data")`` after ``import
    torchrl.modules.llm.policies`` (which registers the ``Tokens`` / ``LogProbs`` /
    ``Masks`` / ``Text`` classes the output is made of).
    """
    import torchrl.modules.llm.policies  # noqa: F401  (registers the tensorclasses)
    from tensordict import TensorDict

    root = Path(path).expanduser().resolve()
    state = _read_progress(inside(root, PROGRESS))
    if state is None or not state["complete"]:
        done = 0 if state is None else _count(state)
        raise ConfigurationError(
            f"{str(path)!r} holds no finished generate output ({done} rows done); run (or "
            "resume) torchrl-vllm generate with --output there first."
        )
    return TensorDict.load_memmap(inside(root, DATA))


def _strings(values: list, batch: torch.Size):
    from tensordict import NonTensorData, NonTensorStack

    flat = [v for row in values for v in row] if len(batch) == 2 else values
    if all(v == flat[0] for v in flat):
        return NonTensorData(flat[0], batch_size=batch)  # one JSON value, not N
    return NonTensorStack.from_list(values)


def _make_root(path: str | Path) -> Path:
    root = Path(path).expanduser().absolute()
    if root.exists() and not root.is_dir():
        raise ConfigurationError(
            f"--output {str(path)!r} exists and is not a directory; pass a directory (it is "
            "created if missing)."
        )
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigurationError(
            f"--output {str(path)!r} cannot be created ({e.strerror}); pick a writable location."
        ) from None
    if not os.access(root, os.W_OK | os.X_OK):
        raise ConfigurationError(
            f"--output {str(path)!r} is not writable; pick a directory you can write to."
        )
    return root.resolve()


def _read_progress(path: Path) -> dict | None:
    if not path.exists():
        return None
    try:
        state = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigurationError(
            f"{str(path)!r} cannot be read ({e}); pass --overwrite to start the run again."
        ) from None
    if not isinstance(state, dict) or not {"fingerprint", "done", "complete"} <= set(state):
        raise ConfigurationError(
            f"{str(path)!r} is not a generate progress file; pass --overwrite to start again."
        )
    return state


def _count(state: dict) -> int:
    return sum(hi - lo for lo, hi in state["done"])


def _start(root: Path, layout: Layout, fingerprint: dict) -> dict:
    """Clear what a previous run left and preallocate ``data/``."""
    for name in OWN_NAMES:
        path = inside(root, name)
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    tmp, data = inside(root, DATA_TMP), inside(root, DATA)
    schema(layout).memmap_like(tmp)
    os.chmod(tmp, 0o700)
    snapshot = {str(p.relative_to(tmp)): p.read_text() for p in tmp.rglob("meta.json")}
    os.replace(tmp, data)
    write_json_atomic(inside(root, SCHEMA), snapshot)
    state = {"fingerprint": fingerprint, "done": [], "tokens": 0, "complete": False}
    # Written last: without progress.json, whatever is here is ours and safe to clear.
    write_json_atomic(inside(root, PROGRESS), state)
    return state

"""The output directory of ``torchrl-vllm generate``: filled chunk by chunk, resumable.

Names are fixed here (nothing a user gives becomes a path); each is refused if it is a
symbolic link or resolves outside the directory::

    DIR/                      created 0700
      run.json                the run's fingerprint, written last when the run starts
      data/                   the tensor fields: a memory-mapped TensorDict allocated once
      chunks/rows-LO-HI.json  the string fields of rows [LO, HI) (texts, finish reasons...)

A chunk is stored in two steps: 1) its tensors into ``data/`` in place, then fsync;
2) its chunk file (tmp file, fsync, rename), which commits it. A row is done exactly when
a chunk file covers it, so a kill at any moment leaves at worst rows written but not
done, which the resumed run generates again. Strings stay out of ``data/`` (a memmapped
TensorDict cannot update them in place), so ``data/`` is never rewritten.

>>> chunks_left(10, [(0, 4)], 4)
[(4, 8), (8, 10)]
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from torchrl_vllm_ext._files import fsync_path, write_json_atomic
from torchrl_vllm_ext.errors import ConfigurationError
from torchrl_vllm_ext.wrappers.inputs import flatten_rows

RUN, DATA, CHUNKS = "run.json", "data", "chunks"
_CHUNK = re.compile(r"rows-(\d{12})-(\d{12})\.json")
FIELDS = {  # the tensor fields stored, by tensorclass: (dtype, padding value, names)
    "tokens": (torch.long, None, ("prompt", "response", "full")),  # padded with the pad id
    "log_probs": (torch.float32, 0.0, ("response", "full")),
    "masks": (torch.bool, False, ("all_attention_mask", "all_assistant_mask")),
}


@dataclass(frozen=True)
class Layout:
    """Shape of the output: ``rows`` N, ``samples`` G (batch ``(N,)`` or ``(N, G)``), and
    the widths of ``tokens.prompt`` (the longest prompt) and ``tokens.response``."""

    rows: int
    samples: int
    prompt_width: int
    max_tokens: int


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
        what = "is a symbolic link" if path.is_symlink() else "is outside the output directory"
        raise ConfigurationError(
            f"{str(path)!r} {what} {str(root)!r}, which holds only what generate writes; remove "
            "the link or pick a new --output directory."
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

        ``overwrite`` discards the run ``path`` holds; a different run (without it) or
        files generate did not write raise ``ConfigurationError``.
        """
        root = _make_root(path)
        fingerprint = {**fingerprint, **asdict(layout)}
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
            keys = sorted(k for k in {*old, *fingerprint} if old.get(k) != fingerprint.get(k))
            diff = "; ".join(f"{k}: {old.get(k)!r} there, {fingerprint.get(k)!r} now" for k in keys)
            raise ConfigurationError(
                f"--output {str(root)!r} holds a run with other inputs or settings ({diff}); pick "
                "a new --output directory to keep it, or pass --overwrite to discard it."
            )
        if old is None or overwrite:
            _start(root, layout, fingerprint)
        return cls(root, layout)

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
        for target, value in zip(targets, tensors.values(), strict=True):
            target[lo:hi] = value
        for target in targets:
            fsync_path(target.filename)  # also the pages written through the memmap
        write_json_atomic(inside(self.root, CHUNKS, f"rows-{lo:012d}-{hi:012d}.json"), strings)
        self.done.append((lo, hi))


def chunk_output(result, prompts, lo: int, hi: int, layout: Layout, tokenizer, pad: int):
    """The policy's output, padded to the chunk's widths -> ``(tensors, strings, tokens)``.

    ``tensors`` are padded further to the output's widths (prompts on the left, responses
    on the right); ``strings`` are the chunk file's fields (``prompt`` and ``id`` per row,
    the others per sample, row-major); ``tokens`` counts the tokens generated.
    """
    response, mask = result.get(("tokens", "response")), result.get(("masks", "all_attention_mask"))
    w, r, batch = result.get(("tokens", "prompt")).shape[-1], response.shape[-1], result.batch_size

    def fit(x, name, fill):  # to the output's widths: prompts left-padded, responses right
        left, right = (layout.prompt_width - w, 0), (0, layout.max_tokens - r)
        if name in ("prompt", "response"):
            return F.pad(x, left if name == "prompt" else right, value=fill)
        prompt, reply = F.pad(x[..., :w], left, value=fill), F.pad(x[..., w:], right, value=fill)
        return torch.cat([prompt, reply], -1)

    tensors = {
        (group, name): fit(result.get((group, name)), name, pad if fill is None else fill)
        for group, (_, fill, names) in FIELDS.items()
        for name in names
    }
    tensors["row"] = torch.arange(lo, hi).reshape(-1, *[1] * (len(batch) - 1)).expand(batch)

    def decode(rows) -> list[str]:
        ids = [x.tolist() for x in rows]
        return tokenizer.batch_decode(
            ids, skip_special_tokens=False, clean_up_tokenization_spaces=False
        )

    n = mask[..., w:].sum(-1).flatten()
    strings = {
        "prompt": prompts.texts[lo:hi] if prompts.texts else decode(prompts.token_ids[lo:hi]),
        "response": decode(x[:k] for x, k in zip(response.reshape(-1, r), n, strict=True)),
        "weight_version": list(flatten_rows(result.get(("vllm", "weight_version")).tolist())),
        "finish_reason": list(flatten_rows(result.get(("vllm", "finish_reason")).tolist())),
    }
    if prompts.ids is not None:
        strings["id"] = prompts.ids[lo:hi]
    return tensors, strings, int(n.sum())


def load_output(path: str | Path):
    """The finished output of ``torchrl-vllm generate --output path`` as one TensorDict.

    The memmapped tensors of ``path/data`` (tokens, log-probs, masks, row) with the string
    fields of the chunk files: ``text`` (prompt, response, full), ``("vllm",
    "weight_version")``, ``("vllm", "finish_reason")`` and ``id`` (when the input has ids).
    """
    from tensordict import NonTensorData, NonTensorStack
    from torchrl.modules.llm.policies import Text  # also registers Tokens, LogProbs, Masks

    root = Path(path).expanduser().resolve()
    run = _read_run(root)
    out = OutputDir(root, Layout(**{f.name: run[f.name] for f in fields(Layout)})) if run else None
    if out is None or out.remaining(1) or not out.complete:
        raise ConfigurationError(
            f"{str(path)!r} holds no finished generate output ({out.rows_done if out else 0} rows "
            "done); run (or resume) torchrl-vllm generate with --output there first."
        )
    td, g, cols = out.data, run["samples"], {}
    for _, file in sorted(_chunk_files(root).items()):
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


def _own(name: str) -> bool:  # at the top of the output directory
    return name in (RUN, DATA, CHUNKS) or (name.startswith(f".{RUN}.") and name.endswith(".tmp"))


def _chunk_files(root: Path) -> dict[tuple[int, int], Path]:  # the committed chunks
    chunks = inside(root, CHUNKS)
    matches = [m for m in map(_CHUNK.fullmatch, os.listdir(chunks)) if m]
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


def _read_run(root: Path) -> dict | None:
    path = inside(root, RUN)
    if not path.exists():
        return None
    try:
        run = json.loads(path.read_text())
        if not isinstance(run, dict) or not {"rows", "samples"} <= set(run):
            raise ValueError("not a generate run file")
    except (OSError, ValueError) as e:  # JSONDecodeError is a ValueError
        raise ConfigurationError(
            f"{str(path)!r} cannot be read as a generate run ({e!r}); pass --overwrite to start "
            "the run again."
        ) from None
    return run


def _start(root: Path, layout: Layout, fingerprint: dict) -> None:
    """Clear what a previous run left, preallocate ``data/``, then write ``run.json``."""
    from tensordict import MetaData, TensorDict
    from torchrl.modules.llm.policies import LogProbs, Masks, Tokens

    for name in sorted((e.name for e in root.iterdir() if _own(e.name)), key=lambda n: n != RUN):
        path = inside(root, name)  # run.json first: without it, the rest is ours to clear
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    b = [layout.rows] if layout.samples == 1 else [layout.rows, layout.samples]
    widths = {"prompt": layout.prompt_width, "response": layout.max_tokens}
    full = layout.prompt_width + layout.max_tokens
    classes = {"tokens": Tokens, "log_probs": LogProbs, "masks": Masks}
    fields = {  # expanded scalars: no memory until memmapped
        group: classes[group](
            **{n: torch.zeros((), dtype=dtype).expand(*b, widths.get(n, full)) for n in names},
            padded=MetaData(True, batch_size=b),
            batch_size=b,
        )
        for group, (dtype, _, names) in FIELDS.items()
    }
    fields["row"] = torch.zeros((), dtype=torch.long).expand(b)
    TensorDict(fields, batch_size=b).memmap_like(inside(root, DATA))
    os.chmod(root / DATA, 0o700)
    inside(root, CHUNKS).mkdir(mode=0o700)
    write_json_atomic(inside(root, RUN), fingerprint)  # last: the run exists from here on

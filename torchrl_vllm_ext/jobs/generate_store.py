"""The output directory of ``torchrl-vllm generate``, filled chunk by chunk, resumable::

    DIR/                      created 0700; no path comes from the input, none is a link
      run.json                the run's fingerprint, written last when the run starts
      data/                   the tensor fields: a memory-mapped TensorDict allocated once
      chunks/rows-LO-HI.json  the string fields of rows [LO, HI) (texts, finish reasons...)

A chunk is stored in two steps: 1) its tensors into ``data/`` in place, then fsync;
2) its chunk file (tmp file, fsync, rename), which commits it. A row is done when a chunk
file covers it, so a kill at any moment leaves at worst rows written but not done, which
the resumed run generates again. Strings stay out of ``data/`` (a memmapped TensorDict
cannot update them in place), so ``data/`` is never rewritten.

>>> chunks_left(10, [(0, 4)], 4)
[(4, 8), (8, 10)]
"""

from __future__ import annotations

import json
import os
import re
import shutil
from functools import partial
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from tensordict import MetaData, NonTensorData, NonTensorStack, TensorDict
from torchrl.modules.llm.policies import LogProbs, Masks, Text, Tokens

from torchrl_vllm_ext._files import fsync_path, write_json_atomic
from torchrl_vllm_ext.errors import ConfigurationError
from torchrl_vllm_ext.jobs.logs import LOG_FILE_NAME
from torchrl_vllm_ext.wrappers.inputs import flatten_rows

RUN, DATA, CHUNKS = "run.json", "data", "chunks"
_CHUNK = re.compile(r"rows-(\d{12})-(\d{12})\.json")
FIELDS = {  # the tensor fields stored: tensorclass, dtype, padding value, names
    "tokens": (Tokens, torch.long, None, ("prompt", "response", "full")),  # pad id
    "log_probs": (LogProbs, torch.float32, 0.0, ("response", "full")),
    "masks": (Masks, torch.bool, False, ("all_attention_mask", "all_assistant_mask")),
}


class Layout(NamedTuple):
    """``rows`` N, ``samples`` G (the batch is ``(N,)`` or ``(N, G)``) and the stored widths."""

    rows: int
    samples: int
    prompt_width: int
    max_tokens: int


def chunks_left(rows: int, done, chunk_size: int) -> list[tuple[int, int]]:
    """The ``[lo, hi)`` chunks (at most ``chunk_size`` rows) of the rows not in ``done``."""
    chunks, start = [], 0
    for lo, hi in sorted([*map(tuple, done), (rows, rows)]):
        chunks += [(a, min(a + chunk_size, lo)) for a in range(start, lo, chunk_size)]
        start = max(start, hi)
    return chunks


def inside(root: Path, *parts: str) -> Path:
    """``root / parts``, refused if it is a symbolic link or resolves outside ``root``."""
    path = root.joinpath(*parts)
    if path.is_symlink() or not path.resolve().is_relative_to(root):
        what = "is a symbolic link in" if path.is_symlink() else "is outside the output directory"
        raise ConfigurationError(
            f"{str(path)!r} {what} {str(root)!r}, where generate writes only its own files; "
            "remove the link or pick a new --output directory."
        )
    return path


class OutputDir:
    """A resumable output directory: :meth:`open` it, then ``write_chunk`` the rows left.

    >>> out = OutputDir.open("out", Layout(2, 1, 3, 4), {"input": "..."})  # doctest: +SKIP
    >>> out.remaining(chunk_size=64)  # doctest: +SKIP
    [(0, 2)]
    """

    def __init__(self, root: Path, layout: Layout):
        self.root, self.layout = root, layout
        self.done = list(self.chunk_files(root))
        self.data = TensorDict.load_memmap(inside(root, DATA))  # tensors, written in place

    @classmethod
    def open(cls, path, layout: Layout, fingerprint: dict, *, overwrite=False) -> OutputDir:
        """Resume the run in ``path`` if it has this fingerprint, else start one there."""
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
                f"--output {str(path)!r} cannot be written ({e.strerror}); pick another place."
            ) from None
        root, fingerprint = root.resolve(), {**fingerprint, **layout._asdict()}
        try:
            old = cls.read_run(root)
        except ConfigurationError:
            if not overwrite:
                raise
            old = {}  # unreadable, and discarded anyway
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
            cls.start(root, layout, fingerprint)
        return cls(root, layout)

    @staticmethod
    def start(root: Path, layout: Layout, fingerprint: dict) -> None:
        """Clear what a previous run left, preallocate ``data/``, then write ``run.json``."""
        own = sorted((e.name for e in root.iterdir() if _own(e.name)), key=lambda n: n != RUN)
        for path in (inside(root, name) for name in own):  # run.json first: the rest is ours
            (shutil.rmtree if path.is_dir() else os.unlink)(path)
        b = [layout.rows] if layout.samples == 1 else [layout.rows, layout.samples]
        widths = {"prompt": layout.prompt_width, "response": layout.max_tokens}
        full = layout.prompt_width + layout.max_tokens
        data = {  # expanded scalars: no memory until memmapped
            group: cls(
                **{n: torch.zeros((), dtype=dtype).expand(*b, widths.get(n, full)) for n in names},
                padded=MetaData(True, batch_size=b),
                batch_size=b,
            )
            for group, (cls, dtype, _, names) in FIELDS.items()
        }
        data["row"] = torch.zeros((), dtype=torch.long).expand(b)
        TensorDict(data, batch_size=b).memmap_like(inside(root, DATA))
        inside(root, CHUNKS).mkdir(mode=0o700)
        write_json_atomic(inside(root, RUN), fingerprint)  # last: the run exists from here on

    @staticmethod
    def read_run(root: Path) -> dict | None:
        """The fingerprint in ``run.json``, None without one."""
        path = inside(root, RUN)
        if not path.exists():
            return None
        try:
            run = json.loads(path.read_text())
            if not isinstance(run, dict) or not {"rows", "samples"} <= set(run):
                raise ValueError("not a generate run file")
        except (OSError, ValueError) as e:  # JSONDecodeError is a ValueError
            raise ConfigurationError(
                f"{str(path)!r} cannot be read as a generate run ({e!r}); pass --overwrite to "
                "start the run again."
            ) from None
        return run

    @staticmethod
    def chunk_files(root: Path) -> dict[tuple[int, int], Path]:  # the committed chunks
        chunks = inside(root, CHUNKS)
        matches = [m for m in map(_CHUNK.fullmatch, os.listdir(chunks)) if m]
        return {(int(m[1]), int(m[2])): inside(chunks, m[0]) for m in matches}

    @property
    def rows_done(self) -> int:
        return sum(hi - lo for lo, hi in self.done)

    @property
    def complete(self) -> bool:  # every row in exactly one chunk
        return self.rows_done == self.layout.rows and not self.remaining(1)

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


def _own(name: str) -> bool:  # written by generate at the top of the output directory
    return name in (RUN, DATA, CHUNKS, LOG_FILE_NAME) or (
        name.startswith(f".{RUN}.") and name.endswith(".tmp")
    )


def chunk_output(result, prompts, lo: int, hi: int, layout: Layout, tokenizer, pad: int):
    """The policy's output -> ``(tensors, strings, tokens)``: tensors at the output's widths,
    the chunk file's fields (``prompt``, ``id`` per row, the rest per sample), tokens made."""
    response, mask = result.get(("tokens", "response")), result.get(("masks", "all_attention_mask"))
    w, r, batch = result.get(("tokens", "prompt")).shape[-1], response.shape[-1], result.batch_size

    def fit(x, name, fill):  # to the output's widths: prompts left-padded, responses right
        left, right = (layout.prompt_width - w, 0), (0, layout.max_tokens - r)
        if name in ("prompt", "response"):
            return F.pad(x, left if name == "prompt" else right, value=fill)
        return torch.cat(
            [F.pad(x[..., :w], left, value=fill), F.pad(x[..., w:], right, value=fill)], -1
        )

    tensors = {
        (group, name): fit(result.get((group, name)), name, pad if fill is None else fill)
        for group, (_, _, fill, names) in FIELDS.items()
        for name in names
    }
    tensors["row"] = torch.arange(lo, hi).reshape(-1, *[1] * (len(batch) - 1)).expand(batch)

    decode = partial(
        tokenizer.batch_decode, skip_special_tokens=False, clean_up_tokenization_spaces=False
    )
    n = mask[..., w:].sum(-1).flatten()
    strings = {
        "prompt": prompts.texts[lo:hi] if prompts.texts else decode(prompts.token_ids[lo:hi]),
        "response": decode([x[:k] for x, k in zip(response.reshape(-1, r), n, strict=True)]),
        "weight_version": list(flatten_rows(result.get(("vllm", "weight_version")).tolist())),
        "finish_reason": list(flatten_rows(result.get(("vllm", "finish_reason")).tolist())),
    }
    if prompts.ids is not None:
        strings["id"] = prompts.ids[lo:hi]
    return tensors, strings, int(n.sum())


def load_output(path: str | Path):
    """The finished output of ``generate --output path``: the memmapped tensors of ``data/``
    with the chunk files' ``text``, ``("vllm", "weight_version" | "finish_reason")``, ``id``."""
    root = Path(path).expanduser().resolve()
    run = OutputDir.read_run(root)
    out = OutputDir(root, Layout(*(run[k] for k in Layout._fields))) if run else None
    if out is None or not out.complete:
        raise ConfigurationError(
            f"{str(path)!r} holds no finished generate output ({out.rows_done if out else 0} rows "
            "done); run (or resume) torchrl-vllm generate with --output there first."
        )
    td, g, cols = out.data, out.layout.samples, {}
    for _, file in sorted(OutputDir.chunk_files(root).items()):
        for name, values in json.loads(file.read_text()).items():
            cols.setdefault(name, []).extend(values)
    for name in ("prompt", "id"):  # per row -> per sample
        cols[name] = [v for v in cols.get(name, []) for _ in range(g)]
    cols["full"] = [p + r for p, r in zip(cols["prompt"], cols["response"], strict=True)]

    def strings(values: list):
        if all(v == values[0] for v in values):
            return NonTensorData(values[0], batch_size=td.batch_size)  # one value, not N
        return NonTensorStack.from_list(
            [values[i : i + g] for i in range(0, len(values), g)] if g > 1 else values
        )

    text = {k: strings(cols[k]) for k in ("prompt", "response", "full")}
    td.set("text", Text(**text, batch_size=td.batch_size))
    for name in ("weight_version", "finish_reason"):
        td.set(("vllm", name), strings(cols[name]))
    if cols["id"]:
        td.set("id", strings(cols["id"]))
    return td

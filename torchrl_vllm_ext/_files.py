"""Small file helpers shared by the weight slots, the adapters and the generate output.

Private directories of our own (with an owner marker) come from
:func:`torchrl_vllm_ext.leftovers.owned_dir`."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def fsync_path(path: str | Path) -> None:
    """fsync a file or a directory by path.

    For a directory this makes a rename inside it durable; for a file it also writes back
    the pages dirtied through a shared memory mapping of it.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(path: str | Path, text: str) -> None:
    """Replace ``path`` with ``text`` atomically and durably (0600).

    Write a temporary file beside it, fsync it, rename it over ``path``, fsync the
    directory: a reader sees the old content or the new, never a torn file, even if
    the writer is killed.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def write_json_atomic(path: str | Path, obj: Any) -> None:
    """:func:`write_text_atomic` of ``obj`` as JSON."""
    write_text_atomic(path, json.dumps(obj))


__all__ = ["fsync_path", "write_json_atomic", "write_text_atomic"]

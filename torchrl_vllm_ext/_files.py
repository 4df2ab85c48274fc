"""Small durable-file helpers shared by the weight slots and the generate output."""

from __future__ import annotations

import os
from pathlib import Path


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


__all__ = ["fsync_path"]

"""The error an engine-core process printed before it died, read back from our stderr.

When vLLM's engine core fails while it starts (too little KV-cache memory, a bad
argument, an out-of-memory), it prints its traceback to the stderr it inherited and
``AsyncLLM`` raises only "Engine core initialization failed. See root cause above".
A replica's stderr is a file (Ray's worker log, or the service's ``log_file``), so the
replica marks where that file ends before the engine starts and, if the start fails
that way, reads what was written since and names its last exception.

Also the two helpers around it: :func:`redirect_output` points the actor's file descriptors at
its log file (where vLLM's engine core writes), and :func:`root_cause` names the innermost
error of an exception chain.
"""

from __future__ import annotations

import os
import re
import stat
import sys

READ_LIMIT = 256 << 10  # the tail of a long log is enough: the traceback comes last
SEE_ABOVE = "root cause above"
"""vLLM's words when the cause is only in the engine-core process's output."""

# ``ValueError: ...`` / ``torch.OutOfMemoryError: ...`` / a Ray worker's
# ``ray.exceptions.RayTaskError(OutOfMemoryError): ...`` (tensor-parallel workers), possibly
# after vLLM's ``(EngineCore_DP0 pid=42) `` prefix on a child process's lines.
_EXCEPTION_LINE = re.compile(
    r"^(?:\([\w.-]+ pid=\d+\)\s*)?"
    r"(?P<line>(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit)"
    r"(?:\([\w.]+\))?: .+)$"
)


class StderrMark:
    """Where this process's stderr file ends now; :meth:`written_since` reads past it.

    ``path`` is None when stderr is not a regular file (a terminal, a pipe): nothing to
    read back then.
    """

    def __init__(self, fd: int = 2):
        self.path: str | None = None
        self.offset = 0
        try:
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode):
                self.path = os.readlink(f"/proc/self/fd/{fd}")
                self.offset = st.st_size
        except OSError:
            pass

    def written_since(self, limit: int = READ_LIMIT) -> str:
        """What was appended to the file since the mark (its last ``limit`` bytes)."""
        if self.path is None:
            return ""
        try:
            with open(self.path, "rb") as f:
                end = f.seek(0, os.SEEK_END)
                f.seek(max(self.offset, end - limit))
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""


def last_exception(text: str, ignore: str = SEE_ABOVE) -> str | None:
    """The last ``Type: message`` line of ``text`` (a traceback's last line), skipping
    lines that contain ``ignore`` (the outer "see root cause above" error itself).

    Examples:
        >>> last_exception(
        ...     "Traceback (most recent call last):\\n"
        ...     '  File "core.py", line 1010\\n'
        ...     "(EngineCore_DP0 pid=7) ValueError: No available memory for the cache blocks.\\n"
        ...     "RuntimeError: Engine core initialization failed. See root cause above.\\n"
        ... )
        'ValueError: No available memory for the cache blocks.'
    """
    found = None
    for raw in text.splitlines():
        match = _EXCEPTION_LINE.match(raw.strip())
        if match and ignore not in raw:
            found = match.group("line")
    return found


def explain(cause: str, mark: StderrMark) -> str:
    """``cause``, with the engine-core process's own error put first when vLLM's message
    only points "above" at it."""
    if SEE_ABOVE not in cause:
        return cause
    inner = last_exception(mark.written_since())
    if inner is None:
        return cause
    return f"{inner} (in vLLM's engine-core process; vLLM said: {cause})"


def root_cause(error: BaseException) -> str:
    """``Type: message`` of the innermost exception that ``error`` was raised from.

    Examples:
        >>> try:
        ...     try:
        ...         raise RuntimeError("head_dim=24 unsupported")
        ...     except RuntimeError as e:
        ...         raise ValueError("engine is gone") from e
        ... except ValueError as outer:
        ...     root_cause(outer)
        'RuntimeError: head_dim=24 unsupported'
    """
    while error.__cause__ is not None or (
        error.__context__ is not None and not error.__suppress_context__
    ):
        error = error.__cause__ or error.__context__
    return f"{type(error).__name__}: {error}"


def redirect_output(path: str) -> None:
    """Point this process's stdout and stderr (file descriptors 1 and 2, which vLLM's
    loggers, C++ warnings and child processes all write to) at ``path``, appended."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)

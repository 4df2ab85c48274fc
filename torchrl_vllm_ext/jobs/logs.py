"""Where a command's log lines go: everything to a log file, little to the terminal.

Quiet (the default): the terminal shows the job's own progress (INFO from
``torchrl_vllm_ext.jobs`` and ``torchrl_vllm_ext.grpo``), this package's warnings and
anyone's errors. The log file gets every record at the chosen level, this package's
DEBUG lines (one per weight push), vLLM's and Ray's loggers, Python warnings, and the
replicas' own output (the job passes the same file to ``ServiceConfig.log_file``).
Verbose (``-v``): the terminal shows everything the file gets, and the replicas' output
is forwarded by Ray as usual.

Terminal lines go through ``tqdm.write`` so they never break a progress bar.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from tqdm.auto import tqdm

PACKAGE = "torchrl_vllm_ext"
JOB_LOGGERS = (f"{PACKAGE}.jobs", f"{PACKAGE}.grpo")
LOG_FILE_NAME = "torchrl-vllm.log"
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
TERMINAL_FORMAT = "%(asctime)s %(levelname)s %(message)s"  # quiet: the job's own lines
# Libraries that install their own terminal handlers; their records are routed through ours.
OWN_HANDLER_LOGGERS = ("ray", "transformers", "vllm")


class TqdmHandler(logging.Handler):
    """A terminal handler that writes above the progress bars (``tqdm.write``)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # a logging handler never raises
            self.handleError(record)


class LazyFileHandler(logging.FileHandler):
    """A file handler that creates its file (and directory) at its first record, so a
    command refused for a bad argument leaves no output directory behind."""

    def _open(self):
        Path(self.baseFilename).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        return super()._open()


def quiet_filter(record: logging.LogRecord) -> bool:
    """What reaches the terminal by default: job progress, our warnings, anyone's errors.

    Examples:
        >>> rec = logging.LogRecord("vllm.config", logging.WARNING, "", 0, "", None, None)
        >>> quiet_filter(rec)
        False
        >>> rec.name, rec.levelno = "torchrl_vllm_ext.grpo.run", logging.INFO
        >>> quiet_filter(rec)
        True
    """
    name = record.name
    if name.startswith(JOB_LOGGERS):
        return record.levelno >= logging.INFO
    if name == PACKAGE or name.startswith(PACKAGE + "."):
        return record.levelno >= logging.WARNING
    return record.levelno >= logging.ERROR


def job_log_file(output: str | Path | None) -> Path | None:
    """The log file of a job that writes into ``output`` (None: the job has no file)."""
    return None if output is None else Path(output) / LOG_FILE_NAME


def setup_logging(log_file: Path | None, *, verbose: bool, level: str = "INFO") -> None:
    """Route every log record of this process as the module docstring says."""
    # Their imports install their own terminal handlers, which are replaced below.
    import ray  # noqa: F401
    import transformers

    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.setLevel(level.upper())
    formatter = logging.Formatter(FORMAT)
    console = TqdmHandler()
    console.setFormatter(formatter if verbose else logging.Formatter(TERMINAL_FORMAT, "%H:%M:%S"))
    if not verbose:
        console.addFilter(quiet_filter)
    root.addHandler(console)
    if log_file is not None:
        to_file = LazyFileHandler(log_file, mode="a", encoding="utf-8", delay=True)
        to_file.setFormatter(formatter)
        root.addHandler(to_file)
        # One line per weight push and the like: kept, but in the file only.
        logging.getLogger(PACKAGE).setLevel(logging.DEBUG)
    for name in OWN_HANDLER_LOGGERS:
        lib = logging.getLogger(name)
        for handler in list(lib.handlers):
            lib.removeHandler(handler)
        lib.propagate = True
    logging.captureWarnings(True)
    if not verbose:
        transformers.utils.logging.disable_progress_bar()  # "Loading weights" bars


__all__ = ["LOG_FILE_NAME", "TqdmHandler", "job_log_file", "quiet_filter", "setup_logging"]

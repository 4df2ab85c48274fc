"""The command line's log routing: a quiet terminal, everything in the log file, -v for all."""

from __future__ import annotations

import logging
import warnings

import pytest

from torchrl_vllm_ext.cli import build_parser
from torchrl_vllm_ext.jobs.logs import LOG_FILE_NAME, job_log_file, setup_logging

RECORDS = [
    ("torchrl_vllm_ext.grpo.run", logging.INFO, "job progress"),
    ("torchrl_vllm_ext.weight_sync.scheme", logging.DEBUG, "pushed version 7"),
    ("torchrl_vllm_ext.engine.driver.service", logging.INFO, "replica 0 restarted"),
    ("torchrl_vllm_ext.engine.driver.service", logging.WARNING, "replica 1 died"),
    ("vllm.platforms.cpu", logging.WARNING, "libtcmalloc is not found"),
    ("ray._private.authentication", logging.WARNING, "Token authentication is enabled"),
    ("vllm.engine", logging.ERROR, "engine core failed"),
]


def emit_all() -> None:
    for name, level, message in RECORDS:
        logging.getLogger(name).log(level, message)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("a library deprecation", FutureWarning, stacklevel=1)


@pytest.mark.usefixtures("restore_logging")
def test_quiet_terminal_keeps_progress_warnings_and_errors_the_file_keeps_all(tmp_path, capsys):
    log_file = job_log_file(tmp_path / "out")
    setup_logging(log_file, verbose=False)
    emit_all()
    terminal = capsys.readouterr().err
    for shown in ("job progress", "replica 1 died", "engine core failed"):
        assert shown in terminal
    for hidden in ("pushed version 7", "replica 0 restarted", "libtcmalloc", "Token auth", "depr"):
        assert hidden not in terminal
    written = log_file.read_text()
    assert log_file.name == LOG_FILE_NAME
    for _, _, message in RECORDS:
        assert message in written
    assert "a library deprecation" in written


@pytest.mark.usefixtures("restore_logging")
def test_verbose_terminal_shows_everything(tmp_path, capsys):
    setup_logging(job_log_file(tmp_path), verbose=True)
    emit_all()
    terminal = capsys.readouterr().err
    for _, _, message in RECORDS:
        assert message in terminal


@pytest.mark.parametrize("job", ["demo", "generate", "bench"])
def test_every_job_takes_verbose(job, tmp_path):
    required = {"generate": ["--model", "m", "--input", "i", "--output", str(tmp_path)]}
    args = build_parser().parse_args([job, "-v", *required.get(job, [])])
    assert args.verbose
    assert not build_parser().parse_args([job, *required.get(job, [])]).verbose

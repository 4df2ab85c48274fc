"""Fixtures of the unit tier."""

from __future__ import annotations

import logging

import pytest


@pytest.fixture
def restore_logging():
    """Put the process's logging back as it was: for tests that run the CLI's set-up."""
    root, names = logging.getLogger(), ("torchrl_vllm_ext", "ray", "transformers", "vllm")
    libs = {n: logging.getLogger(n) for n in names}
    saved = (list(root.handlers), root.level, {n: lg.level for n, lg in libs.items()})
    own = {n: (list(lg.handlers), lg.propagate) for n, lg in libs.items()}
    # A CLI run earlier in the process may have left warnings captured: logging would then
    # keep that run's showwarning and never route this test's warnings.
    logging.captureWarnings(False)
    yield
    for name, (handlers, propagate) in own.items():
        libs[name].handlers[:] = handlers
        libs[name].propagate = propagate
    for handler in list(root.handlers):
        root.removeHandler(handler)
        if handler not in saved[0]:
            handler.close()
    for handler in saved[0]:
        root.addHandler(handler)
    root.setLevel(saved[1])
    for name, level in saved[2].items():
        logging.getLogger(name).setLevel(level)
    logging.captureWarnings(False)

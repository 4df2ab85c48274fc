"""Every module's docstring examples run (those marked ``+SKIP`` need live replicas)."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import torchrl_vllm_ext

MODULES = sorted(
    m.name
    for m in pkgutil.walk_packages(torchrl_vllm_ext.__path__, prefix="torchrl_vllm_ext.")
    if not m.name.endswith("__main__")
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in finder.find(module, name, globs=vars(module).copy()):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"

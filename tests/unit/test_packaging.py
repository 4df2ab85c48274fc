"""The package installs where vLLM does: Python 3.11-3.14."""

from __future__ import annotations

import tomllib
from pathlib import Path

from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parents[2]


def test_requires_python_admits_every_version_vllm_supports():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    spec = SpecifierSet(project["requires-python"])
    for minor in (11, 12, 13, 14):
        assert f"3.{minor}" in spec, f"requires-python {spec} refuses Python 3.{minor}"
        assert f"Programming Language :: Python :: 3.{minor}" in project["classifiers"]
    assert "3.10" not in spec and "3.15" not in spec, "vLLM has no wheel there"


def test_run_sh_looks_for_the_same_versions():
    script = (ROOT / "run.sh").read_text()
    for minor in (11, 12, 13, 14):
        assert f"python3.{minor}" in script
    assert "(3, 11) <= sys.version_info[:2] <= (3, 14)" in script

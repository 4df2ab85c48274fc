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


def _uv_with_pip_config():
    import importlib.util

    path = ROOT / "tools" / "uv_with_pip_config.py"
    spec = importlib.util.spec_from_file_location("uv_with_pip_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_uv_is_given_the_package_sources_pip_is_configured_with():
    tool = _uv_with_pip_config()
    listing = "\n".join(
        [
            "global.cert='/certs/ca.pem'",
            "global.constraint='/etc/pip/constraints.txt'",
            "global.extra-index-url='file:///a/simple file:///b/simple'",
            "global.find-links='/wheels/global'",
            "install.find-links='/wheels/install'",
            "download.find-links='/wheels/download'",  # another command's section
            ":env:.disable-pip-version-check='1'",
            ":env:.default-timeout='180'",
            ":env:.pre='no'",
            ":env:.no-index='true'",
            ":env:.prefer-binary='1'",
        ]
    )
    settings = tool.effective_settings(tool.parse_config_list(listing))
    args, env, ignored = tool.uv_options(settings)
    pairs = list(zip(args[::2], args[1::2], strict=False))
    # :env: over [install] over [global], as pip orders them; one flag per list item.
    assert ("--find-links", "/wheels/install") in pairs
    assert "/wheels/global" not in args and "/wheels/download" not in args
    assert ("--extra-index-url", "file:///a/simple") in pairs
    assert ("--extra-index-url", "file:///b/simple") in pairs
    assert ("--constraints", "/etc/pip/constraints.txt") in pairs
    assert ("--cert", "/certs/ca.pem") in pairs
    assert "--no-index" in args and "--prerelease" not in args
    assert env == {"UV_HTTP_TIMEOUT": "180"}
    assert ignored == ["prefer-binary"]  # said, not silently dropped


def test_an_environment_variable_overrides_pip_conf_and_an_empty_one_is_skipped():
    tool = _uv_with_pip_config()
    listing = "global.index-url='https://mirror/simple'\n:env:.index-url='https://other/simple'\n"
    assert tool.effective_settings(tool.parse_config_list(listing)) == {
        "index-url": "https://other/simple"
    }
    listing = "global.index-url='https://mirror/simple'\n:env:.index-url=''\n"
    assert tool.effective_settings(tool.parse_config_list(listing)) == {
        "index-url": "https://mirror/simple"
    }


def test_run_sh_installs_with_uv_and_falls_back_to_pip():
    script = (ROOT / "run.sh").read_text()
    assert "tools/uv_with_pip_config.py" in script
    assert "--index-strategy unsafe-best-match" in script
    assert "--compile-bytecode" in script  # as pip: no process compiles the sources again
    assert "uv failed; installing with pip" in script
    assert "pip uninstall -q -y torchvision torchaudio torchcodec" in script


def test_the_real_pip_config_listing_reaches_uv_command_line(tmp_path):
    import os
    import subprocess
    import sys

    conf = tmp_path / "pip.conf"
    conf.write_text("[global]\nextra-index-url = file:///a/simple\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "UV_"))}
    env.update(PIP_CONFIG_FILE=str(conf), PIP_FIND_LINKS="/wheels one")
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "uv_with_pip_config.py"), "echo", "pip", "install"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert out[:2] == ["pip", "install"]
    assert " ".join(out[2:]).count("--find-links") == 2
    assert "file:///a/simple" in out and "/wheels" in out and "one" in out

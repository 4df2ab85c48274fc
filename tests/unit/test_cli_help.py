"""Every ``torchrl-vllm ... --help`` text is written for a user: no reST markup (backticks,
``:mod:`` / ``:class:`` roles) and no source paths, in the command's description and in
every option's help (those read from a config's field docstrings included)."""

from __future__ import annotations

import argparse
import re

import pytest

from torchrl_vllm_ext.cli import build_parser

MARKUP = re.compile(r"`|:(?:mod|class|func|meth|attr|data):|\b[\w./-]+\.py\b")


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


PARSER = build_parser()
COMMANDS = subcommands(PARSER)


def test_every_command_of_the_cli_is_checked():
    assert set(COMMANDS) == {"demo", "generate", "bench", "doctor", "check-model"}


@pytest.mark.parametrize("command", ["", *COMMANDS])
def test_help_has_no_markup_or_source_paths(command):
    text = (COMMANDS[command] if command else PARSER).format_help()
    found = sorted({m.group(0) for m in MARKUP.finditer(text)})
    assert not found, f"torchrl-vllm {command} --help shows {found}:\n{text}"

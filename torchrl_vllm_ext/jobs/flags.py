"""Command-line flags derived from a config dataclass: each option is declared once.

A flag's type and default come from the field, its help from the field's docstring
(the string literal under it, as plain text: no reST markup on a terminal), so the CLI
and the config can never disagree.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import re
import textwrap
import types
import typing
from functools import cache
from typing import Any


@cache
def field_docs(cls) -> dict[str, str]:
    """``{field: docstring}`` of a dataclass, read from its source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, after in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


_ROLE = re.compile(r":[a-z]+:`(~?)([^`]*)`")
_LITERAL = re.compile(r"``?([^`]*)``?")


def plain_text(doc: str) -> str:
    """``doc`` without its reST markup: literals and cross references as their text (a
    reference's last dotted part when it starts with ``~``).

    Examples:
        >>> plain_text("pushes (``kl_coef > 0``) through :class:`~torchrl_vllm_ext.AdapterSync`")
        'pushes (kl_coef > 0) through AdapterSync'
    """
    doc = _ROLE.sub(lambda m: m[2].rsplit(".", 1)[-1] if m[1] else m[2], doc)
    return _LITERAL.sub(r"\1", doc)


def _scalar_type(hint) -> Any:
    """``int`` for ``int | None`` and the like; the type argparse converts with."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return hint


def add_config_flags(
    parser: argparse.ArgumentParser,
    cls,
    fields: dict[str, str],
    choices: dict[str, tuple] | None = None,
) -> None:
    """Add ``--flag`` for each ``{field: flag}`` of dataclass ``cls`` (a ``bool`` field, off
    by default: a switch without a value)."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    defaults = {f.name: f for f in dataclasses.fields(cls)}
    for name, flag in fields.items():
        f = defaults[name]
        default = f.default if f.default is not dataclasses.MISSING else None
        if hints[name] is bool:  # a switch: present is True (the field defaults to False)
            parser.add_argument(
                flag, dest=name, action="store_true", help=plain_text(docs.get(name, ""))
            )
            continue
        parser.add_argument(
            flag,
            dest=name,
            type=_scalar_type(hints[name]),
            default=default,
            choices=(choices or {}).get(name),
            help=f"{plain_text(docs.get(name, ''))} (default: {default})",
        )


def config_from_args(cls, args: argparse.Namespace, fields: dict[str, str], **extra):
    """An instance of ``cls`` from the parsed flags ``fields`` plus ``extra`` values."""
    return cls(**{name: getattr(args, name) for name in fields}, **extra)


__all__ = ["add_config_flags", "config_from_args", "field_docs", "plain_text"]

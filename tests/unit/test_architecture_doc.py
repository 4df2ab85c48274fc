"""docs/architecture.md's layout names every module of the package where it lives, and
nothing that is not there: the layout of record stays true as code moves."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "torchrl_vllm_ext"
ENTRY = re.compile(r"^(?P<indent> *)(?P<name>[A-Za-z_][\w]*(?:/|\.py))(?:\s|$)")


def layout_paths() -> set[str]:
    """Module paths the layout block (the document's first code block) lists: a folder
    line (``name/``) opens a folder for the lines indented below it."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("```\n", 2)[1]
    folders: list[tuple[int, str]] = []  # (indent, name) of the open folders
    paths = set()
    for line in block.splitlines():
        m = ENTRY.match(line)
        if m is None:
            continue
        indent, name = len(m["indent"]), m["name"]
        while folders and folders[-1][0] >= indent:
            folders.pop()
        prefix = "".join(f for _, f in folders)
        if name.endswith("/"):
            folders.append((indent, name))
            paths.add(prefix + name)
        else:
            paths.add(prefix + name)
    return paths


def package_paths() -> set[str]:
    out = set()
    for p in PACKAGE.rglob("*.py"):
        rel = p.relative_to(PACKAGE)
        if p.name == "__init__.py":
            if rel.parent != Path("."):
                out.add(f"{rel.parent.as_posix()}/")
        else:
            out.add(rel.as_posix())
    return out


def test_the_layout_lists_every_module_where_it_lives():
    listed, real = layout_paths(), package_paths()
    assert not real - listed, f"modules the layout leaves out: {sorted(real - listed)}"
    assert not listed - real, f"the layout lists what does not exist: {sorted(listed - real)}"

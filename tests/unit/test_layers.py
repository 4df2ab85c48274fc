"""The package's import rules, read from the source (no import runs): engine/ by process,
engine/ never reaching into weight_sync/ (docs/architecture.md), and no import circle."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "torchrl_vllm_ext"
ENGINE = "torchrl_vllm_ext.engine"


def imports_of(path: Path) -> set[str]:
    """Every module ``path`` imports (absolute names; ``from X import y`` gives X and X.y)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return found


def engine_modules():
    for path in sorted((PACKAGE / "engine").rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        yield path, ".".join(rel.parts).removesuffix(".__init__")


def sub_package(module: str) -> str | None:
    """``replica`` / ``driver`` / ``handles`` for a module under one, else None (shared)."""
    parts = module.removeprefix(ENGINE).strip(".").split(".")
    return parts[0] if len(parts) > 1 and parts[0] in ("replica", "driver", "handles") else None


def test_engine_never_imports_weight_sync():
    for path, module in engine_modules():
        bad = {m for m in imports_of(path) if m.startswith("torchrl_vllm_ext.weight_sync")}
        assert not bad, f"{module} imports {sorted(bad)}: engine/ knows nothing of weight sync"


def test_engine_sub_packages_follow_their_processes():
    allowed = {
        None: {None},  # shared modules import no sub-package
        "replica": {None, "replica"},
        "handles": {None, "handles"},
        "driver": {None, "replica", "driver", "handles"},
    }
    for path, module in engine_modules():
        own = sub_package(module)
        for imported in imports_of(path):
            if imported == ENGINE or not imported.startswith(ENGINE + "."):
                continue
            other = sub_package(imported)
            if imported.removeprefix(ENGINE + ".") in ("replica", "driver", "handles"):
                other = imported.removeprefix(ENGINE + ".")
            assert other in allowed[own], (
                f"{module} ({own or 'shared'}) imports {imported} ({other}): see "
                "docs/architecture.md for which engine/ package may import which"
            )


def package_modules() -> dict[str, Path]:
    """Every module of the package but the ``__init__`` files (they re-export, nothing
    else: an edge through one is no dependency of its own)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if not module.endswith(".__init__"):
            found[module] = path
    return found


def import_circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan, iterative).

    >>> import_circles({"a": {"b"}, "b": {"a"}, "c": {"a"}})
    [['a', 'b']]
    """
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    circles.append(sorted(group))
    return circles


def test_no_import_circles():
    # Imports inside functions count too: a lazy import hides a circle, it does not end it.
    modules = package_modules()
    edges = {m: {i for i in imports_of(p) if i in modules and i != m} for m, p in modules.items()}
    assert import_circles(edges) == [], "modules importing each other: move what both need"

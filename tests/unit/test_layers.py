"""The package's import rules, read from the source (no import runs): engine/ by process,
and engine/ never reaching into weight_sync/ (docs/architecture.md)."""

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

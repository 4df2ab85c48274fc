"""No module reads or writes another module's private names (``obj._name`` where ``_name``
is defined by the package's code elsewhere), and only ``_compat/`` reaches into Ray's or
vLLM's private modules and attributes. Read from the source: no import runs."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "torchrl_vllm_ext"
COMPAT = ROOT / "_compat"
FOREIGN = {"_private", "_actor_id", "_ray_actor_id"}
"""Ray's private modules and attributes: _compat's alone."""


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _trees() -> dict[Path, ast.AST]:
    return {p: ast.parse(p.read_text()) for p in sorted(ROOT.rglob("*.py"))}


def _defined(trees) -> tuple[dict[str, set[Path]], dict[tuple[str, str], Path]]:
    """Private names of the package's objects (methods and class attributes, attributes
    set on ``self``) -> the modules that define them; and ``(module name, private
    module-level name)`` -> the module."""
    members: dict[str, set[Path]] = {}
    module_level: dict[tuple[str, str], Path] = {}
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                        if _private(item.name):
                            members.setdefault(item.name, set()).add(path)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                value = node.value
                if isinstance(value, ast.Name) and value.id in ("self", "cls"):
                    if _private(node.attr):
                        members.setdefault(node.attr, set()).add(path)
        for node in tree.body:
            names = []
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names = [node.name]
            elif isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = [t.id for t in targets if isinstance(t, ast.Name)]
            for name in names:
                if _private(name):
                    module_level[(path.stem, name)] = path
    return members, module_level


def _foreign_names(tree: ast.AST) -> set[str]:
    """Names a module imports from other packages (their objects' privates are theirs)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if not node.module.startswith("torchrl_vllm_ext"):
                names |= {a.asname or a.name for a in node.names}
    return names - {"torchrl_vllm_ext"}


def _root(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _own(node: ast.Attribute) -> bool:
    """``self._x``, ``cls._x`` and ``super()._x``: the object's own."""
    value = node.value
    if isinstance(value, ast.Name) and value.id in ("self", "cls"):
        return True
    return (
        isinstance(value, ast.Call)
        and isinstance(value.func, ast.Name)
        and value.func.id == "super"
    )


def test_no_module_touches_another_modules_private_names():
    trees = _trees()
    members, module_level = _defined(trees)
    offenders = []
    for path, tree in trees.items():
        foreign = _foreign_names(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not _private(node.attr) or _own(node):
                continue
            if _root(node.value) in foreign:  # another package's object
                continue
            owners = members.get(node.attr, set())
            if isinstance(node.value, ast.Name) and (node.value.id, node.attr) in module_level:
                owners = owners | {module_level[(node.value.id, node.attr)]}
            if owners and path not in owners:
                where = sorted(str(p.relative_to(ROOT)) for p in owners)
                offenders.append(
                    f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)} "
                    f"(private to {where}): give its owner a public method"
                )
    assert not offenders, "\n".join(offenders)


def test_only_compat_reaches_into_rays_private_names():
    offenders = [
        f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}"
        for path, tree in _trees().items()
        if COMPAT not in path.parents
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr in FOREIGN
    ]
    assert not offenders, "move these into _compat/:\n" + "\n".join(offenders)

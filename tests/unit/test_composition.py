"""Composition, not mixins: no class of the package takes a base of ours whose methods write
the subclass's state, and in the replica and weight sync a base of ours is an interface.

A file-size cut that turns half a class into a base writing the class's private fields
(the replica's worker calls writing its version and cache epoch, the scheme's TorchRL calls
writing its model and collector) is what these catch: cut by concept into a part that owns
its state, held by its owner (docs/architecture.md)."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "torchrl_vllm_ext"
INTERFACES_ONLY = ("engine/replica/", "weight_sync/")
"""Folders where a base of ours must be an interface (an ABC), not a share of the code."""

# Calls on an attribute that change it in place (self._x.update(...) writes self._x).
MUTATORS = frozenset(
    {"add", "append", "clear", "discard", "extend", "insert", "pop", "remove", "update"}
)


@dataclass(frozen=True)
class ClassInfo:
    module: str  # path relative to the package
    node: ast.ClassDef
    imports: dict[str, str]  # name in the module -> the package module it comes from


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def package_classes() -> dict[tuple[str, str], ClassInfo]:
    """``{(module, class name): ClassInfo}`` of every class the package defines."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        imports = {
            alias.asname or alias.name: node.module
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom)
            and node.module
            and node.module.startswith("torchrl_vllm_ext")
            for alias in node.names
        }
        rel = path.relative_to(PACKAGE).as_posix()
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                out[(module_name(path), node.name)] = ClassInfo(rel, node, imports)
    return out


def package_bases(cls: ClassInfo, classes) -> list[ClassInfo]:
    """The bases of ``cls`` defined in the package (by the module's own names)."""
    module = next(m for (m, n), info in classes.items() if info is cls)
    found = []
    for base in cls.node.bases:
        if not isinstance(base, ast.Name):
            continue
        origin = cls.imports.get(base.id, module)
        if (origin, base.id) in classes:
            found.append(classes[(origin, base.id)])
    return found


def written_on_self(nodes) -> set[str]:
    """The attributes of ``self`` these nodes assign, augment or change in place."""
    written = set()
    for node in (n for top in nodes for n in ast.walk(top)):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in MUTATORS
        ):
            targets = [node.func.value]
        for target in targets:
            if (
                isinstance(target, ast.Attribute)
                and isinstance(target.value, ast.Name)
                and target.value.id == "self"
            ):
                written.add(target.attr)
    return written


def methods(cls: ClassInfo, init: bool) -> list[ast.AST]:
    """``cls``'s ``__init__`` (``init``) or its other methods."""
    defs = [n for n in cls.node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    return [d for d in defs if (d.name == "__init__") is init]


def is_interface(cls: ClassInfo) -> bool:
    """An ABC (``abc.ABC`` / ``ABCMeta`` base) or an exception of the hierarchy."""
    names = {
        b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "") for b in cls.node.bases
    }
    names |= {
        k.value.attr if isinstance(k.value, ast.Attribute) else getattr(k.value, "id", "")
        for k in cls.node.keywords
        if k.arg == "metaclass"
    }
    return bool(names & {"ABC", "ABCMeta", "Protocol", "Exception"}) or cls.module == "errors.py"


def mixins_writing_subclass_state() -> list[str]:
    """``"Subclass(Base): attrs"`` for each base of ours whose methods (its own ``__init__``
    aside) write attributes the subclass's ``__init__`` sets: the subclass's state."""
    classes = package_classes()
    found = []
    for cls in classes.values():
        owned = written_on_self(methods(cls, init=True))
        for base in package_bases(cls, classes):
            shared = written_on_self(methods(base, init=False)) & owned
            if shared:
                found.append(f"{cls.node.name}({base.node.name}): {sorted(shared)}")
    return sorted(found)


def test_no_base_of_ours_writes_its_subclass_state():
    assert mixins_writing_subclass_state() == []


def test_replica_and_weight_sync_bases_of_ours_are_interfaces():
    classes = package_classes()
    shares = sorted(
        f"{cls.module}:{cls.node.name}({base.node.name})"
        for cls in classes.values()
        if cls.module.startswith(INTERFACES_ONLY)
        for base in package_bases(cls, classes)
        if not is_interface(base)
    )
    assert shares == [], (
        "a base of ours that is not an interface: hold the part instead (composition), its "
        f"methods the owner's by one-line delegations: {shares}"
    )


def test_the_check_sees_a_mixin_that_writes_its_subclass_state(tmp_path):
    """The scan finds the shape it forbids (a base's method assigning, augmenting or
    updating the subclass's fields)."""
    source = """
class Calls:
    def load(self):
        self._version = "1"
        self._epoch += 1
        self._switches.update({})

class Replica(Calls):
    def __init__(self):
        self._version = "0"
        self._epoch = 0
        self._switches = {}
"""
    tree = ast.parse(source)
    base, sub = (ClassInfo("x.py", n, {}) for n in tree.body)
    shared = written_on_self(methods(base, init=False)) & written_on_self(methods(sub, init=True))
    assert shared == {"_version", "_epoch", "_switches"}

"""The transports stay closed (docs/architecture.md): each folder talks to the others only
through the protocol and the registry, and the registry is the only list of their names in
the package, the tests and the benchmarks. Read from the source: no import runs."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from torchrl_vllm_ext.extensions import load_class
from torchrl_vllm_ext.weight_sync.transports import registry
from torchrl_vllm_ext.weight_sync.transports.protocol import Transport

ROOT = Path(__file__).resolve().parents[2]
TRANSPORTS_DIR = ROOT / "torchrl_vllm_ext" / "weight_sync" / "transports"
PKG = "torchrl_vllm_ext.weight_sync.transports"
FOLDERS = sorted(p.name for p in TRANSPORTS_DIR.iterdir() if (p / "__init__.py").exists())
NAMES = set(registry.TRANSPORTS) | set(registry.ROUTES)


def sources(*roots: Path):
    for root in roots:
        yield from sorted(p for p in root.rglob("*.py") if ".venv" not in p.parts)


def private_names_defined(folder: str) -> set[str]:
    """``_names`` a folder's code sets on ``self`` or defines as methods."""
    names = set()
    for path in (TRANSPORTS_DIR / folder).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("_"):
                names.add(node.name)
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and node.attr.startswith("_")
            ):
                names.add(node.attr)
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if node.value.startswith("_tvllm_"):  # self.__dict__ keys
                    names.add(node.value)
    return {n for n in names if not n.startswith("__")}


def test_every_folder_is_a_registered_transport_and_every_transport_a_folder():
    assert set(FOLDERS) == set(registry.TRANSPORTS)
    for name, info in registry.TRANSPORTS.items():
        sender = load_class(info.sender)
        assert issubclass(sender, Transport) and sender.name == name
        assert info.sender.startswith(f"{PKG}.{name}.") and info.receiver.startswith(
            f"{PKG}.{name}."
        )
        load_class(info.receiver)
    for route in registry.ROUTES.values():
        assert route.name in registry.TRANSPORTS[route.transport].routes


@pytest.mark.parametrize("folder", FOLDERS)
def test_a_transport_imports_no_other_transports_folder(folder):
    others = [f"{PKG}.{o}" for o in FOLDERS if o != folder]
    for path in (TRANSPORTS_DIR / folder).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            modules = []
            if isinstance(node, ast.ImportFrom) and node.module:
                modules = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            for m in modules:
                bad = [o for o in others if m == o or m.startswith(o + ".")]
                assert not bad, f"{path.relative_to(ROOT)} imports {m}: go through the registry"


@pytest.mark.parametrize("folder", FOLDERS)
def test_a_transport_touches_no_other_transports_private_names(folder):
    theirs = set().union(*(private_names_defined(o) for o in FOLDERS if o != folder))
    theirs -= private_names_defined(folder)  # the same name, its own
    for path in (TRANSPORTS_DIR / folder).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            touched = None
            if isinstance(node, ast.Attribute) and node.attr in theirs:
                touched = node.attr
            if isinstance(node, ast.Constant) and node.value in theirs:
                touched = node.value
            assert touched is None, (
                f"{path.relative_to(ROOT)}:{node.lineno} touches {touched}, private to another "
                "transport: add a step to the protocol instead"
            )


def collections_of_names(tree: ast.AST):
    """Tuple / list / set / dict literals holding two or more transport or route names."""
    for node in ast.walk(tree):
        items = []
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            items = node.elts
        elif isinstance(node, ast.Dict):
            items = [k for k in node.keys if k is not None]
        found = {e.value for e in items if isinstance(e, ast.Constant) and e.value in NAMES}
        if len(found) >= 2:
            yield node.lineno, sorted(found)


def test_the_registry_is_the_only_list_of_transport_names():
    allowed = {TRANSPORTS_DIR / "registry.py"}
    roots = (ROOT / "torchrl_vllm_ext", ROOT / "tests", ROOT / "benchmarks", ROOT / "examples")
    lists = [
        f"{path.relative_to(ROOT)}:{line} {names}"
        for path in sources(*roots)
        if path not in allowed
        for line, names in collections_of_names(ast.parse(path.read_text()))
    ]
    assert not lists, "transport names listed outside the registry:\n" + "\n".join(lists)


def test_the_worker_object_holds_every_registered_receiver():
    from torchrl_vllm_ext.weight_sync.worker import WorkerWeightSync

    class Worker:  # what the receivers are built with; nothing is called
        loads_class = None

    built = WorkerWeightSync(Worker())
    held = {type(v) for v in vars(built).values()}
    assert {load_class(t.receiver) for t in registry.TRANSPORTS.values()} <= held

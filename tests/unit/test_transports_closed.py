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


SHARDED_DIR = ROOT / "torchrl_vllm_ext" / "weight_sync" / "sharded"
TRANSPORT_HOLDERS = {"transport", "transport_impl"}
"""What the sharded push calls the transport it holds (``scheme.transport_impl``, or the
capability it looked up: ``transport``)."""


def declared_by_the_protocol() -> set[str]:
    """The public members of the protocol and its capabilities (not what a transport
    happens to hold: ``options``, ``fleet``, a storage writer)."""
    from torchrl_vllm_ext.weight_sync.transports.protocol import Streamed, WrittenByRanks

    classes = (Transport, WrittenByRanks, Streamed)
    members = {n for cls in classes for n in [*vars(cls), *cls.__annotations__]}
    return {n for n in members if not n.startswith("_")}


def reached_outside_the_protocol(root: Path, declared: set[str]) -> list[str]:
    """Each ``<transport>.<name>`` read under ``root`` whose name the protocol does not
    declare, as ``path:line holder.name``."""
    out = []
    for path in sources(root):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            holder = node.value
            held = getattr(holder, "id", None) or getattr(holder, "attr", None)
            if held in TRANSPORT_HOLDERS and node.attr not in declared:
                out.append(f"{path.relative_to(root.parent)}:{node.lineno} {held}.{node.attr}")
    return out


def test_the_sharded_push_reaches_its_transport_only_through_declared_capabilities():
    declared = declared_by_the_protocol()
    assert {"reserve_written", "prepare_written", "bucket_bytes", "prepare_streamed"} <= declared
    outside = reached_outside_the_protocol(SHARDED_DIR, declared)
    assert not outside, "the sharded push reaches past the protocol:\n" + "\n".join(outside)

"""The package's wire rules, read from the source (no import runs): nothing of ours
unpickles what another process sent (no ``pickle.load(s)``, no torch object collective),
and no ``TCPStore`` master is made but through :mod:`torchrl_vllm_ext.listening`, which
binds it to the host it is given (torch's own listens on every interface)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "torchrl_vllm_ext"
OBJECT_COLLECTIVES = {
    "broadcast_object_list",
    "all_gather_object",
    "gather_object",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
}
"""torch.distributed's collectives that pickle what they send and unpickle what arrives."""


def calls(path: Path):
    """(name called, keyword names) of every call in ``path``."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            owner = (
                func.value.id
                if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)
                else ""
            )
            yield owner, name, node


def test_nothing_unpickles_what_another_process_sent():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for owner, name, node in calls(path):
            if (owner == "pickle" and name in ("load", "loads")) or name in OBJECT_COLLECTIVES:
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {owner}.{name}")
    assert not found, f"pickle across processes (send JSON / msgspec / tensors): {found}"


def test_every_store_master_listens_on_its_host_only():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "listening.py":
            continue
        for _, name, node in calls(path):
            if name != "TCPStore":
                continue
            master = [k for k in node.keywords if k.arg == "is_master"]
            positional_master = len(node.args) >= 4
            if positional_master or (master and not _is_false(master[0].value)):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not found, f"a TCPStore master outside listening.serve_store: {found}"


def _is_false(value: ast.expr) -> bool:
    return isinstance(value, ast.Constant) and value.value is False

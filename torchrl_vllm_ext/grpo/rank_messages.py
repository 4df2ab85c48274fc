"""What trainer ranks send each other, as plain data: a JSON header and raw tensor bytes.

torch's object collectives (``scatter_object_list``, ``gather_object``) unpickle whatever
arrives, so a process that reaches the group could run code in a rank. A batch crosses
instead as tensordict's consolidated layout (one byte buffer and a description of its
leaves) with the description in JSON; the tensor classes it names are rebuilt only from
tensordict and TorchRL. Metrics and signals cross as JSON.

Every message is a frame: two int64 sizes, the JSON header's bytes, then the payload's
bytes (when there is one), point to point on the default process group (gloo).
"""

from __future__ import annotations

import importlib
import json

import torch
import torch.distributed as dist
from tensordict import TensorDictBase

TRUSTED_MODULES = ("tensordict.", "torchrl.")
"""The modules whose tensor classes a received batch may name (TorchRL's LLM layout)."""


def send_json(value, dst: int) -> None:
    """``value`` (JSON-able) to rank ``dst``."""
    _send_frame({"json": value}, None, dst)


def receive(src: int):
    """What rank ``src`` sent next: a tensordict (:func:`send_tensordict`) or a JSON
    value (:func:`send_json`)."""
    header, storage = _recv_frame(src)
    if "tensordict" in header:
        return rebuild(header["tensordict"], storage)
    return header["json"]


def send_tensordict(td: TensorDictBase, dst: int) -> None:
    """``td`` to rank ``dst``: its consolidated bytes and their JSON description."""
    consolidated = td.consolidate(metadata=True)
    layout = consolidated._consolidated
    _send_frame({"tensordict": to_plain(layout["metadata"])}, layout["storage"], dst)


def rebuild(plain: dict, storage: torch.Tensor) -> TensorDictBase:
    """A tensordict from its consolidated bytes and :func:`to_plain` description.

    Examples:
        >>> from tensordict import TensorDict
        >>> td = TensorDict({"a": torch.arange(3), "b": {"c": torch.ones(3, 2)}}, [3])
        >>> layout = td.consolidate(metadata=True)._consolidated
        >>> back = rebuild(json.loads(json.dumps(to_plain(layout["metadata"]))), layout["storage"])
        >>> torch.equal(back["b", "c"], td["b", "c"]), back["a"].tolist()
        (True, [0, 1, 2])
    """
    from tensordict._reductions import _rebuild_tensordict_files_consolidated

    return _rebuild_tensordict_files_consolidated(_classes_back(plain), storage.clone())


def to_plain(metadata):
    """tensordict's consolidated metadata as JSON-able data: tuples as lists, a tensor
    class as ``"module:qualname"``; a value JSON cannot hold raises ``TypeError``."""
    if isinstance(metadata, dict):
        return {str(k): _class_name(v) if k == "cls" else to_plain(v) for k, v in metadata.items()}
    if isinstance(metadata, (list, tuple, torch.Size)):
        return [to_plain(v) for v in metadata]
    if metadata is None or isinstance(metadata, (str, int, float, bool)):
        return metadata
    if isinstance(metadata, torch.device):
        return str(metadata)
    raise TypeError(
        f"a batch sent between trainer ranks holds a {type(metadata).__name__} "
        f"({metadata!r:.80}) that JSON cannot carry: keep non-tensor entries to strings and "
        "numbers, or drop the entry before the step."
    )


def _class_name(cls) -> str:
    if isinstance(cls, str):  # tensordict's own names (TensorDict, NonTensorStack, ...)
        return cls
    return f"{cls.__module__}:{cls.__qualname__}"


def _classes_back(plain):
    if isinstance(plain, dict):
        return {k: _class_of(v) if k == "cls" else _classes_back(v) for k, v in plain.items()}
    if isinstance(plain, list):
        return [_classes_back(v) for v in plain]
    return plain


def _class_of(name: str):
    if ":" not in name:
        return name
    module, qualname = name.split(":", 1)
    if not module.startswith(TRUSTED_MODULES):
        raise ValueError(
            f"a batch from another trainer rank names the class {name}: only tensordict's and "
            "TorchRL's tensor classes are rebuilt."
        )
    found = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part)
    return found


def _send_frame(header: dict, payload: torch.Tensor | None, dst: int) -> None:
    data = json.dumps(header).encode()
    size = -1 if payload is None else payload.numel()
    dist.send(torch.tensor([len(data), size], dtype=torch.int64), dst)
    dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst)
    if payload is not None and size:
        dist.send(payload.contiguous().view(torch.uint8), dst)


def _recv_frame(src: int) -> tuple[dict, torch.Tensor | None]:
    sizes = torch.empty(2, dtype=torch.int64)
    dist.recv(sizes, src)
    header_bytes, payload_bytes = (int(s) for s in sizes)
    data = torch.empty(header_bytes, dtype=torch.uint8)
    dist.recv(data, src)
    header = json.loads(data.numpy().tobytes())
    payload = None
    if payload_bytes >= 0:
        payload = torch.empty(payload_bytes, dtype=torch.uint8)
        if payload_bytes:
            dist.recv(payload, src)
    return header, payload


__all__ = ["rebuild", "receive", "send_json", "send_tensordict", "to_plain"]

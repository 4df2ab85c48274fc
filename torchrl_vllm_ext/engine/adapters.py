"""LoRA adapters the service serves: names, vLLM ids, and where each one's weights are.

vLLM identifies an adapter by an int id. An adapter comes either from a PEFT directory
(``adapter_config.json`` + ``adapter_model.safetensors``), which vLLM loads itself, or
from memory (a trainer's tensors, :class:`AdapterTensors`), which the replicas' workers
build from the tensors with no file written. The service keeps one registry: every
replica holds every live adapter (a restarted or added replica gets them before it takes
traffic), and a request names its adapter.

A replica on another node than the driver cannot read the driver's directory (unless it
is shared): the service ships the files (a few MB) through Ray's object store and the
replica writes them to a private directory of its own (:func:`stage_files`). An adapter
from memory reaches every replica through Ray's object store (one object per version).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from torchrl_vllm_ext.engine import shared_memory
from torchrl_vllm_ext.engine.shared_memory import SharedRegion
from torchrl_vllm_ext.errors import ConfigurationError, InvalidRequestError

_ALIGN = 64
"""Each tensor's offset in :attr:`AdapterTensors.data` is a multiple of this (a view of
any dtype starts aligned)."""


@dataclass(frozen=True)
class Adapter:
    """One live adapter (plain data: it crosses to the replicas)."""

    name: str
    """The name requests use."""
    lora_id: int
    """vLLM's int id (unique within the service, never reused)."""
    path: str | None
    """PEFT adapter directory on the driver's node; None for an adapter from memory."""
    shared: bool = False
    """Whether every node sees ``path`` (a shared file system): then no files are shipped."""
    nbytes: int = 0
    """Bytes of an adapter from memory (its load's deadline); 0 for a directory."""

    @property
    def in_memory(self) -> bool:
        """Whether the replicas' workers built it from tensors (no directory)."""
        return self.path is None


@dataclass(frozen=True)
class AdapterTensors:
    """An adapter's tensors and PEFT config as plain data: one buffer and a JSON header
    (what crosses Ray's object store to the replicas and vLLM's RPC to their workers).

    Built by :func:`pack_adapter`, read by :func:`unpack_adapter`.
    """

    header_json: str
    """``{"config": PEFT's LoraConfig as a dict, "tensors": [[name, dtype, shape,
    offset, nbytes], ...]}``."""
    data: np.ndarray
    """Every tensor's bytes, each at its offset (uint8; a replica reads it from Ray's
    object store without a copy, and hands its workers a memoryview of it)."""
    shared: SharedRegion | None = None
    """Where ``data`` also lies in the packing process's shared memory (an adapter push's
    :class:`AdapterPacker`): replicas on its node read it there, not from Ray's object store."""

    def header_only(self) -> AdapterTensors:
        """The header and the shared region, without the bytes (what crosses to a
        replica that reads the region)."""
        return AdapterTensors(self.header_json, np.zeros(0, dtype=np.uint8), self.shared)


def check_adapter_dir(path: str | Path) -> str:
    """The absolute adapter directory, or a typed error naming what is missing."""
    root = Path(path).expanduser().absolute()
    if not (root / "adapter_config.json").is_file():
        raise ConfigurationError(
            f"{str(path)!r} is not a PEFT LoRA adapter directory (no adapter_config.json); "
            "save one with peft_model.save_pretrained(path)."
        )
    return str(root)


class AdapterRegistry:
    """Name -> :class:`Adapter`; ids are allocated here.

    Examples:
        >>> reg = AdapterRegistry()
        >>> reg._add("a", "/x").lora_id, reg._add("b", "/y").lora_id
        (1, 2)
        >>> reg.get("a").path
        '/x'
    """

    def __init__(self):
        self._live: dict[str, Adapter] = {}
        self._ids = itertools.count(1)  # vLLM reserves 0 for "no adapter"

    def add(
        self, name: str, path: str | Path | None, shared: bool = False, nbytes: int = 0
    ) -> tuple[Adapter, Adapter | None]:
        """Register ``name`` at ``path`` (None: an adapter from memory of ``nbytes``) under
        a new id (also when the name is re-added); returns it and the adapter it
        replaces, if any."""
        if not isinstance(name, str) or not name:
            raise ConfigurationError(f"adapter name {name!r} must be a non-empty string.")
        previous = self._live.get(name)
        path = None if path is None else check_adapter_dir(path)
        return self._add(name, path, shared, nbytes), previous

    def _add(self, name: str, path: str | None, shared: bool = False, nbytes: int = 0) -> Adapter:
        adapter = Adapter(name, next(self._ids), path, shared, nbytes)
        self.put(adapter)
        return adapter

    def put(self, adapter: Adapter) -> None:
        """Make ``adapter`` the live one for its name again (undo a failed :meth:`add`)."""
        # Copy on write: readers on other threads iterate the dict they got.
        self._live = {**self._live, adapter.name: adapter}

    def replace(self, adapters) -> None:
        """Serve exactly ``adapters`` (a service handle follows its owner's)."""
        self._live = {a.name: a for a in adapters}

    def remove(self, name: str) -> Adapter:
        adapter = self.get(name)
        self._live = {k: a for k, a in self._live.items() if k != name}
        return adapter

    def get(self, name: str) -> Adapter:
        try:
            return self._live[name]
        except KeyError:
            raise InvalidRequestError(
                f"no LoRA adapter named {name!r} is loaded (live: {sorted(self._live)}); "
                "add it with service.add_lora(name, path)."
            ) from None

    def live(self) -> list[Adapter]:
        return list(self._live.values())


def adapter_capacity(engine_kwargs: dict) -> int:
    """How many adapters each replica's workers hold at once: vLLM's ``max_cpu_loras``,
    which defaults to ``max_loras`` (default 1).

    Examples:
        >>> adapter_capacity({"max_loras": 3}), adapter_capacity({"max_cpu_loras": 4})
        (3, 4)
    """
    return int(engine_kwargs.get("max_cpu_loras") or engine_kwargs.get("max_loras") or 1)


def jsonable(value):
    """``json.dumps``'s ``default`` for PEFT configs: sets sorted, enums by value."""
    if isinstance(value, set | frozenset):
        return sorted(value)
    if hasattr(value, "value"):  # enums (PEFT's task type)
        return value.value
    return str(value)


def pack_adapter(tensors: dict[str, torch.Tensor], config: dict) -> AdapterTensors:
    """``tensors`` (CPU) and ``config`` as one buffer and a JSON header.

    Examples:
        >>> packed = pack_adapter({"a": torch.ones(2, 3)}, {"r": 2})
        >>> tensors, config = unpack_adapter(packed.header_json, packed.data)
        >>> tensors["a"].shape, config
        (torch.Size([2, 3]), {'r': 2})
    """
    flat = [
        t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8) for t in tensors.values()
    ]
    specs, offset = [], 0
    for (name, t), part in zip(tensors.items(), flat, strict=True):
        specs.append(
            [name, str(t.dtype).removeprefix("torch."), list(t.shape), offset, part.numel()]
        )
        offset += -(-part.numel() // _ALIGN) * _ALIGN
    # NOTE: a numpy array: Ray's object store takes it in one copy and a replica reads it
    # without one (bytes or a bytearray are copied into and out of a pickle).
    data = np.empty(offset, dtype=np.uint8)
    if flat:
        buffer = torch.from_numpy(data)
        torch._foreach_copy_([buffer[s[3] : s[3] + s[4]] for s in specs], flat)
    header = json.dumps({"config": config, "tensors": specs}, default=jsonable)
    return AdapterTensors(header, data)


class AdapterPacker:
    """Packs one adapter's tensors, push after push, into buffers it keeps: the layout
    (each tensor's offset, the header) is computed when the names, dtypes or shapes
    change, and a push is one batched copy from the trainer's tensors (any device or
    layout) into one of ``slots`` buffers, with no allocation. With ``shared`` (Linux),
    the buffers are anonymous shared memory (:class:`~.shared_memory.SharedSlots`) that
    replicas on this node read directly: no ``ray.put``.

    What :meth:`pack` returns shares its slot: hand it on (``add_lora_tensors``) and pack
    into another slot while the replicas may still read it (an adapter version's slot
    stays untouched while the version is live).

    Examples:
        >>> packer = AdapterPacker(slots=2)
        >>> packed = packer.pack({"a": torch.ones(2, 3)}, {"r": 2}, slot=0)
        >>> unpack_adapter(packed.header_json, packed.data)[0]["a"].sum().item()
        6.0
        >>> bytes(packed.shared.read()) == packed.data.tobytes()  # replicas read this
        True
        >>> other = packer.pack({"a": torch.zeros(2, 3)}, {"r": 2}, slot=1)
        >>> float(packer.flat().sum()), packer.tensors["a"].sum().item()  # slot 1's
        (0.0, 0.0)
        >>> unpack_adapter(packed.header_json, packed.data)[0]["a"].sum().item()  # slot 0 kept
        6.0
    """

    def __init__(self, slots: int = 1, shared: bool = True):
        self._slots, self._shared = slots, shared and shared_memory.available()
        self._layout: tuple = ()  # ((name, dtype, shape), ...) the buffers are laid out for
        self._specs: list[list] = []
        self._memory: shared_memory.SharedSlots | None = None
        self._data: list[np.ndarray] = [np.zeros(0, dtype=np.uint8)] * slots
        self._views: list[dict[str, torch.Tensor]] = [{} for _ in range(slots)]
        self._last = 0  # the slot packed last
        self._header: tuple[dict, str] | None = None  # (config, header JSON)

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors packed last: views of their slot (CPU, contiguous)."""
        return self._views[self._last]

    def flat(self) -> torch.Tensor | None:
        """Every value packed last in one 1-D tensor (zeros between tensors), when all
        share one floating dtype (one reduction then checks them all); else None."""
        dtypes = {t.dtype for t in self.tensors.values()}
        if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
            return None
        return torch.from_numpy(self._data[self._last]).view(dtypes.pop())

    def pack(self, tensors: dict[str, torch.Tensor], config: dict, slot: int = 0) -> AdapterTensors:
        """``tensors`` and ``config`` packed into slot ``slot``."""
        layout = tuple((name, t.dtype, tuple(t.shape)) for name, t in tensors.items())
        if layout != self._layout:
            self._lay_out(layout)
        if tensors:
            with torch.no_grad():
                torch._foreach_copy_(list(self._views[slot].values()), list(tensors.values()))
        if self._header is None or self._header[0] != config:
            header = json.dumps({"config": config, "tensors": self._specs}, default=jsonable)
            self._header = (copy.deepcopy(config), header)
        self._last = slot
        data = self._data[slot]
        shared = None if self._memory is None else self._memory.region(slot, data.nbytes)
        return AdapterTensors(self._header[1], data, shared)

    def _lay_out(self, layout: tuple) -> None:
        specs, offset = [], 0
        for name, dtype, shape in layout:
            nbytes = math.prod(shape) * dtype.itemsize
            specs.append([name, str(dtype).removeprefix("torch."), list(shape), offset, nbytes])
            offset += -(-nbytes // _ALIGN) * _ALIGN
        # zeros between tensors (flat() sums them); the old buffers stay with their readers
        if self._shared and offset:
            self._memory = shared_memory.SharedSlots(self._slots, offset)
            self._data = [self._memory.array(i) for i in range(self._slots)]
        else:
            self._memory = None
            self._data = [np.zeros(offset, dtype=np.uint8) for _ in range(self._slots)]
        self._views = [_views_of(data, specs, layout) for data in self._data]
        self._layout, self._specs, self._header = layout, specs, None


def _views_of(data: np.ndarray, specs: list[list], layout: tuple) -> dict[str, torch.Tensor]:
    buffer = torch.from_numpy(data)
    return {
        s[0]: buffer[s[3] : s[3] + s[4]].view(dtype).view(shape)
        for s, (_, dtype, shape) in zip(specs, layout, strict=True)
    }


def unpack_adapter(
    header_json: str, data, into: bytearray | None = None
) -> tuple[dict[str, torch.Tensor], dict]:
    """``(tensors, config)`` of :func:`pack_adapter`'s output: views of one writable copy of
    ``data`` (any bytes-like buffer; vLLM may scale the tensors in place), made in ``into``
    when it has ``data``'s size (its pages already mapped: a fresh copy of 16 MB spends
    most of its ~8 ms faulting them in), else new; a :class:`ValueError` naming the tensor
    that ``data`` does not hold."""
    header = json.loads(header_json)
    for name, _, _, offset, nbytes in header["tensors"]:
        if offset + nbytes > len(data):
            raise ValueError(
                f"adapter tensor {name!r} ends at byte {offset + nbytes} of a "
                f"{len(data)}-byte buffer; the adapter was not shipped whole, push it again."
            )
    if into is not None and len(into) == len(data):
        memoryview(into)[:] = data  # a memcpy (bytearray's slice assignment is ~5x slower)
        data = into
    else:
        data = bytearray(data)
    whole: dict[str, torch.Tensor] = {}  # dtype -> the buffer viewed as that dtype
    tensors = {}
    for name, dtype, shape, offset, _ in header["tensors"]:
        if dtype not in whole:
            whole[dtype] = _typed(data, getattr(torch, dtype))
        # one view per tensor, straight from the typed buffer (slicing, then viewing and
        # reshaping, costs three: ~2 ms for a 336-tensor adapter)
        typed = whole[dtype]
        tensors[name] = typed.as_strided(shape, _strides(shape), offset // typed.element_size())
    return tensors, header["config"]


def _typed(data: bytearray, dtype: torch.dtype) -> torch.Tensor:
    """``data`` as a 1-D tensor of ``dtype`` (its whole elements), sharing its memory."""
    count = len(data) // dtype.itemsize
    if count == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(data, dtype=dtype, count=count)


def _strides(shape) -> tuple[int, ...]:
    """A contiguous tensor's strides for ``shape``."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def read_files(adapter: Adapter) -> dict[str, bytes]:
    """The adapter directory's files (name -> bytes), to ship to another node."""
    return {f.name: f.read_bytes() for f in sorted(Path(adapter.path).iterdir()) if f.is_file()}


def stage_files(adapter: Adapter, files: dict[str, bytes], root: Path) -> Adapter:
    """Write shipped files under ``root`` (published by a rename); the adapter as loaded
    from there."""
    final = root / str(adapter.lora_id)
    staging = root / f".{adapter.lora_id}.partial"
    staging.mkdir(mode=0o700, parents=True, exist_ok=True)
    for name, data in files.items():
        (staging / Path(name).name).write_bytes(data)  # .name: no path from the wire
    os.replace(staging, final)
    return dataclasses.replace(adapter, path=str(final))


__all__ = [
    "Adapter",
    "AdapterPacker",
    "AdapterRegistry",
    "AdapterTensors",
    "adapter_capacity",
    "check_adapter_dir",
    "jsonable",
    "pack_adapter",
    "read_files",
    "stage_files",
    "unpack_adapter",
]

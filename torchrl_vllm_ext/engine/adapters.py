"""LoRA adapters the service serves: names, vLLM ids and where their files are.

vLLM identifies an adapter by an int id and loads it from a PEFT directory
(``adapter_config.json`` + ``adapter_model.safetensors``). The service keeps one
registry: every replica holds every live adapter (a restarted or added replica gets them
before it takes traffic), and a request names its adapter.

A replica on another node than the driver cannot read the driver's directory (unless it
is shared): the service ships the files (a few MB) through Ray's object store and the
replica writes them to a private directory of its own (:func:`stage_files`).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from dataclasses import dataclass
from pathlib import Path

from torchrl_vllm_ext.errors import ConfigurationError, InvalidRequestError


@dataclass(frozen=True)
class Adapter:
    """One live adapter (plain data: it crosses to the replicas)."""

    name: str
    """The name requests use."""
    lora_id: int
    """vLLM's int id (unique within the service, never reused)."""
    path: str
    """PEFT adapter directory on the driver's node."""
    shared: bool = False
    """Whether every node sees ``path`` (a shared file system): then no files are shipped."""


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
        self, name: str, path: str | Path, shared: bool = False
    ) -> tuple[Adapter, Adapter | None]:
        """Register ``name`` at ``path`` under a new id (also when the name is re-added);
        returns it and the adapter it replaces, if any."""
        if not isinstance(name, str) or not name:
            raise ConfigurationError(f"adapter name {name!r} must be a non-empty string.")
        previous = self._live.get(name)
        return self._add(name, check_adapter_dir(path), shared), previous

    def _add(self, name: str, path: str, shared: bool = False) -> Adapter:
        adapter = Adapter(name, next(self._ids), path, shared)
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


__all__ = ["Adapter", "AdapterRegistry", "check_adapter_dir", "read_files", "stage_files"]

"""LoRA adapters the service serves: names, vLLM ids and where their files are.

vLLM identifies an adapter by an int id and loads it from a PEFT directory
(``adapter_config.json`` + ``adapter_model.safetensors``). The service keeps one
registry: every replica holds every live adapter (a restarted or added replica gets them
before it takes traffic), and a request names its adapter.
"""

from __future__ import annotations

import itertools
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
    """PEFT adapter directory, as every replica's node sees it."""


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

    def add(self, name: str, path: str | Path) -> tuple[Adapter, Adapter | None]:
        """Register ``name`` at ``path`` under a new id (also when the name is re-added);
        returns it and the adapter it replaces, if any."""
        if not isinstance(name, str) or not name:
            raise ConfigurationError(f"adapter name {name!r} must be a non-empty string.")
        previous = self._live.get(name)
        return self._add(name, check_adapter_dir(path)), previous

    def _add(self, name: str, path: str) -> Adapter:
        adapter = Adapter(name, next(self._ids), path)
        self._live[name] = adapter
        return adapter

    def put(self, adapter: Adapter) -> None:
        """Make ``adapter`` the live one for its name again (undo a failed :meth:`add`)."""
        self._live[adapter.name] = adapter

    def remove(self, name: str) -> Adapter:
        adapter = self.get(name)
        del self._live[name]
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


__all__ = ["Adapter", "AdapterRegistry", "check_adapter_dir"]

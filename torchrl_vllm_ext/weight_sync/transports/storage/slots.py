"""The storage transport's double buffer: two memory-mapped TensorDict slots, A and B.

Writer: fill the idle slot in place (allocated once), then publish a manifest
(version, slot, names, shapes, dtypes, checksums) by atomically renaming
``current.json``. Readers open only the published slot and verify it against the
manifest, so a writer killed at any moment leaves readers on the last published
version. Directories are 0700 and files 0600: the weights are the user's.

The writer owns what it creates: :meth:`SlotWriter.close` (or interpreter exit)
removes its slots and manifest, and the whole root when the writer made it (a
private tmpfs directory by default, marked with its owner so a killed writer's
slots are reaped by the next start: :mod:`torchrl_vllm_ext.leftovers`).
"""

from __future__ import annotations

import logging
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from tensordict import TensorDict

from torchrl_vllm_ext import leftovers
from torchrl_vllm_ext._files import write_text_atomic
from torchrl_vllm_ext.errors import WeightSyncError
from torchrl_vllm_ext.weight_sync.params import checksum, dtype_name
from torchrl_vllm_ext.weight_sync.specs import SlotManifest, TensorSpec, from_json, to_json

logger = logging.getLogger(__name__)

SLOTS = ("A", "B")
CURRENT = "current.json"
WEIGHTS_PREFIX = "torchrl-vllm-weights-"
"""Name prefix of a writer's private root (its own directory in /dev/shm)."""


def slot_key(name: str) -> str:
    """A tensor's key in a slot (TensorDict keys may not contain the nested-key
    separator used for flattening)."""
    return name.replace(".", "__")


def layout_of(tensors: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> tuple:
    """The slots' layout of ``tensors``: (name, shape, dtype) of each, in order (``dtype``:
    every tensor stored in it)."""
    return tuple((k, tuple(t.shape), dtype or t.dtype) for k, t in tensors.items())


def open_slot(path: str | Path, mode: str = "r+") -> TensorDict:
    """A slot's tensors, mapped (``r+``: a writer in another process fills its part)."""
    return TensorDict.load_memmap(path, mode=mode)


def _private(path: Path) -> None:
    for p in [path, *path.rglob("*")]:
        os.chmod(p, 0o700 if p.is_dir() else 0o600)


class SlotWriter:
    """Trainer side of the double buffer.

    Examples:
        >>> import torch
        >>> w = SlotWriter()  # a private directory in /dev/shm
        >>> manifest = w.write({"w": torch.ones(3)}, version="1")
        >>> read_published(w.root)[0].version
        '1'
        >>> w.close()  # removes the directory it made
        >>> w.root.exists()
        False

    Args:
        root: the slots' directory. Default: a new private directory, removed on
            :meth:`close`, garbage collection or interpreter exit. A given directory is
            the user's: only :meth:`close` removes the writer's files in it (the slots
            and the manifest), nothing else.
        num_threads: copy and checksum threads.
    """

    def __init__(self, root: str | Path | None = None, num_threads: int = 4):
        self._owns_root = root is None
        if root is None:
            self.root = leftovers.owned_dir(WEIGHTS_PREFIX)
            # One owner, one cleanup: close(), garbage collection or interpreter exit.
            self._cleanup = leftovers.remove_at_exit(self, self.root)
        else:
            self.root = Path(root)
            self.root.mkdir(parents=True, exist_ok=True)
            self._cleanup = None
        os.chmod(self.root, 0o700)
        self.num_threads = num_threads
        self._slots: dict[str, TensorDict] = {}
        self._layout: tuple | None = None
        self.written = 0
        """Bytes the last :meth:`write` wrote into its slot."""

    def close(self) -> None:
        """Unmap and remove the slots and the manifest (the whole root if this writer
        made it). Idempotent; readers that still map a slot keep their pages until they
        unmap."""
        self._slots.clear()
        self._layout = None
        if self._cleanup is not None:
            self._cleanup()
        else:
            _remove_slots(self.root)

    def _published_slot(self) -> str | None:
        try:
            return from_json((self.root / CURRENT).read_text(), SlotManifest).slot
        except FileNotFoundError:
            return None

    def _slot(self, name: str, layout: tuple) -> TensorDict:
        """Slot ``name`` mapped, allocated for ``layout`` ((name, shape, dtype) per tensor)
        straight in the file: no copy of the weights in this process."""
        if self._layout is not None and layout != self._layout:
            raise WeightSyncError(
                "the pushed parameters changed names, shapes or dtypes since the slots were "
                f"allocated in {self.root}; use a new storage directory for a different model."
            )
        self._layout = layout
        if name not in self._slots:
            path = self.root / f"slot-{name}"
            if (path / "meta.json").exists():
                td = open_slot(path)
            else:
                shapes = {slot_key(k): torch.empty(s, dtype=d, device="meta") for k, s, d in layout}
                td = TensorDict(shapes, []).memmap_like(prefix=path, num_threads=self.num_threads)
                _private(path)
            self._slots[name] = td
        return self._slots[name]

    def idle_slot(self) -> str:
        """The slot the next write fills: the one readers are not pointed at."""
        return "B" if self._published_slot() == "A" else "A"

    def idle(self, layout: tuple) -> tuple[str, Path]:
        """The slot the next publish may fill (not the published one), allocated for
        ``layout``, and its directory: for writers in other processes (a sharded trainer's
        ranks, :func:`open_slot`)."""
        name = self.idle_slot()
        self._slot(name, layout)
        return name, self.root / f"slot-{name}"

    def write(
        self,
        tensors: dict[str, torch.Tensor],
        version: str,
        check=None,
        dtype: torch.dtype | None = None,
    ) -> SlotManifest:
        """Fill the idle slot with ``tensors`` and publish it as ``version``.

        ``check(name, tensor)``, when given, runs on each tensor in the same pass (while
        it is in cache) and may raise: then nothing is published. ``dtype``: the slots
        store the tensors cast to it (the served dtype, with delta pushes on).
        """
        idle = self.idle_slot()
        slot = self._slot(idle, layout_of(tensors, dtype))

        # 1) fill the idle slot in place (readers only read the published one) and
        # 2) checksum what is now in the slot, tensor by tensor, in one pass.
        def put(name: str) -> int:
            if check is not None:
                check(name, tensors[name])
            dst = slot.get(slot_key(name))
            dst.copy_(tensors[name])
            return checksum(dst)

        with ThreadPoolExecutor(self.num_threads) as pool:
            sums = list(pool.map(put, tensors))
        specs = tuple(
            TensorSpec(k, dtype_name(dtype or t.dtype), tuple(t.shape), s)
            for (k, t), s in zip(tensors.items(), sums, strict=True)
        )
        manifest = SlotManifest(version=str(version), slot=idle, tensors=specs)
        # 3) publish atomically
        self.publish(manifest)
        self.written = sum(t.numel() * (dtype or t.dtype).itemsize for t in tensors.values())
        return manifest

    def published(self) -> SlotManifest | None:
        """The manifest readers see now (None before the first publish)."""
        try:
            return read_published(self.root)[0]
        except WeightSyncError:
            return None

    def publish(self, manifest: SlotManifest) -> None:
        """Point readers at ``manifest``'s slot: write, fsync, rename over ``current.json``.

        Also rolls a failed push back: re-publishing the previous manifest is safe
        because a write only ever fills the other slot.
        """
        write_text_atomic(self.root / CURRENT, to_json(manifest))
        logger.debug(
            "published version %s in slot %s of %s", manifest.version, manifest.slot, self.root
        )


def _remove_slots(root: Path) -> None:
    """The writer's own files in a user's directory."""
    for name in (*(f"slot-{s}" for s in SLOTS), CURRENT):
        path = root / name
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        elif path.exists():
            path.unlink(missing_ok=True)
    for tmp in root.glob(f".{CURRENT}.*.tmp"):  # a publish cut short
        tmp.unlink(missing_ok=True)


class SlotReader:
    """Worker side: reads and verifies the published slot, keeping each slot mapped once.

    Slots are updated in place, so a mapping stays valid across versions and the
    page cache serves repeated loads without page faults on fresh files.
    """

    def __init__(self, root: str | Path, num_threads: int = 4):
        self.root = Path(root)
        self.num_threads = num_threads
        self._maps: dict[str, TensorDict] = {}

    def close(self) -> None:
        """Drop the mappings (a removed slot's memory is freed once nobody maps it)."""
        self._maps.clear()

    def read(
        self, expect_version: str | None = None, verify: bool = True
    ) -> tuple[SlotManifest, dict[str, torch.Tensor]]:
        """The published manifest and its tensors (views of the mapped slot), verified.

        ``verify=False`` skips the checksums (names, shapes and dtypes are still
        checked): for a reader on the same host as one that just verified this version.
        """
        manifest, _ = read_published(self.root)
        if expect_version is not None and manifest.version != str(expect_version):
            raise WeightSyncError(
                f"storage {self.root} publishes version {manifest.version!r}, expected "
                f"{expect_version!r}; a newer push overtook this one or the writer died before publishing."
            )
        td = self._maps.get(manifest.slot)
        if td is None:
            path = self.root / f"slot-{manifest.slot}"
            if not (path / "meta.json").exists():
                raise WeightSyncError(
                    f"slot {manifest.slot} of {self.root} is missing; the manifest points to nothing. "
                    "Push the weights again (the writer recreates its slots)."
                )
            td = open_slot(path, mode="r")
            self._maps[manifest.slot] = td
        tensors = {}
        for spec in manifest.tensors:
            t = td.get(slot_key(spec.name), None)
            if t is None or tuple(t.shape) != spec.shape or dtype_name(t.dtype) != spec.dtype:
                raise WeightSyncError(
                    f"slot {manifest.slot} (version {manifest.version}) has no tensor {spec.name!r} "
                    f"of shape {spec.shape} and dtype {spec.dtype}; the storage directory is corrupt. "
                    "Push again into a new storage directory."
                )
            tensors[spec.name] = t
        if not verify:
            return manifest, tensors
        with ThreadPoolExecutor(self.num_threads) as pool:
            sums = list(pool.map(checksum, tensors.values()))
        for spec, s in zip(manifest.tensors, sums, strict=True):
            if s != spec.checksum:
                raise WeightSyncError(
                    f"slot {manifest.slot} (version {manifest.version}): checksum mismatch for "
                    f"{spec.name!r}; the slot was modified after publishing. Nothing was loaded. "
                    "Push again (the writer refills a slot and publishes a fresh manifest)."
                )
        return manifest, tensors


def read_published(root: str | Path) -> tuple[SlotManifest, Path]:
    """The manifest of the published slot (raises :class:`WeightSyncError` if there is none)."""
    root = Path(root)
    try:
        text = (root / CURRENT).read_text()
    except FileNotFoundError:
        raise WeightSyncError(
            f"no published weights in {root} (no {CURRENT}); push weights first."
        ) from None
    try:
        manifest = from_json(text, SlotManifest)
    except (ValueError, KeyError, TypeError) as e:
        raise WeightSyncError(
            f"{root / CURRENT} is not a valid manifest ({e}); re-push the weights."
        ) from e
    if manifest.slot not in SLOTS:
        raise WeightSyncError(
            f"{root / CURRENT} names slot {manifest.slot!r}; expected one of {SLOTS}."
        )
    return manifest, root / f"slot-{manifest.slot}"

"""Where a GPU worker stages an incoming version before its pause, and the buffer it stages
in: on the device when the GPU has room beside vLLM's share (the pause is then a device
copy), else in pinned host memory (one batched non-blocking host-to-device copy in the
pause, slower), else nowhere (``mapped``: the pause copies from the
storage slot's pages, when pinning a copy per worker would take more than half the host's
free memory: the workers of a tensor-parallel replica each stage the whole push). Plain
logic: the worker asks
``torch.cuda.mem_get_info`` and follows :func:`staging_place`; :class:`StagingArea` is the
buffer (unit-tested on CPU).

vLLM takes ``gpu_memory_utilization`` of the GPU at start (weights, activations, KV
cache); staging comes out of the rest, which a colocated trainer also uses. So a worker
stages on the device only if the GPU keeps :func:`headroom` free afterwards. The staging
buffer is **reserved at the first sync and kept** from push to push (one flat buffer per
layout: the memory is taken once, not at every push); the worker logs where and how much
when it reserves it.

**Sleep mode**: a replica started with ``enable_sleep_mode`` gives its GPU memory back while
it sleeps (vLLM frees or offloads only what its own allocator holds, never a buffer of
ours), so its staging buffer is reserved in pinned host memory, never on the GPU: its
pause is the pinned copy. (Before, such replicas staged on the device and freed the buffer
after every load, so each push allocated it again.)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import torch

from torchrl_vllm_ext.weight_sync.loading.plan import View

StagingPlace = Literal["device", "pinned", "mapped"]

GIB = 1 << 30
ALIGN = 256
"""Byte alignment of each tensor in the staging buffer (what CUDA's allocator gives)."""


def headroom(total_bytes: int) -> int:
    """GPU memory a staging buffer must leave free: 1 GiB or 2% of the GPU, the larger
    (why not more: ``benchmarks/README.md``)."""
    return max(GIB, total_bytes // 50)


def staging_place(
    nbytes: int,
    free_bytes: int,
    total_bytes: int,
    held_bytes: int = 0,
    sleep_mode: bool = False,
    host_free_bytes: int | None = None,
    copies_on_host: int = 1,
) -> StagingPlace:
    """``device`` if ``nbytes`` of staging fit on the GPU with :func:`headroom` to spare
    (``held_bytes``: a device staging buffer this worker holds already, reused), else
    ``pinned``; never ``device`` for a replica with ``sleep_mode`` (module docstring).
    ``mapped`` instead of ``pinned`` when ``copies_on_host`` pinned copies (the replica's
    workers on this host) would take more than half of ``host_free_bytes``.

    Examples:
        >>> staging_place(1_200_000_000, free_bytes=8 * GIB, total_bytes=140 * GIB)
        'device'
        >>> staging_place(1_200_000_000, free_bytes=2 * GIB, total_bytes=80 * GIB)
        'pinned'
        >>> staging_place(1_200_000_000, 2 * GIB, 80 * GIB, held_bytes=1_200_000_000)
        'device'
        >>> staging_place(1_200_000_000, 60 * GIB, 80 * GIB, sleep_mode=True)
        'pinned'
        >>> staging_place(140 * GIB, 7 * GIB, 80 * GIB, host_free_bytes=1500 * GIB, copies_on_host=8)
        'mapped'
    """
    need = max(0, nbytes - held_bytes)
    if not sleep_mode and need + headroom(total_bytes) <= free_bytes:
        return "device"
    if host_free_bytes is not None and nbytes * copies_on_host > host_free_bytes // 2:
        return "mapped"
    return "pinned"


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class StagingArea:
    """One flat buffer holding every tensor of a push, reserved once per layout and place
    and kept: :meth:`reserve`, then :meth:`fill` at each push.

    Examples:
        >>> area = StagingArea()
        >>> specs = [("a", (2, 3), torch.float32), ("b", (4,), torch.bfloat16)]
        >>> area.reserve(specs, "device", torch.device("cpu"))  # newly reserved
        True
        >>> area.reserve(specs, "device", torch.device("cpu"))  # kept
        False
        >>> staged = area.fill({"a": torch.ones(2, 3), "b": torch.zeros(4, dtype=torch.bfloat16)})
        >>> [(n, tuple(t.shape)) for n, t in staged], area.nbytes
        ([('a', (2, 3)), ('b', (4,))], 512)
    """

    def __init__(self):
        self.place: StagingPlace | None = None
        self.key: tuple | None = None
        self.buffer: torch.Tensor | None = None
        self.views: dict[str, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        """Bytes reserved (0: none)."""
        return 0 if self.buffer is None else self.buffer.numel()

    def device_bytes(self) -> int:
        """Bytes reserved on the GPU (what a new reservation there may reuse)."""
        return self.nbytes if self.place == "device" else 0

    def reserve(
        self,
        specs: Sequence[tuple[str, tuple, torch.dtype]],
        place: StagingPlace,
        device: torch.device,
    ) -> bool:
        """Hold a buffer for ``specs`` (name, shape, dtype) in ``place`` (``device``: on
        ``device``; ``pinned``: page-locked host memory); True when it was (re)allocated,
        False when the one held already fits this layout."""
        key = (tuple((n, tuple(s), d) for n, s, d in specs), place, device)
        if key == self.key:
            return False
        self.release()  # the old layout's buffer goes first: never two at once
        sizes = [_aligned(torch.Size(s).numel() * d.itemsize) for _, s, d in specs]
        on = device if place == "device" else torch.device("cpu")
        buffer = torch.empty(sum(sizes), dtype=torch.uint8, device=on, pin_memory=place == "pinned")
        views, offset = {}, 0
        for (name, shape, dtype), size in zip(specs, sizes, strict=True):
            n = torch.Size(shape).numel() * dtype.itemsize
            views[name] = buffer[offset : offset + n].view(dtype).view(shape)
            offset += size
        self.buffer, self.views, self.place, self.key = buffer, views, place, key
        return True

    def fill(
        self,
        tensors: Mapping[str, torch.Tensor],
        non_blocking: bool = False,
        slices: Mapping[str, Sequence[View]] | None = None,
    ) -> list[tuple[str, torch.Tensor]]:
        """Copy ``tensors`` into their reserved views (one batched copy); the staged views.
        ``slices``: of the tensors it names, only those views are copied (a worker's slice,
        :func:`~.slices.slice_reads`); the rest of their staged elements are left as they
        were, for a replay of the plan that reads only those views.

        Examples:
            >>> area = StagingArea()
            >>> _ = area.reserve([("w", (2, 4), torch.float32)], "device", torch.device("cpu"))
            >>> _ = area.fill({"w": torch.zeros(2, 4)})
            >>> columns = View(offset=0, size=(2, 2), stride=(4, 1))
            >>> staged = area.fill({"w": torch.ones(2, 4)}, slices={"w": [columns]})
            >>> staged[0][1].tolist()
            [[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]]
        """
        names = list(tensors)
        slices = slices or {}
        dsts, srcs = [], []
        for n in names:
            if n in slices:
                dsts += [v.on(self.views[n]) for v in slices[n]]
                srcs += [v.on(tensors[n]) for v in slices[n]]
            else:
                dsts.append(self.views[n])
                srcs.append(tensors[n])
        if dsts:
            torch._foreach_copy_(dsts, srcs, non_blocking=non_blocking)
        return [(n, self.views[n]) for n in names]

    def release(self) -> None:
        """Drop the buffer (its memory is freed once no staged view is in use)."""
        self.buffer, self.views, self.place, self.key = None, {}, None, None

"""Where a GPU worker stages an incoming version before its pause: on the device when the
GPU has room beside vLLM's share, else in pinned host memory (a DMA copy in the pause,
~20 ms per GB, instead of a device copy, ~1 ms). Plain functions: the worker asks
``torch.cuda.mem_get_info`` and follows :func:`staging_place`.

vLLM takes ``gpu_memory_utilization`` of the GPU at start (weights, activations, KV
cache); staging buffers come out of the rest, which a colocated trainer also uses. So a
worker stages on the device only if the GPU keeps :func:`headroom` free afterwards, and
keeps its staging buffers from push to push (allocated once: the memory is reserved,
not re-taken at every push). The report says where each replica staged.
"""

from __future__ import annotations

from typing import Literal

Place = Literal["device", "pinned"]

GIB = 1 << 30


def headroom(total_bytes: int) -> int:
    """GPU memory a staging buffer must leave free: 1 GiB or 5% of the GPU, the larger."""
    return max(GIB, total_bytes // 20)


def staging_place(nbytes: int, free_bytes: int, total_bytes: int, held_bytes: int = 0) -> Place:
    """``device`` if ``nbytes`` of staging fit on the GPU with :func:`headroom` to spare
    (``held_bytes``: staging buffers this worker holds already, reused), else ``pinned``.

    Examples:
        >>> staging_place(1_200_000_000, free_bytes=8 * GIB, total_bytes=80 * GIB)
        'device'
        >>> staging_place(1_200_000_000, free_bytes=4 * GIB, total_bytes=80 * GIB)
        'pinned'
        >>> staging_place(1_200_000_000, 4 * GIB, 80 * GIB, held_bytes=1_200_000_000)
        'device'
    """
    need = max(0, nbytes - held_bytes)
    return "device" if need + headroom(total_bytes) <= free_bytes else "pinned"

"""GPUs by identity: a GPU compares by its UUID only, since Ray renumbers the GPUs each
process sees. The plan of ``auto`` (:mod:`..auto.plan`), the CUDA IPC handles
(:mod:`..ipc.handles`) and the workers' device report use these; only
:func:`device_uuid` and :func:`local_device_index` need CUDA."""

from __future__ import annotations

import re
import uuid

import torch

from torchrl_vllm_ext.errors import WeightSyncError

_HEX32 = re.compile(r"[0-9a-f]{32}")


def normalise_uuid(raw) -> str | None:
    """A GPU's UUID as one canonical string; None when unknown.

    nvidia-smi and NVML write ``GPU-8f6c1a2e-...``, torch's device properties give a
    bare UUID (or its object), CUDA_VISIBLE_DEVICES may hold either; MIG slices stay
    ``mig-...`` (they are not whole GPUs: see :func:`is_mig`).

    Examples:
        >>> normalise_uuid("GPU-8F6C1A2E-0000-1111-2222-333344445555")
        '8f6c1a2e-0000-1111-2222-333344445555'
        >>> normalise_uuid("8f6c1a2e000011112222333344445555")
        '8f6c1a2e-0000-1111-2222-333344445555'
        >>> normalise_uuid("MIG-4b2d1c3a-aaaa-bbbb-cccc-ddddeeeeffff")
        'mig-4b2d1c3a-aaaa-bbbb-cccc-ddddeeeeffff'
        >>> normalise_uuid(None), normalise_uuid("")
        (None, None)
    """
    if raw is None:
        return None
    text = str(raw).strip().lower()
    if not text:
        return None
    if text.startswith("mig-"):
        return text
    text = text.removeprefix("gpu-")
    hexed = text.replace("-", "")
    if not _HEX32.fullmatch(hexed):
        return None
    return str(uuid.UUID(hexed))


def is_mig(device: str | None) -> bool:
    """Whether a normalised device is a MIG slice (no CUDA IPC or NCCL across slices)."""
    return device is not None and device.startswith("mig-")


def device_uuid(index: int) -> str | None:
    """The normalised UUID of this process's CUDA device ``index`` (``mig-...`` for a MIG
    slice: torch gives its UUID bare, and its name says what it is, "... MIG 1g.10gb")."""
    props = torch.cuda.get_device_properties(index)
    gpu = normalise_uuid(props.uuid)
    if gpu is not None and not is_mig(gpu) and " MIG " in f" {props.name} ":
        return f"mig-{gpu}"
    return gpu


def local_device_index(gpu: str) -> int:
    """This process's number for the GPU ``gpu`` (normalised UUID); raises if it sees none."""
    for index in range(torch.cuda.device_count()):
        if device_uuid(index) == gpu:
            return index
    raise WeightSyncError(
        f"this worker sees no GPU {gpu} (its devices: "
        f"{[device_uuid(i) for i in range(torch.cuda.device_count())]}); CUDA IPC needs the "
        "trainer and the worker on one GPU. Use transport='auto', which plans by device."
    )

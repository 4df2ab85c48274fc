"""Trainer weights in, validated named tensors out; checksums; the expected parameter set.

Everything a push must reject is rejected here, before any replica is touched:
missing, extra, wrongly shaped or non-finite parameters.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

from torchrl_vllm_ext.errors import WeightSyncError
from torchrl_vllm_ext.weight_sync.specs import TensorSpec

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}
# safetensors header names -> torch names
_SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise WeightSyncError(
            f"dtype {name!r} is not supported; use one of {sorted(_DTYPES)}."
        ) from None


def checksum(t: torch.Tensor) -> int:
    """Sum of the tensor's bytes as little-endian uint64 words (tail bytes zero-padded), plus
    its byte count, mod 2**64: :func:`device_checksums` of one tensor. A host tensor is summed
    by numpy in the calling thread (torch's would wake an OpenMP team, which then spins beside
    the engine in a replica's process: the storage slot's checksum runs there).

    Fast (memory bandwidth) and order-sensitive enough to catch torn or stale
    data; it is an integrity check, not a cryptographic one.

    Examples:
        >>> t = torch.arange(11, dtype=torch.uint8)
        >>> checksum(t) == device_checksums([t])[0]
        True
    """
    if t.device.type != "cpu":
        return device_checksums([t])[0]
    raw = t.detach().contiguous().view(-1).view(torch.uint8).numpy()
    words = raw[: raw.size - raw.size % 8].view(np.uint64)
    total = int(words.sum(dtype=np.uint64))
    if raw.size % 8:
        tail = np.zeros(8, dtype=np.uint8)
        tail[: raw.size % 8] = raw[raw.size - raw.size % 8 :]
        total += int(tail.view(np.uint64)[0])
    return (total + raw.size) % (1 << 64)


def device_checksums(tensors: Sequence[torch.Tensor]) -> list[int]:
    """The checksum of each tensor, each summed where it lives, read back with one host
    sync per device (not one per tensor: a push's buckets or tensors are checked at
    memory speed).

    The words are summed as int64: two's-complement sums wrap like uint64 ones, so the
    result mod 2**64 is the same.

    Examples:
        >>> ts = [torch.arange(11, dtype=torch.uint8), torch.ones(3)]
        >>> device_checksums(ts) == [checksum(t) for t in ts]
        True
    """
    totals, sizes = [], []
    for t in tensors:
        raw = t.detach().contiguous().view(-1).view(torch.uint8)
        n = raw.numel()
        whole = n - n % 8
        total = (
            raw[:whole].view(torch.int64).sum() if whole else raw.new_zeros((), dtype=torch.int64)
        )
        if n % 8:
            tail = torch.zeros(8, dtype=torch.uint8, device=raw.device)
            tail[: n % 8] = raw[whole:]
            total = total + tail.view(torch.int64)[0]
        totals.append(total)
        sizes.append(n)
    out: list[int] = [0] * len(totals)
    for indices in _by_device(totals).values():
        values = torch.stack([totals[i] for i in indices]).tolist()
        for i, v in zip(indices, values, strict=True):
            out[i] = (int(v) + sizes[i]) % (1 << 64)
    return out


def _by_device(tensors: Sequence[torch.Tensor]) -> dict[torch.device, list[int]]:
    groups: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.device, []).append(i)
    return groups


def expected_specs(model_dir: str | Path) -> dict[str, TensorSpec]:
    """The parameters a checkpoint holds (names, dtypes, shapes), read from safetensors headers."""
    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise WeightSyncError(
            f"no *.safetensors in {model_dir}; the weight sync reads the expected parameters "
            "from the checkpoint the replicas serve."
        )
    specs = {}
    for f in files:
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            specs[name] = TensorSpec(
                name=name,
                dtype=_SAFETENSORS_DTYPES.get(meta["dtype"], meta["dtype"]),
                shape=tuple(meta["shape"]),
            )
    return specs


def named_tensors(weights) -> dict[str, torch.Tensor]:
    """Flatten an ``nn.Module``, a state dict or a TensorDict into {HF name: tensor}."""
    if isinstance(weights, nn.Module):
        return {k: v.detach() for k, v in weights.state_dict().items()}
    try:
        from tensordict import TensorDictBase

        if isinstance(weights, TensorDictBase):
            return {
                k: v.detach()
                for k, v in weights.flatten_keys(".").items(include_nested=True, leaves_only=True)
            }
    except ImportError:  # tensordict is a dependency; keep the module importable without it
        pass
    if isinstance(weights, Mapping):
        out = {}
        for k, v in weights.items():
            if not isinstance(v, torch.Tensor):
                raise WeightSyncError(
                    f"weights[{k!r}] is a {type(v).__name__}, not a tensor; pass a state dict of tensors."
                )
            out[str(k)] = v.detach()
        return out
    raise WeightSyncError(
        f"weights of type {type(weights).__name__} are not supported; pass an nn.Module, a state "
        "dict or a TensorDict keyed by Hugging Face parameter names."
    )


def validate(
    weights: dict[str, torch.Tensor],
    expected: dict[str, TensorSpec],
    check_finite: bool = True,
    optional: frozenset[str] = frozenset(),
) -> dict[str, torch.Tensor]:
    """Check names, shapes and finiteness; return the tensors to send, in the checkpoint's order.

    ``check_finite=False`` leaves :func:`require_finite` to the caller (the storage
    writer runs it in its copy pass). ``optional``: checkpoint tensors the push may
    leave out (no parameter of the architecture holds them; the engine skips them).

    Names that the checkpoint lacks are dropped only when they alias a tensor that is
    sent, or are the LM head of a checkpoint that stores none (tied embeddings).
    """
    expected = {n: s for n, s in expected.items() if n in weights or n not in optional}
    missing = [n for n in expected if n not in weights]
    if missing:
        raise WeightSyncError(
            f"parameter {missing[0]!r} is missing from the pushed weights ({len(missing)} missing); "
            "push the full model with Hugging Face names (model.state_dict())."
        )
    sent_ptrs = {weights[n].untyped_storage().data_ptr() for n in expected}
    for name, t in weights.items():
        # A checkpoint without an LM head ties it to the input embedding (whatever that
        # is named: model.embed_tokens, transformer.wte, model.decoder.embed_tokens):
        # the pushed head may be its own copy (a gathered FSDP state dict, a clone).
        tied = name == "lm_head.weight" and name not in expected
        if name not in expected and not tied and t.untyped_storage().data_ptr() not in sent_ptrs:
            raise WeightSyncError(
                f"parameter {name!r} is not in the served checkpoint; check the parameter names "
                f"(e.g. {next(iter(expected))!r}) match the model the replicas serve."
            )
    out = {}
    for name, spec in expected.items():
        t = weights[name]
        if tuple(t.shape) != spec.shape:
            raise WeightSyncError(
                f"parameter {name!r} has shape {tuple(t.shape)} but the served model expects "
                f"{spec.shape}; push weights of the same architecture."
            )
        if t.dtype not in _DTYPES.values():
            raise WeightSyncError(f"parameter {name!r} has dtype {t.dtype}; use a floating dtype.")
        out[name] = t
    if check_finite:
        require_all_finite(out)
    return out


def require_finite(name: str, t: torch.Tensor) -> None:
    """Raise :class:`WeightSyncError` naming ``name`` if ``t`` holds NaN or inf."""
    # min and max are finite iff every element is (NaN propagates): one reduction pass,
    # no boolean mask of the whole tensor to materialise as isfinite would.
    if t.numel() and not bool(torch.isfinite(torch.stack(torch.aminmax(t))).all()):
        raise WeightSyncError(
            f"parameter {name!r} contains NaN or inf; the push was rejected and the replicas "
            "keep their weights. Check the training step that produced it."
        )


def require_all_finite(tensors: Mapping[str, torch.Tensor]) -> None:
    """:func:`require_finite` of every tensor as batched reductions: one min/max per tensor
    where it lives and one host sync per device (a GPU push is not synchronised once per
    tensor); the error names the first tensor, in order, that holds NaN or inf.

    Examples:
        >>> require_all_finite({"a": torch.ones(2), "b": torch.zeros(3)})
        >>> require_all_finite({"a": torch.ones(2), "b": torch.tensor([1.0, float("nan")])})
        Traceback (most recent call last):
        ...
        torchrl_vllm_ext.errors.WeightSyncError: parameter 'b' contains NaN or inf; ...
    """
    names = [n for n, t in tensors.items() if t.numel()]
    # min and max are finite iff every element is (NaN propagates)
    flags = [torch.isfinite(torch.stack(torch.aminmax(tensors[n]))).all() for n in names]
    bad: set[str] = set()
    for indices in _by_device(flags).values():
        ok = torch.stack([flags[i] for i in indices])
        if not bool(ok.all()):
            bad.update(names[i] for i, good in zip(indices, ok.tolist(), strict=True) if not good)
    for name in names:
        if name in bad:
            require_finite(name, tensors[name])  # raises, naming it

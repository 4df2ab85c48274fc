"""AdapterSync: push a trainer's LoRA adapter, not its weights, as a new adapter version.

RL with LoRA trains a small adapter over a frozen base: a push is the adapter's tensors
(a few percent of the model's bytes), which vLLM loads beside the base without a pause.

1. pack and validate: the adapter's tensors are copied (one batched copy) into a free
   slot of anonymous shared memory this object keeps (one slot per live version and one
   for the push; no file); their names (PEFT's), rank and target modules must match the
   first push (the replicas' LoRA slots are sized once) and every value must be finite;
   otherwise :class:`~torchrl_vllm_ext.errors.WeightSyncError`, and nothing was sent;
2. make room: every live version stays pinned in each replica's LoRA cache (vLLM's
   ``max_cpu_loras``, ``max_loras`` when unset); when the new version would not fit, the
   oldest versions this push would retire anyway are retired first;
3. ``service.add_lora_tensors(f"{name}@{version}", packed, version=version)``: every
   replica on this node reads the slot directly, any other reads one copy put into Ray's
   object store; every replica's workers build the
   adapter from them (no file is written, on any node; no pause: running requests keep
   the version they started with), and each replica, in the same call, labels its
   weight version ``version`` (what samples carry as ``("vllm", "weight_version")``);
4. keep the last ``keep`` versions live (K = the collector's staleness bound + 1) and
   retire older ones from the replicas in the background (awaited at the next push, so
   a failure surfaces; a replica unloads a version once its batches using it ended).

``current`` is the newest version's adapter name: ``VLLMPolicy(service, lora=sync)``
samples with it.
"""

from __future__ import annotations

import itertools
import logging
import time
import warnings
import weakref
from collections import deque
from dataclasses import dataclass, field

import torch

from torchrl_vllm_ext.engine.adapters import AdapterPacker, AdapterTensors, adapter_capacity
from torchrl_vllm_ext.engine.driver.service import VLLMService
from torchrl_vllm_ext.errors import WeightSyncError
from torchrl_vllm_ext.weight_sync.sources import adapter_source
from torchrl_vllm_ext.weight_sync.torchrl.pushes import TorchRLPushes

logger = logging.getLogger(__name__)


@dataclass
class AdapterReport:
    """What one adapter push did."""

    version: str
    lora_name: str
    """The adapter name requests use for this version."""
    nbytes: int
    seconds: float
    retired: list[str]
    """Versions taken off the replicas by this push."""
    phases: dict[str, float]
    """Seconds per step: ``validate`` (packing included), ``make_room`` (versions retired
    before the load, when the replicas' LoRA cache is full), ``load`` (every replica's
    workers build the adapter, and the label), ``retire`` (scheduling the background
    retirement)."""
    pause_s: dict[int, float] = field(default_factory=dict)
    """Generation pauses per replica: none (vLLM loads an adapter while serving); the
    field mirrors ``SyncReport``."""


def adapter_tensors(adapter, owners: dict | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """``(tensors, config)`` of a PEFT model's active adapter, as ``save_pretrained`` writes them.

    ``adapter`` is a ``peft.PeftModel``, or a ``(state_dict, config)`` pair where the
    state dict has PEFT's saved names and the config is a ``LoraConfig`` or its dict.
    ``owners`` (saved name -> the module holding it and its attribute name, from
    :func:`parameter_owners`) skips PEFT's state-dict walk on later pushes of the same model.
    """
    if isinstance(adapter, tuple):
        tensors, config = adapter
        config = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        return dict(tensors), config
    name = getattr(adapter, "active_adapter", "default")
    config = adapter.peft_config[name].to_dict()
    if owners is not None:
        try:  # each from its module: resolving its path from the model each push is slow
            return {saved: getattr(m, attr) for saved, (m, attr) in owners.items()}, config
        except AttributeError:  # a parameter was deleted: PEFT's walk below
            pass
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(adapter, adapter_name=name), config


def parameter_owners(adapter, tensors: dict[str, torch.Tensor]) -> dict | None:
    """Saved name -> ``(module, attribute name)`` of the parameter it is, when every saved
    tensor is a parameter (else None)."""
    if isinstance(adapter, tuple):
        return None
    by_storage = {
        p.data_ptr(): (module, attr)
        for module in adapter.modules()
        for attr, p in module.named_parameters(recurse=False)
    }
    owners = {k: by_storage.get(t.data_ptr()) for k, t in tensors.items()}
    return owners if all(owners.values()) else None


def _spec(tensors: dict[str, torch.Tensor], config: dict) -> dict:
    targets = config.get("target_modules")
    return {
        "r": config.get("r"),
        "target_modules": sorted(targets) if isinstance(targets, list | set | tuple) else targets,
        "tensors": {k: (tuple(t.shape), t.dtype) for k, t in tensors.items()},
    }


def check_adapter(
    tensors: dict[str, torch.Tensor],
    config: dict,
    expected: dict | None,
    max_rank,
    flat: torch.Tensor | None = None,
) -> dict:
    """Raise :class:`WeightSyncError` naming what is wrong with this adapter push; else
    return its spec (what later pushes must match). ``flat``: every value of ``tensors``
    in one 1-D tensor (and zeros), when there is one (:meth:`AdapterPacker.flat`)."""
    spec = _spec(tensors, config)
    if max_rank is not None and spec["r"] is not None and spec["r"] > max_rank:
        raise WeightSyncError(
            f"adapter rank r={spec['r']} exceeds the replicas' max_lora_rank={max_rank}; "
            "launch the service with a larger max_lora_rank or train a smaller adapter."
        )
    if expected is not None:
        for field in ("r", "target_modules"):
            if spec[field] != expected[field]:
                raise WeightSyncError(
                    f"adapter {field}={spec[field]!r} differs from the first push's "
                    f"{expected[field]!r}; push adapters of one LoRA config (or a new AdapterSync)."
                )
        if spec["tensors"] != expected["tensors"]:  # the usual push: one comparison
            _check_same_tensors(spec["tensors"], expected["tensors"])
    if not _surely_finite(tensors, flat):
        for key, t in tensors.items():
            if not torch.isfinite(t).all():
                raise WeightSyncError(f"adapter tensor {key} holds NaN or inf; nothing was pushed.")
    return spec


def _check_same_tensors(got: dict, expected: dict) -> None:
    """Raise :class:`WeightSyncError` naming how ``got`` (name -> (shape, dtype)) differs
    from the first push's ``expected``."""
    missing = sorted(set(expected) - set(got))
    extra = sorted(set(got) - set(expected))
    if missing or extra:
        raise WeightSyncError(
            f"adapter tensors differ from the first push: missing {missing[:3]}, "
            f"extra {extra[:3]}; push the same PEFT model's adapter."
        )
    for key, (shape, dtype) in got.items():
        if (shape, dtype) != expected[key]:
            raise WeightSyncError(
                f"adapter tensor {key} is {list(shape)} {dtype}, the first push had "
                f"{list(expected[key][0])} {expected[key][1]}."
            )


def _surely_finite(tensors: dict[str, torch.Tensor], flat: torch.Tensor | None) -> bool:
    """True when every value is finite, by one reduction: a NaN or inf makes a sum (or a
    norm) non-finite; False may also be an overflow of finite values (the caller then
    checks each tensor, to name the culprit)."""
    if flat is not None:  # one sum over one buffer: cheaper than a norm per tensor
        return bool(torch.isfinite(flat.sum()))
    if not tensors:
        return True
    return bool(torch.isfinite(torch.stack(torch._foreach_norm(list(tensors.values())))).all())


class AdapterSync:
    """Push LoRA adapter versions to every replica of ``service`` (launched with
    ``enable_lora=True``); see the module docstring.

    Args:
        service: the :class:`~torchrl_vllm_ext.VLLMService`.
        name: adapter name prefix; version ``v`` is served as ``f"{name}@{v}"``.
        keep: versions kept live (the staleness bound + 1); at most the replicas' LoRA
            cache (``max_cpu_loras``, or ``max_loras`` when unset).
        storage_dir: deprecated and ignored: pushes write no file.
        shared: deprecated and ignored: replicas on every node get the tensors through
            Ray's object store.
    """

    transport = "adapter"
    """What a push moves (the GRPO job reports it like a scheme's transport)."""

    def __init__(
        self,
        service,
        name: str = "policy",
        *,
        keep: int = 2,
        storage_dir=None,
        shared: bool = False,
    ):
        if keep < 1:
            raise WeightSyncError(f"keep={keep} must be >= 1 (the newest version is live).")
        capacity = adapter_capacity(service.config.engine_kwargs)
        if keep > capacity:
            raise WeightSyncError(
                f"keep={keep} adapter versions do not fit the replicas' LoRA cache of "
                f"{capacity} (max_cpu_loras, or max_loras when unset): launch the service "
                f"with max_cpu_loras>={keep + 1} (a push then never retires early), or "
                f"keep<={capacity}."
            )
        if storage_dir is not None or shared:
            warnings.warn(
                "AdapterSync(storage_dir=..., shared=...) is ignored: adapter pushes write "
                "no file and reach replicas on every node through Ray's object store; drop "
                "both arguments.",
                DeprecationWarning,
                stacklevel=2,
            )
        self.service, self.name, self.keep, self.capacity = service, name, keep, capacity
        self._live: deque[str] = deque()  # versions, oldest first
        self._spec: dict | None = None
        self._owners: tuple[weakref.ref, dict | None] | None = None  # (model, its owners)
        # One slot per live version and one for the push: replicas (a restarted one
        # too) read a live version's slot, which no push writes until it is retired.
        self._packer = AdapterPacker(slots=keep + 1)
        self._slots: dict[str, int] = {}  # live version -> its packer slot
        # A service takes the packed tensors and the label in one call per replica; a
        # stand-in with only add_lora_tensors(name, tensors, config) gets two calls.
        self._one_call = isinstance(service, VLLMService)
        self._retiring = None  # the last push's retirement (a future on the service loop)
        self.version: str | None = None
        self.torchrl = TorchRLPushes(self.push, lambda: self.service.weight_version)
        """Pushes from TorchRL's collectors (``WeightSyncUpdater``), versioned in one place."""

    @property
    def current(self) -> str | None:
        """The newest version's adapter name (None before the first push)."""
        return None if self.version is None else self.lora_name(self.version)

    def lora_name(self, version) -> str:
        return f"{self.name}@{version}"

    @property
    def live_versions(self) -> list[str]:
        return list(self._live)

    def push(self, adapter, version) -> AdapterReport:
        """Validate, make room, load ``adapter`` as ``version`` on every replica, retire;
        see the module doc."""
        start = time.perf_counter()
        version = str(version)
        if version in self._live:
            raise WeightSyncError(f"adapter version {version!r} is already live; push a new one.")
        self._wait_retired()
        slot = min(set(range(self.keep + 1)) - {self._slots[v] for v in self._live})
        tensors, config, packed, spec = self._validated(adapter, slot)
        marks = [time.perf_counter()]
        early = self._make_room()
        marks.append(time.perf_counter())
        # The replicas' weight version is the policy's: samples carry it as
        # ("vllm", "weight_version"), which staleness filters and the collector read.
        if self._one_call:  # each replica loads and labels in one call
            self.service.add_lora_tensors(self.lora_name(version), packed, version=version)
        else:
            tensors = {k: t.detach().to("cpu").contiguous() for k, t in tensors.items()}
            self.service.add_lora_tensors(self.lora_name(version), tensors, config)
            self.service.set_weight_version(version)
        marks.append(time.perf_counter())
        self._spec = self._spec or spec
        self._live.append(version)
        self.version = version
        retired = []
        while len(self._live) > self.keep:
            retired.append(self._live.popleft())
        self._slots = {v: self._slots.get(v, slot) for v in self._live}
        if retired:  # off the push's path: done while the trainer trains, awaited next push
            self._retiring = self.service.submit(self._retire(retired))
        marks.append(time.perf_counter())
        nbytes = sum(t.numel() * t.element_size() for t in self._packer.tensors.values())
        steps = [marks[0] - start] + [b - a for a, b in itertools.pairwise(marks)]
        phases = dict(zip(("validate", "make_room", "load", "retire"), steps, strict=True))
        report = AdapterReport(
            version, self.current, nbytes, time.perf_counter() - start, early + retired, phases
        )
        logger.debug(
            "pushed adapter %s: %.1f MB in %.3fs", self.current, nbytes / 1e6, report.seconds
        )
        return report

    def _validated(
        self, adapter, slot: int
    ) -> tuple[dict[str, torch.Tensor], dict, AdapterTensors, dict]:
        """``(tensors, config, packed, spec)`` of a push, or the typed error: the tensors
        are packed first (one batched copy into a free slot of the packer, nothing sent),
        then checked there (one reduction over the buffer for finiteness)."""
        adapter = adapter_source(adapter)
        if self._owners is not None and self._owners[0]() is adapter:
            tensors, config = adapter_tensors(adapter, self._owners[1])
        else:  # a model pushed for the first time: PEFT's walk, then its owners noted
            tensors, config = adapter_tensors(adapter)
            if not isinstance(adapter, tuple):
                self._owners = (weakref.ref(adapter), parameter_owners(adapter, tensors))
        packed = self._packer.pack(tensors, config, slot)
        max_rank = self.service.config.engine_kwargs.get("max_lora_rank", 16)
        spec = check_adapter(
            self._packer.tensors, config, self._spec, max_rank, self._packer.flat()
        )
        return tensors, config, packed, spec

    def _make_room(self) -> list[str]:
        """Retire the oldest live versions now when the new one would not fit the replicas'
        LoRA cache beside them (each would be retired by this push anyway; a push that
        then fails leaves them retired)."""
        early = []
        while self._live and len(self._live) + 1 > self.capacity:
            early.append(self._live.popleft())
        if early:
            self.service.run(self._retire(early))
        return early

    async def _retire(self, versions: list[str]) -> None:
        for version in versions:
            await self.service.aremove_lora(self.lora_name(version))

    def _wait_retired(self) -> None:
        if self._retiring is not None:
            future, self._retiring = self._retiring, None
            future.result()

    def close(self) -> None:
        """Retire every live version."""
        try:
            self._wait_retired()
        except Exception:
            logger.debug("retiring old adapter versions failed", exc_info=True)
        for version in list(self._live):
            try:
                self.service.remove_lora(self.lora_name(version))
            except Exception:  # the service may already be gone
                logger.debug("could not unload %s", self.lora_name(version), exc_info=True)
        self._live.clear()

    def __enter__(self) -> AdapterSync:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["AdapterReport", "AdapterSync", "adapter_tensors", "check_adapter"]

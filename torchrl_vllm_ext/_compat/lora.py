"""What a vLLM worker asks of vLLM's LoRA manager: an adapter built from tensors in memory.

vLLM loads an adapter from a directory only (``WorkerLoRAManager._load_adapter``: the
config from ``adapter_config.json``, the tensors from ``adapter_model.safetensors``, then
``LoRAModel.from_lora_tensors``). :func:`register_lora_from_tensors` takes the same steps from
tensors and a config already in memory, then registers the model as
``LRUCacheWorkerLoRAManager.add_adapter`` does, and pins it in the manager's cache:
vLLM's LRU must never evict it, since vLLM would reload an evicted adapter from its
``lora_path`` at the next step, and there is no file there.

No vLLM class is patched: every step is a public function or classmethod of vLLM's LoRA
package, called on the objects the worker already holds; the manager's cache
(``_adapter_manager``, ``_registered_adapters``) is the one private part, read here only.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import weakref

logger = logging.getLogger(__name__)

_MANAGER_CHECKS = (
    "_validate_moe_lora_format",
    "_validate_modules_to_save",
    "_validate_token_classification_lora",
)
"""The adapter manager's checks ``_load_adapter`` runs on a loaded model (those a vLLM
version has)."""


_accepted: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""A worker's LoRA manager -> the tensor names (and modules to save) of the last adapter
whose modules it accepted: the next version's same names are not parsed again (~1 ms for
a 336-tensor adapter)."""


def register_lora_from_tensors(worker, lora_id: int, tensors: dict, config: dict) -> None:
    """Build vLLM's ``LoRAModel`` of ``lora_id`` from ``tensors`` (PEFT's saved names) and
    ``config`` (PEFT's ``LoraConfig`` as a dict) and register it, pinned, with the
    worker's LoRA manager; a :class:`ValueError` naming what vLLM refuses."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    worker_manager = _lora_manager(worker)
    manager = worker_manager._adapter_manager
    peft = PEFTHelper.from_dict(
        {**config, "vllm_max_position_embeddings": worker_manager.max_position_embeddings}
    )
    peft.validate_legal(worker_manager.lora_config)
    model = manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    mapper = None if mapper is None else mapper.get_rename_mapper()
    skip = getattr(model, "lora_skip_prefixes", None)
    names = (frozenset(tensors), tuple(peft.modules_to_save or ()))
    if _accepted.get(manager) != names:  # a push of the same adapter: parsed once
        _check_modules(tensors, expected_modules(manager), peft, mapper, skip)
        _accepted[manager] = names
    kwargs = {
        "device": "cpu",
        "dtype": worker_manager.lora_config.lora_dtype,
        "model_vocab_size": worker_manager.vocab_size,
        "weights_mapper": mapper,
        "skip_prefixes": skip,
    }
    accepted = inspect.signature(LoRAModel.from_lora_tensors).parameters
    lora = LoRAModel.from_lora_tensors(
        lora_id, tensors, peft, **{k: v for k, v in kwargs.items() if k in accepted}
    )
    for name in _MANAGER_CHECKS:
        check = getattr(manager, name, None)
        if check is not None:
            check(lora)
    with _sync_allowed():
        _register_pinned(manager, lora)


def registered_lora_ids(worker) -> set[int]:
    """The ids of the adapters the worker's LoRA manager holds (an empty set without one)."""
    manager = getattr(worker.model_runner, "lora_manager", None)
    return set() if manager is None else set(manager.list_adapters())


def _lora_manager(worker):
    manager = getattr(worker.model_runner, "lora_manager", None)
    if manager is None:
        raise ValueError(
            "this vLLM worker has no LoRA manager: launch the service with enable_lora=True."
        )
    return manager


def expected_modules(manager) -> set[str]:
    """The module names an adapter may target (packed modules by their parts), as
    ``_load_adapter`` computes them."""
    expected: list[str] = []
    for module in manager.supported_lora_modules:
        expected.extend(manager.packed_modules_mapping.get(module, [module]))
        if module == "experts":
            expected.append(module)
    return set(expected)


def _check_modules(tensors, expected: set[str], peft, mapper, skip) -> None:
    """``from_local_checkpoint``'s check: every tensor targets a module the model adapts."""
    from vllm.lora.utils import is_base_embedding_weights, parse_fine_tuned_lora_name

    unexpected = []
    for name in tensors:
        if is_base_embedding_weights(name) or "base_layer" in name:
            continue
        if skip and any(f".{p}" in name or name.startswith(p) for p in skip):
            continue
        module, _ = parse_fine_tuned_lora_name(name, mapper)
        if ".experts" in module:
            if module[module.find(".experts") + 1 :] not in expected:
                unexpected.append(module)
        elif module.rsplit(".", 1)[-1] not in expected | set(peft.modules_to_save or ()):
            unexpected.append(module)
    if unexpected:
        raise ValueError(
            f"the adapter targets {sorted(unexpected)[:3]}, which the served model does not "
            f"adapt (it adapts {sorted(expected)}); train the adapter on those modules."
        )


def _register_pinned(manager, lora) -> None:
    """Add ``lora`` to the manager's cache (evicting the oldest unpinned adapter, which
    vLLM reloads from its directory when asked again, if the cache is full), activate it,
    and pin it."""
    if len(manager) + 1 > manager.capacity:
        try:
            manager.remove_oldest_adapter()
        except RuntimeError as e:  # every cached adapter is pinned: ours, from memory
            raise ValueError(
                f"the worker's {manager.capacity} LoRA cache slots (max_cpu_loras, or "
                "max_loras when unset) all hold adapters loaded from memory; remove one "
                "first, or launch the service with a larger max_cpu_loras."
            ) from e
    manager.add_adapter(lora)
    manager.activate_adapter(lora.id)
    manager._registered_adapters.pin(lora.id)


def _sync_allowed():
    """vLLM's guard against GPU syncs in its steps, lifted as ``add_adapter`` lifts it
    (vLLM versions without it: nothing to lift)."""
    try:
        from vllm.utils.gpu_sync_debug import gpu_sync_allowed
    except ImportError:
        return contextlib.nullcontext()
    return gpu_sync_allowed()


__all__ = ["expected_modules", "register_lora_from_tensors", "registered_lora_ids"]

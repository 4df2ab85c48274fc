"""What makes a :class:`~torchrl_vllm_ext.VLLMService` pass where TorchRL expects its own
engines.

* TorchRL's ``vLLMWrapper`` takes a vLLM ``LLM``, its ``AsyncVLLM`` (by class name) or a
  Ray actor (anything with ``generate`` and ``remote``, called as
  ``ray.get(model.generate.remote(...))``): :func:`actor_style` gives the service's
  ``generate`` a ``.remote``.
* TorchRL's ``vLLMUpdaterV2`` takes an ``RLvLLMEngine`` (an ABC): :func:`register_engine`
  registers the service as one. Importing TorchRL's module costs seconds (it imports
  vLLM), so the service registers in the background while its replicas start, and at
  once if TorchRL's module is already loaded.
"""

from __future__ import annotations

import functools
import importlib
import logging
import sys
from collections.abc import Callable

import ray

from torchrl_vllm_ext.errors import InvalidRequestError

logger = logging.getLogger(__name__)

RL_ENGINE_MODULE = "torchrl.modules.llm.backends.vllm.base"


class _ActorStyleMethod:
    """A bound method that is also callable as ``method.remote(...)`` (an ``ObjectRef``)."""

    def __init__(self, bound: Callable):
        self._bound = bound
        functools.update_wrapper(self, bound)

    def __call__(self, *args, **kwargs):
        return self._bound(*args, **kwargs)

    def remote(self, *args, **kwargs) -> ray.ObjectRef:
        """Run the call now, in this process; its result in Ray's object store."""
        return ray.put(self._bound(*args, **kwargs))


class actor_style:
    """Method decorator: ``obj.method(...)`` as before, and ``obj.method.remote(...)``
    returns a Ray ``ObjectRef`` of the result, as a Ray actor's method would.

    Examples:
        >>> class Engine:
        ...     @actor_style
        ...     def double(self, x):
        ...         return 2 * x
        >>> Engine().double(3)
        6
        >>> callable(Engine().double.remote)
        True
    """

    def __init__(self, fn: Callable):
        self._fn = fn
        functools.update_wrapper(self, fn)

    def __get__(self, obj, objtype=None):
        if obj is None:
            return self
        return _ActorStyleMethod(self._fn.__get__(obj, objtype))


def lora_name(lora: str | None, lora_request) -> str | None:
    """The adapter a ``generate`` call names: ``lora`` or vLLM's ``LoRARequest.lora_name``.

    Examples:
        >>> lora_name("policy", None), lora_name(None, None)
        ('policy', None)
    """
    if lora_request is None:
        return lora
    if isinstance(lora_request, list | tuple):
        names = {getattr(r, "lora_name", None) for r in lora_request}
        if len(names) != 1:
            raise InvalidRequestError(
                f"lora_request names {len(names)} adapters ({sorted(map(str, names))}); one "
                "service call uses one adapter: split the batch by adapter."
            )
        lora_request = lora_request[0]
    name = getattr(lora_request, "lora_name", None)
    if not isinstance(name, str):
        raise InvalidRequestError(
            f"lora_request={lora_request!r} is not a vllm LoRARequest; pass lora='name' of an "
            "adapter added with add_lora()."
        )
    if lora is not None and lora != name:
        raise InvalidRequestError(
            f"lora={lora!r} and lora_request (lora_name={name!r}) disagree; pass one of them."
        )
    return name


def register_engine(cls: type) -> bool:
    """Register ``cls`` as TorchRL's ``RLvLLMEngine`` (imports TorchRL's module); True once done."""
    try:
        base = importlib.import_module(RL_ENGINE_MODULE).RLvLLMEngine
    except ImportError as e:  # TorchRL without its LLM modules: nothing to plug into
        logger.debug("TorchRL's RLvLLMEngine is not importable (%s); not registered", e)
        return False
    base.register(cls)
    return True


def register_engine_if_loaded(cls: type) -> None:
    """Register ``cls`` now if TorchRL's engine module is loaded (costs nothing then)."""
    if RL_ENGINE_MODULE in sys.modules:
        register_engine(cls)


__all__ = ["actor_style", "lora_name", "register_engine", "register_engine_if_loaded"]

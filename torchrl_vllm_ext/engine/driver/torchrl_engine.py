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
* TorchRL's code and tests call ``AsyncVLLM``'s engine methods (``get_tp_size``,
  ``get_master_port``, ``update_weights``, ``engine_args``, ...):
  :class:`TorchRLEngine` holds them (a part of the service). Weight calls go through a
  ``WeightSyncScheme`` the service makes on first use (named by path: the engine layer
  knows no transport).
"""

from __future__ import annotations

import functools
import importlib
import logging
import sys
from collections.abc import Callable
from typing import Any

import ray

from torchrl_vllm_ext._compat import vllm_engine_api
from torchrl_vllm_ext.batches import RequestBatch
from torchrl_vllm_ext.engine.outputs import to_request_output
from torchrl_vllm_ext.engine.replica.torchrl_calls import refuse_v1_updater
from torchrl_vllm_ext.errors import ConfigurationError, InvalidRequestError
from torchrl_vllm_ext.extensions import load_class

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


class TorchRLEngine:
    """TorchRL's ``RLvLLMEngine`` / ``AsyncVLLM`` engine calls of a service, so that
    ``vLLMUpdaterV2(service)`` pushes through a verified, versioned scheme and TorchRL's
    code and tests find what they read. A part of the service, which exposes each call
    under its name (the weight calls are the owner's; a handle forwards them).

    Args:
        service: the service (its ``config``, its reserved port, ``cls(service)`` of its
            ``engine_updates_cls``).
    """

    def __init__(self, service):
        self.service = service
        self.updates = None  # the engine_updates_cls instance, made on first use
        self._engine_args = None

    @property
    def engine_args(self):
        """The replicas' ``vllm.AsyncEngineArgs`` (TorchRL's ``AsyncVLLM.engine_args``)."""
        if self._engine_args is None:
            cfg = self.service.config
            self._engine_args = vllm_engine_api().AsyncEngineArgs(
                model=cfg.model,
                tensor_parallel_size=cfg.tensor_parallel_size,
                pipeline_parallel_size=cfg.pipeline_parallel_size,
                **cfg.engine_kwargs,
            )
        return self._engine_args

    def get_tp_size(self) -> int:
        """Tensor-parallel size of each replica."""
        return self.service.config.tensor_parallel_size

    def get_model_metadata(self) -> dict[str, tuple[Any, Any]]:
        """``{name: (torch dtype, torch.Size)}`` of every tensor of the served checkpoint:
        what a push must provide (tied LM heads are not in it)."""
        return self._updates().metadata()

    def get_master_address(self) -> str:
        """This host's address, where a broadcast push's group has rank 0."""
        return self._updates().master_address()

    def get_master_port(self) -> int:
        """The broadcast group's port once :meth:`init_weight_update_group` formed it;
        before that (and with the storage transport) a port the service reserved at launch
        and holds until it shuts down."""
        group_port = self.updates.master_port() if self.updates is not None else 0
        return group_port or self.service.reserved_port

    def init_weight_update_group(self) -> None:
        """Make the scheme TorchRL's pushes go through and, for a broadcast, form its group
        now (the first push then does not)."""
        self._updates().connect()

    def update_weights(self, weights) -> None:
        """Push an iterator of ``(name, tensor)`` (the whole model, Hugging Face names) into
        every replica as the next integer version, verified and versioned like any
        :class:`~torchrl_vllm_ext.WeightSyncScheme` push; blocks until every replica
        serves it. A partial iterator is refused (the replicas serve one whole version).
        From a handle, the tensors travel to the owner, which pushes."""
        self._updates().update(weights)

    def remote(self, method: str, *args, **kwargs) -> ray.ObjectRef:
        """Ray-actor style call: a Ray ``ObjectRef`` of ``getattr(svc, method)(*args, **kwargs)``
        (run now, in this process). With ``generate.remote``, what makes the service pass
        for a Ray actor where TorchRL expects one (``vLLMWrapper``)."""
        return ray.put(getattr(self.service, method)(*args, **kwargs))

    def collective_rpc(
        self, method: str, timeout: float | None = None, args: tuple = (), kwargs=None
    ) -> None:
        """``AsyncVLLM.collective_rpc`` (and a vLLM Ray actor's), refused at once, before
        anything reaches a replica.

        TorchRL's ``vLLMUpdater`` (V1) takes the policy's ``.model`` (the service, for
        ``vLLMWrapper(service)``) for a Ray actor and calls
        ``collective_rpc.remote("init_weight_update_group", ...)`` just before its trainer
        blocks in the NCCL rendezvous: raising here is what reaches that trainer in
        seconds (a replica's refusal would be read only after the rendezvous' 300-s store
        timeout). Any other worker call goes to a replica's actor (:attr:`actors`).
        The service's form is :func:`actor_style`: ``.remote(...)`` is refused the same way.
        """
        refuse_v1_updater(method, f"service {self.service.name}")
        raise ConfigurationError(
            f"service {self.service.name}: collective_rpc({method!r}) is not offered on the "
            "service; call it on each replica: ray.get([a.collective_rpc_v1.remote(method, "
            "timeout, args, kwargs) for a in service.actors])."
        )

    def _updates(self):
        if self.updates is None:
            name = self.service.config.engine_updates_cls
            if name is None:
                raise ConfigurationError(
                    "this service was launched with engine_updates_cls=None: TorchRL's "
                    "engine weight calls are off; push with a WeightSyncScheme instead."
                )
            self.updates = load_class(name)(self.service)
        return self.updates

    def close(self) -> None:
        if self.updates is not None:
            self.updates.close()


ENGINE_CALLS = ["engine_args", "get_tp_size", "remote", "collective_rpc"]
"""The :class:`TorchRLEngine` calls any side runs."""
OWNER_ENGINE_CALLS = [
    "get_model_metadata",
    "get_master_address",
    "get_master_port",
    "init_weight_update_group",
    "update_weights",
]
"""The :class:`TorchRLEngine` calls a handle forwards to the owner."""


def from_pretrained_kwargs(
    num_devices: int | None = None,
    verbose: bool = True,
    compile: bool = True,
    enable_fp32_output: bool = False,
    **kwargs: Any,
) -> dict[str, Any]:
    """``AsyncVLLM.from_pretrained``'s keywords as :meth:`VLLMService.launch` takes them:
    ``num_devices`` is each replica's tensor-parallel size; ``verbose`` and ``compile``
    are accepted (the service keeps vLLM's logging and compilation defaults);
    ``enable_fp32_output`` is TorchRL's own model patch, refused.

    Examples:
        >>> from_pretrained_kwargs(num_devices=2, max_model_len=512)
        {'max_model_len': 512, 'tensor_parallel_size': 2}
    """
    if enable_fp32_output:
        raise ConfigurationError(
            "enable_fp32_output=True patches TorchRL's own vLLM worker, which these replicas "
            "do not run; serve the model in float32 (dtype='float32') instead."
        )
    tp = kwargs.pop("tensor_parallel_size", None)
    if num_devices is not None and tp is not None and tp != num_devices:
        raise ConfigurationError(
            f"num_devices={num_devices} and tensor_parallel_size={tp} disagree; pass one."
        )
    return {**kwargs, "tensor_parallel_size": tp or num_devices or 1}


def request_outputs(batch: RequestBatch, texts: list[str | None], params, name: str) -> list:
    """vLLM ``RequestOutput``s of a batch, log-probs in the form each request asked for
    (vLLM's default: a list of dicts; ``flat_logprobs=True``: ``FlatLogprobs``)."""
    per_request = params if isinstance(params, list | tuple) else [params] * len(texts)
    outputs = []
    for i, (data, text, p) in enumerate(zip(batch.unpack(), texts, per_request, strict=True)):
        out = to_request_output(data, f"{name}-{i}", _wants_flat(p))
        out.prompt = text
        outputs.append(out)
    return outputs


def _wants_flat(params) -> bool:
    if isinstance(params, dict):
        return bool(params.get("flat_logprobs", False))
    return bool(getattr(params, "flat_logprobs", False))


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


__all__ = [
    "ENGINE_CALLS",
    "OWNER_ENGINE_CALLS",
    "TorchRLEngine",
    "actor_style",
    "from_pretrained_kwargs",
    "lora_name",
    "register_engine",
    "register_engine_if_loaded",
    "request_outputs",
]

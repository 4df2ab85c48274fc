"""VLLMService: N vLLM replicas on Ray behind one object, a facade over named parts.

* :class:`~.pool.ReplicaPool`: the replicas' lifecycle, the ready snapshot, fan-out calls
  and the one death policy;
* :class:`~.generation.Generation`: validate, route, send, retry, merge;
* :class:`~.lora_serving.LoraServing`: the adapters on every replica.

All of their state lives on one private event loop (:class:`~.loop.LoopThread`): the sync
methods block on it and the ``a``-prefixed ones await it (both made from one coroutine,
:func:`~.owner.twins`). Readers of the ready snapshot (``replica_ids``, ``replica_info``,
...) run on the caller's thread.

The service pickles, as TorchRL's ``AsyncVLLM`` does: in another Ray process it is a
handle to the same replicas (:mod:`.directory`, :class:`~.handle_pool.HandlePool`). A
handle generates and scores through them, sees the owner's weight version and deaths, and
forwards what only the owner does (:func:`~.owner.owner_only`: pushes, pause, replicas,
adapters); closing a handle stops nothing.
"""

from __future__ import annotations

import asyncio
import functools
import uuid
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

import ray

from torchrl_vllm_ext import leftovers
from torchrl_vllm_ext._compat import vllm_engine_api
from torchrl_vllm_ext.batches import RequestBatch
from torchrl_vllm_ext.engine import cluster, handles
from torchrl_vllm_ext.engine.adapters import AdapterRegistry
from torchrl_vllm_ext.engine.base import check_pause_mode
from torchrl_vllm_ext.engine.config import ServiceConfig
from torchrl_vllm_ext.engine.generation import Generation
from torchrl_vllm_ext.engine.handle_pool import HandlePool
from torchrl_vllm_ext.engine.loop import LoopThread
from torchrl_vllm_ext.engine.lora_serving import LoraServing
from torchrl_vllm_ext.engine.owner import FORWARDED, add_deprecated_aliases, owner_only, twins
from torchrl_vllm_ext.engine.pool import ReplicaPool, ReplicaView, WeightsProvider
from torchrl_vllm_ext.engine.prompt_forms import encode_texts, parse_prompts
from torchrl_vllm_ext.engine.torchrl_engine import (
    TorchRLEngineCalls,
    actor_style,
    register_engine,
    register_engine_if_loaded,
    request_outputs,
)
from torchrl_vllm_ext.engine.torchrl_engine import lora_name as _lora_name
from torchrl_vllm_ext.errors import ConfigurationError, InvalidRequestError, ServiceClosedError
from torchrl_vllm_ext.hf import load_tokenizer
from torchrl_vllm_ext.messages import ReplicaDeath, ReplicaInfo, ReplicaStats, RequestData

T = TypeVar("T")


class VLLMService(TorchRLEngineCalls):
    """vLLM v1 engine replicas as Ray actors behind one object.

    Use :meth:`launch` (or :meth:`from_config`); shut down with :meth:`shutdown` or a
    ``with`` block, which releases every actor and placement group. Pickled into another
    Ray process (a Ray actor, a task), it is a handle to the same replicas.

    Examples:
        >>> from torchrl_vllm_ext import VLLMService
        >>> from torchrl_vllm_ext.testing import make_tiny_model
        >>> with VLLMService.launch(make_tiny_model(), num_replicas=1) as svc:  # doctest: +SKIP
        ...     outs = svc.generate([[1, 2, 3]], {"max_tokens": 8})
        ...     len(outs[0].outputs[0].token_ids)
        8
    """

    def __init__(self, config: ServiceConfig, pool: ReplicaPool | HandlePool | None = None):
        self.config = config
        self.name = f"tvllm-{uuid.uuid4().hex[:8]}"
        self._loop = LoopThread(self.name)
        self.pool = pool if pool is not None else ReplicaPool(config, self.name)
        """The replicas (what weight-sync transports are given)."""
        self._adapters = AdapterRegistry()
        self._generation = Generation(self.pool, self._adapters, self.name)
        self._lora = LoraServing(self.pool, self._adapters) if self.is_owner else None
        # The owner's OwnerLink (directory, mailbox, port) or a handle's HandleLink.
        self._link: handles.OwnerLink | handles.HandleLink | None = None
        self._owns_ray = False
        self._closed = False
        self._tokenizer = None
        self._engine_updates = None  # TorchRL's engine calls: a scheme made on first use
        self._engine_args = None

    @property
    def is_owner(self) -> bool:
        """True in the process that launched the service; False in a handle."""
        return not isinstance(self.pool, HandlePool)

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    def launch(
        cls,
        model_path: str | Path,
        num_replicas: int = 1,
        tensor_parallel_size: int = 1,
        ray_address: str | None = None,
        **kwargs: Any,
    ) -> VLLMService:
        """Start ``num_replicas`` engines on ``model_path`` and return the running service.

        Keywords that are :class:`~torchrl_vllm_ext.engine.config.ServiceConfig` fields
        (``routing``, ``cpus_per_replica``, ``startup_timeout``, ``weight_version``, ...)
        configure the service; every other one goes to ``vllm.AsyncEngineArgs``
        (``max_model_len``, ``dtype``, ``enforce_eager``, ``seed``, ...). If any replica
        fails to start, everything already started is released before the error
        propagates.
        """
        config = ServiceConfig.from_kwargs(
            model_path,
            num_replicas=num_replicas,
            tensor_parallel_size=tensor_parallel_size,
            ray_address=ray_address,
            **kwargs,
        )
        return cls.from_config(config)

    @classmethod
    def from_config(cls, config: ServiceConfig) -> VLLMService:
        """Start the replicas ``config`` describes and return the running service."""
        leftovers.reap()  # what killed services, schemes and replicas left on this host
        svc = cls(config)
        try:
            # Ray is joined from the caller's thread: it installs signal handlers there.
            svc._owns_ray = cluster.ensure_ray(
                config.ray_address, log_to_driver=config.log_file is None
            )
            svc._link = handles.OwnerLink(svc.name, svc._serve)
            svc.pool.on_publish(svc._publish)
            svc._loop.run(svc._launch())
        except BaseException:
            svc.shutdown()
            raise
        return svc

    async def _launch(self) -> None:
        await self.pool.open()
        # The driver's first vLLM import (SamplingParams: ~4 s on 2 cores) runs while the
        # replicas start, not at the first request.
        importing = asyncio.ensure_future(asyncio.to_thread(_driver_imports))
        await self.pool.start(self.config.num_replicas, "starting vLLM replicas")
        await importing
        self.pool.start_health_checks()

    def shutdown(self) -> None:
        """The owner stops every replica and releases its actor, placement group and port;
        a handle only stops following them. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._engine_updates is not None:
                self._engine_updates.close()
            self._loop.run(self.pool.close(), timeout=300)
        finally:
            self._loop.close()
            if self.is_owner:
                self._close_owned()

    def _close_owned(self) -> None:
        try:
            if self._link is not None:
                self._link.close(self.pool, self._adapters.live())
        finally:
            if self._owns_ray and ray.is_initialized():
                ray.shutdown()

    def __enter__(self) -> VLLMService:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    async def __aenter__(self) -> VLLMService:
        return self

    async def __aexit__(self, *exc) -> None:
        await asyncio.to_thread(self.shutdown)

    # ------------------------------------------------------------------ owner and handles
    def __reduce__(self):
        if self._closed or self._link is None:
            raise ServiceClosedError(f"service {self.name} is not running; nothing to pickle.")
        if self.is_owner:
            table = self._link.table(self.pool, self._adapters.live())
        else:
            table = self.pool.table
        owner = self.name.split("-h")[0]
        return _attach, (self.config, self._link.directory, table, owner)

    def _publish(self) -> None:
        """Mirror the pool's state to the handles' directory (after every change)."""
        self._link.publish(self.pool, self._adapters.live())

    def export(self, method) -> str:
        """Let handles call the bound ``method`` through :meth:`call_exported` (the owner
        holds it weakly); returns its key. A weight-sync updater shipped into a Ray actor
        exports its scheme's ``push`` this way."""
        self._require_owner("export")
        return self._link.export(method)

    @owner_only
    def call_exported(self, key: str, *args, **kwargs):
        """Call what :meth:`export` returned ``key`` for (from a handle: on the owner)."""
        return self._link.exported(key)(*args, **kwargs)

    def _serve(self, kind: str, payload):
        """A handle's request, on the owner (a mailbox thread)."""
        if kind == "death":
            return self.run(self.pool.report_death(*payload))
        name, args, kwargs = ray.get(payload[0]) if kind == "call" else (kind, (), {})
        if name not in FORWARDED:
            raise InvalidRequestError(f"a service handle asked for {kind} {name!r}: not served.")
        return getattr(self, name)(*args, **kwargs)

    def _forward(self, name: str, args: tuple, kwargs: dict):
        """Owner-only method ``name``, run by the owner (this is a handle)."""
        if name == "update_weights":  # an iterator crosses as the list it yields
            args = (list(args[0]), *args[1:])
        return self._link.forward(name, args, kwargs)

    # ------------------------------------------------------------------ generation
    async def _generate(
        self,
        prompts=None,
        sampling_params=None,
        *,
        prompt_token_ids=None,
        timeout: float | None = None,
        routing: str | Sequence[str] | None = None,
        lora: str | None = None,
        lora_request=None,
        tokenization_kwargs: dict | None = None,
        use_tqdm: Any = None,
    ) -> list:
        """Generate, as ``vllm.LLM.generate`` does: vLLM ``RequestOutput``s in input order.

        Args:
            prompts: one prompt or a list of them, each a string, a list of token ids (or a
                1-D array / tensor), a ``TokensPrompt`` or a ``TextPrompt`` dict; text is
                tokenized with :meth:`get_tokenizer` (special tokens added, as vLLM does).
            sampling_params: a ``vllm.SamplingParams``, a dict of its fields, or a list
                with one per prompt. Sampled-token log-probs are always returned.
            timeout: seconds; on expiry the requests are aborted inside vLLM and
                :class:`~torchrl_vllm_ext.errors.GenerationTimeoutError` is raised.
            routing: override the service's routing strategies for this batch.
            lora: name of a LoRA adapter added with :meth:`add_lora` (None: base weights).
            lora_request: vLLM's form of ``lora``: a ``LoRARequest`` whose ``lora_name``
                was added with :meth:`add_lora`.
            tokenization_kwargs: for the text prompts (e.g. ``{"add_special_tokens": False}``).
            use_tqdm: accepted for ``vllm.LLM.generate`` callers; the service shows no bar.
            prompt_token_ids: TorchRL's ``AsyncVLLM.generate`` keyword: token-id prompts
                given by name (instead of ``prompts``).

        ``svc.generate.remote(...)`` returns a Ray ``ObjectRef`` of the same list, so code
        written for a Ray actor (TorchRL's ``vLLMWrapper``) takes the service.
        """
        encode = functools.partial(self._encode, tokenization_kwargs=tokenization_kwargs)
        parsed = parse_prompts(_one_of(prompts, prompt_token_ids), encode)
        batch = await self._generation.run(
            parsed.token_ids, sampling_params, timeout, routing, _lora_name(lora, lora_request)
        )
        return request_outputs(batch, parsed.texts, sampling_params, self.name)

    generate, agenerate = twins(_generate)
    generate = actor_style(generate)

    async def _generate_request_data(
        self, prompts, sampling_params=None, *, timeout=None, routing=None, lora=None
    ) -> list[RequestData]:
        """Like :meth:`generate` (every prompt form) but returns plain :class:`RequestData`
        (numpy arrays)."""
        parsed = parse_prompts(prompts, self._encode)
        batch = await self._generation.run(
            parsed.token_ids, sampling_params, timeout, routing, lora
        )
        return batch.unpack()

    generate_request_data, agenerate_request_data = twins(_generate_request_data)

    async def _generate_request_batch(
        self,
        prompt_token_ids,
        sampling_params=None,
        *,
        timeout=None,
        routing=None,
        lora=None,
        return_log_probs: bool = True,
    ) -> RequestBatch:
        """Like :meth:`generate` but returns one :class:`RequestBatch` of flat arrays, in
        input order: the fastest form, which ``VLLMPolicy`` converts to a TensorDict.
        ``prompt_token_ids`` is a list of token-id sequences (no text: the hot path).

        ``return_log_probs=False`` skips vLLM's sampled-token log-probs (NaN in the batch).
        """
        return await self._generation.run(
            prompt_token_ids, sampling_params, timeout, routing, lora, return_log_probs
        )

    generate_request_batch, agenerate_request_batch = twins(_generate_request_batch)

    def _encode(self, texts: list[str], tokenization_kwargs=None) -> list[list[int]]:
        # The tokenizer is loaded at the first text prompt, not for token prompts.
        return encode_texts(self.get_tokenizer(), texts, tokenization_kwargs)

    def get_tokenizer(self):
        """The served model's tokenizer (``transformers.AutoTokenizer``, loaded once): what
        TorchRL's ``vLLMWrapper`` and :class:`~torchrl_vllm_ext.VLLMPolicy` read by default."""
        if self._tokenizer is None:
            source = self.config.engine_kwargs.get("tokenizer") or self.config.model
            self._tokenizer = load_tokenizer(source, "tokenizer")
        return self._tokenizer

    def remote(self, method: str, *args, **kwargs) -> ray.ObjectRef:
        """Ray-actor style call: a Ray ``ObjectRef`` of ``getattr(svc, method)(*args, **kwargs)``
        (run now, in this process). With ``generate.remote``, what makes the service pass
        for a Ray actor where TorchRL expects one (``vLLMWrapper``)."""
        return ray.put(getattr(self, method)(*args, **kwargs))

    @property
    def routing(self) -> tuple[str, ...]:
        """The routing strategies a batch uses unless it names others."""
        return self._generation.routing

    # ------------------------------------------------------------------ LoRA
    async def _add_lora(self, name: str, path: str | Path, shared: bool = False) -> int:
        """Load the PEFT LoRA adapter in ``path`` on every replica as ``name``; returns
        vLLM's id for it. Re-adding a name loads the new files under a new id (requests
        already running finish on the old one). Needs ``enable_lora=True`` at launch.

        Replicas on other nodes than this process get the files through Ray's object
        store, unless ``shared`` says every node sees ``path`` (a shared file system).
        A replica that dies meanwhile gets the adapter when it restarts.
        """
        try:
            return await self._lora.add(name, path, shared)
        finally:
            self._publish()

    async def _remove_lora(self, name: str) -> None:
        """Unload adapter ``name`` from every replica."""
        try:
            await self._lora.remove(name)
        finally:
            self._publish()

    add_lora, _ = twins(_add_lora, owner=True)
    remove_lora, aremove_lora = twins(_remove_lora, owner=True)

    def list_loras(self) -> dict[str, int]:
        """Live adapters: name -> vLLM id."""
        return {a.name: a.lora_id for a in self._adapters.live()}

    # ------------------------------------------------------------------ replicas
    def replicas(self) -> tuple[ReplicaView, ...]:
        """The ready replicas (id, actor handle, info): one consistent snapshot."""
        return self.pool.ready()

    @property
    def actors(self) -> list:
        """The ready replicas' Ray actor handles, by replica id (TorchRL's
        ``AsyncVLLM.actors``: ``get_tokenizer``, ``collective_rpc_v1``, ``sleep``, ...)."""
        return [v.handle for v in self.pool.ready()]

    @property
    def replica_ids(self) -> list[int]:
        """Ids of the replicas that are ready to serve."""
        return [v.replica_id for v in self.pool.ready()]

    @property
    def num_replicas(self) -> int:
        """How many replicas are ready to serve."""
        return len(self.pool.ready())

    def replica_handle(self, replica_id: int):
        """The Ray actor handle of a ready replica (for weight-sync transports)."""
        return self.pool.view(replica_id).handle

    def replica_info(self, replica_id: int) -> ReplicaInfo:
        """What a ready replica reported at start (pid, node, limits)."""
        return self.pool.view(replica_id).info

    def replica_states(self) -> dict[int, str]:
        """Every replica the service holds: ``starting``, ``ready``, ``draining`` or ``dead``."""
        return {rid: state.value for rid, state in self.pool.states().items()}

    def deaths(self) -> list[ReplicaDeath]:
        """Every replica death the service noticed, oldest first (each is then restarted)."""
        return self.pool.deaths()

    @property
    def max_token_id(self) -> int | None:
        """Largest token id the engines accept (None before the first replica started)."""
        limits = self.pool.limits
        return limits.max_token_id if limits else None

    @property
    def max_model_len(self) -> int | None:
        """Longest prompt + completion the engines accept (None before the first replica started)."""
        limits = self.pool.limits
        return limits.max_model_len if limits else None

    @property
    def uses_gpu(self) -> bool:
        """Whether the replicas run on GPUs."""
        return self.pool.uses_gpu

    @owner_only
    def add_replicas(self, k: int) -> list[int]:
        """Start ``k`` more replicas while serving; returns their ids."""
        if not isinstance(k, int) or k < 1:
            raise ConfigurationError(f"add_replicas(k={k!r}): k must be an integer >= 1.")
        return self.run(self.pool.start(k, f"adding {k} vLLM replica(s)"))

    @owner_only
    def remove_replicas(self, k: int, drain_timeout: float = 600.0) -> list[int]:
        """Remove ``k`` replicas while serving: they take no new work, finish what they have, stop."""
        ready = self.num_replicas
        if not isinstance(k, int) or k < 1 or k >= ready:
            raise ConfigurationError(
                f"remove_replicas(k={k!r}) with {ready} ready replicas: k must be between 1 "
                f"and {ready - 1} (at least one replica keeps serving); use shutdown() to stop all."
            )
        return self.run(self.pool.remove(k, drain_timeout))

    @owner_only
    def check_health(self) -> dict[int, bool]:
        """Ping every ready replica now; dead ones are restarted. Returns {replica_id: healthy}."""
        return self.run(self.pool.check_health())

    # ------------------------------------------------------------------ control
    def stats(self) -> list[ReplicaStats]:
        """Each ready replica's load, read from vLLM (a replica dying meanwhile is left out)."""
        out = self.run(self.pool.call_all("stats"))
        out.check("stats")
        return [out.results[rid] for rid in sorted(out.results)]

    @owner_only
    def pause(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """Pause generation on every replica (vLLM modes: ``abort``, ``wait``, ``keep``).

        A replica restarted while paused comes back paused.
        """
        check_pause_mode(mode)
        self.pool.serving = self.pool.serving.paused_as(mode, clear_cache)
        self._call_all("pause", mode, clear_cache)

    @owner_only
    def resume(self) -> None:
        """Resume generation on every replica after :meth:`pause` (a sleeping service
        resumes once it is awake). A push made meanwhile is value-checked now: a
        replica that fails the check is restarted and :class:`WeightSyncError` names it."""
        self.pool.serving = self.pool.serving.resumed()
        self._call_all("resume")
        self.run(self.pool.serving_again())

    @owner_only
    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Free the replicas' GPU memory for a colocated trainer (vLLM sleep mode).

        Level 1 offloads the weights to host memory and drops the KV cache; level 2 drops
        both: wake the weights, push, then wake the cache (:meth:`wake_up`). Requests sent
        meanwhile wait. A push while the weights sleep is refused; a replica restarted
        meanwhile comes back asleep. Needs GPU replicas launched with
        ``enable_sleep_mode=True``.
        """
        check_pause_mode(mode)
        state = self.pool.serving.slept(level)
        if not (self.uses_gpu and self.config.engine_kwargs.get("enable_sleep_mode")):
            raise ConfigurationError(
                "sleep() needs GPU replicas launched with enable_sleep_mode=True "
                f"(uses_gpu={self.uses_gpu}, enable_sleep_mode="
                f"{self.config.engine_kwargs.get('enable_sleep_mode', False)}); vLLM-CPU has "
                "no sleep mode."
            )
        self.pool.serving = state
        self._call_all("sleep", level, mode)

    @owner_only
    def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake the replicas: everything, or only ``tags`` (``["weights"]``, then
        ``["kv_cache"]`` after a push at sleep level 2). A push made while the cache slept
        is value-checked once everything is awake (see :meth:`resume`)."""
        self.pool.serving = self.pool.serving.woke(tags)
        self._call_all("wake_up", tags)
        self.run(self.pool.serving_again())

    def is_sleeping(self) -> dict[int, bool]:
        """Whether each ready replica sleeps (at all, or in part)."""
        return self._call_all("is_sleeping")

    @property
    def weight_version(self) -> str:
        """The version every replica serves and restarted replicas are brought to."""
        return self.pool.weight_version

    async def _set_weight_version(self, version: str | int) -> None:
        """Label every replica's weights with ``version`` (restarted replicas get the label).

        The label replaces the weights provider's: a restarted replica then serves the
        checkpoint's weights under this label until the next push.
        """
        self.pool.weight_version = str(version)
        self.pool.set_provider(None)
        out = await self.pool.call_all("set_weight_version", str(version))
        out.check("set_weight_version")

    set_weight_version, aset_weight_version = twins(_set_weight_version, owner=True)

    def weight_versions(self) -> dict[int, str]:
        """The version each ready replica reports serving."""
        return self._call_all("get_weight_version")

    def reset_prefix_cache(self) -> None:
        """Drop every replica's prefix cache."""
        self._call_all("reset_prefix_cache")

    def set_weights_provider(self, provider: WeightsProvider | None) -> None:
        """Make ``provider`` bring restarted replicas to the live weights (None: nobody).

        A weight-sync scheme sets itself after each push it completes (on the owner).
        """
        self._require_owner("set_weights_provider")
        self.pool.set_provider(provider)

    @property
    def weights_provider(self) -> WeightsProvider | None:
        return self.pool.provider if self.is_owner else None

    def _require_owner(self, what: str) -> None:
        if not self.is_owner:
            raise ConfigurationError(
                f"{what} needs the service's owner (the process that launched it); this is a "
                "handle in another process: push with WeightSyncUpdater, vLLMUpdaterV2 or "
                "service.update_weights (forwarded to the owner), or from the owner."
            )

    def _call_all(self, method: str, *args) -> dict[int, Any]:
        """``method`` on every ready replica: {replica_id: answer} of those that answered;
        a typed error if one failed, or if every one died."""
        out = self.run(self.pool.call_all(method, *args))
        out.check(method)
        return dict(sorted(out.results.items()))

    # ------------------------------------------------------------------ the event loop
    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the service's event loop, where replicas are managed, and block.

        Weight-sync schemes run their pushes here, so a push and a replica restart share
        one event loop and one lock.
        """
        return self._loop.run(self._open(coro))

    async def arun(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await ``coro`` on the service's event loop (from any event loop)."""
        return await self._loop.arun(self._open(coro))

    def submit(self, coro: Coroutine[Any, Any, T]):
        """Schedule ``coro`` on the service's event loop; a ``concurrent.futures.Future``."""
        return asyncio.run_coroutine_threadsafe(self._open(coro), self._loop.loop)

    def _open(self, coro: Coroutine[Any, Any, T]) -> Coroutine[Any, Any, T]:
        """``coro``, or :class:`ServiceClosedError` (closing ``coro``) after shutdown."""
        if self._closed:
            coro.close()
            raise ServiceClosedError(f"service {self.name} was shut down; launch a new one.")
        return coro


add_deprecated_aliases(VLLMService)
register_engine_if_loaded(VLLMService)


def _attach(config: ServiceConfig, directory_actor, table, owner: str) -> VLLMService:
    register_engine_if_loaded(VLLMService)
    return handles.attach(VLLMService, config, directory_actor, table, owner)


def _one_of(prompts, prompt_token_ids):
    if (prompts is None) == (prompt_token_ids is None):
        raise InvalidRequestError(
            "generate() takes the prompts once: pass prompts (any vLLM form) or "
            "prompt_token_ids=, not both and not neither."
        )
    return prompts if prompts is not None else prompt_token_ids


def _driver_imports() -> None:
    # One thread, one after the other: TorchRL's module imports vLLM too, and two threads
    # importing one package at once can see it half initialised.
    vllm_engine_api()
    register_engine(VLLMService)  # TorchRL's engine ABC, for vLLMUpdaterV2(service)


__all__ = ["VLLMService"]

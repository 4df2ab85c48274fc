"""VLLMPolicy: a TensorDict module over a :class:`~torchrl_vllm_ext.VLLMService`.

It reads prompts (tokens, text or chat history), sends the whole batch to the service
in one call, and writes TorchRL's LLM wrapper layout back. This module only wires keys:
options live in :mod:`.options`, reading in :mod:`.inputs`, the conversion of the
service's flat results in :mod:`.convert` (generation), :mod:`.scoring` and
:mod:`.text`.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
import torch
from tensordict import LazyStackedTensorDict, NonTensorData, TensorDictBase, set_list_to_stack
from tensordict.nn import TensorDictModuleBase

from torchrl_vllm_ext.batches import RequestBatch
from torchrl_vllm_ext.errors import ConfigurationError, InvalidRequestError
from torchrl_vllm_ext.wrappers import convert, inputs, scoring
from torchrl_vllm_ext.wrappers.layout import row_td
from torchrl_vllm_ext.wrappers.options import OPTION_NAMES, SCORE_PARAMS, PolicyOptions
from torchrl_vllm_ext.wrappers.text import add_scored_text, add_text


class _Call(NamedTuple):
    """One call between reading the input and writing the output."""

    td: TensorDictBase
    read: inputs.PolicyInput
    params: dict
    lora: str | None = None
    seeds: np.ndarray | None = None
    """One int per element (``seed_key``), or None."""


class VLLMPolicy(TensorDictModuleBase):
    """Generate (or score) with a :class:`~torchrl_vllm_ext.VLLMService`, TensorDict in and out.

    The output follows TorchRL's LLM wrappers (``torchrl.modules.llm.policies``), so
    ``GRPOLoss``, ``LLMCollector`` and the LLM envs take it unchanged:

    - ``("tokens", "prompt" | "response" | "full")``: int64 token ids, ``full = prompt ++ response``.
    - ``("log_probs", "response")``: float32 log-prob of each sampled token under the engine;
      ``("log_probs", "full")``: the same aligned with ``tokens.full``, prompt positions NaN
      ("no score") unless ``return_prompt_log_probs=True`` (then real, first token 0.0);
      ``("log_probs", "prompt")`` the prompt's slice of it.
    - ``("masks", "all_attention_mask" | "all_assistant_mask")``: bool, shaped like ``tokens.full``.
    - ``("text", ...)`` in text and history modes; ``("history", "prompt" | "response" | "full")``
      in history mode.
    - Additive: ``("vllm", "weight_version")`` (str, the engine weight version the sample's
      request was admitted at), ``("vllm", "weight_version_end")`` (str, the version when it
      finished: later only if a ``keep`` sync happened mid-generation),
      ``("vllm", "weight_version_end_from")`` (int64, the index of the first response token
      generated with ``weight_version_end``; the tokens before it came from older weights:
      0 unless a ``keep`` sync spanned the generation; see
      :func:`~torchrl_vllm_ext.collectors.mask_stale_tokens`), ``("vllm", "cached_tokens")``
      (int64, the prompt tokens vLLM's prefix cache served) and
      ``("vllm", "finish_reason")`` (str, vLLM's: "stop", "length", "abort"). Read them with ``td.get(("vllm", "finish_reason")).tolist()``.

    ``pad_output=False`` returns a lazy stack whose rows hold 1-D tensors of their own length
    (read them with ``td.get(key, as_list=True)`` or ``as_padded_tensor=True``);
    ``pad_output=True`` dense tensors in the ``[left pad | prompt | response | right pad]``
    layout (token pad = ``pad_token_id``, log-prob pad 0.0). Without ``num_samples`` the
    input's other keys are kept (a dense input becomes a lazy stack when unpadded); with
    ``num_samples=G`` the output has batch ``(*batch, G)`` and holds the output keys only
    (``reshape(-1)`` it before ``GRPOLoss``).

    ``generate=False`` scores given sequences (``tokens.full``, or text / history ``full``):
    ``log_probs.full`` (first token 0.0), split into ``prompt`` / ``response`` when the
    input carries ``tokens.prompt``; use it for reference or old-policy log-probs.

    Args:
        service: the running :class:`~torchrl_vllm_ext.VLLMService`.
        options: a :class:`~torchrl_vllm_ext.wrappers.options.PolicyOptions`, or its fields
            as keywords (``input_mode``, ``generate``, ``pad_output``, ``num_samples``,
            ``sampling_params``, ``tokenizer``, ``pad_token_id``, ``return_prompt_log_probs``,
            ``attention_mask_key``, ``seed_key``, ``timeout``, ``chat_template_kwargs`` and
            the top-level output keys ``tokens_key``, ``log_probs_key``, ``masks_key``,
            ``text_key``, ``history_key``); each field is documented there.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict, lazy_stack
        >>> from torchrl_vllm_ext import VLLMPolicy, VLLMService
        >>> from torchrl_vllm_ext.testing import make_tiny_model
        >>> svc = VLLMService.launch(make_tiny_model(), dtype="float32")  # doctest: +SKIP
        >>> policy = VLLMPolicy(svc, input_mode="tokens", sampling_params={"max_tokens": 8})  # doctest: +SKIP
        >>> td = lazy_stack([TensorDict({("tokens", "prompt"): torch.tensor([5, 6, 7])}),
        ...                  TensorDict({("tokens", "prompt"): torch.tensor([8, 9])})])
        >>> out = policy(td)  # doctest: +SKIP
        >>> [t.shape for t in out.get(("tokens", "full"), as_list=True)]  # doctest: +SKIP
        [torch.Size([11]), torch.Size([10])]
        >>> out.get(("vllm", "weight_version")).tolist()  # doctest: +SKIP
        ['0', '0']
    """

    def __init__(self, service, options: PolicyOptions | None = None, **kwargs: Any):
        super().__init__()
        names = OPTION_NAMES | {"generate_kwargs"}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ConfigurationError(
                f"VLLMPolicy got unknown option(s) {unknown}; the options are {sorted(names)}."
            )
        if kwargs.get("tokenizer") is None and (options is None or options.tokenizer is None):
            # TorchRL's wrappers read the engine's tokenizer when given none.
            get_tokenizer = getattr(service, "get_tokenizer", None)
            if get_tokenizer is not None:
                kwargs["tokenizer"] = get_tokenizer()
        if options is None:
            self.options = PolicyOptions.from_kwargs(**kwargs)
        else:
            self.options = options.replace(**kwargs) if kwargs else options
        self.service = service
        self._sampling = self.options.engine_sampling()
        self.layout = None if self.pad_output else torch.strided
        self.keys = self.options.keys
        self.in_keys = [self.options.read_key]
        self.input_key = self.in_keys[0]
        self.out_keys = self.options.output_keys
        self._max_token_id: int | None = None
        self._collector = None

    @property
    def sampling_params(self):
        """The ``vllm.SamplingParams`` of a generation call (as TorchRL's wrapper exposes),
        before per-call overrides and per-element seeds."""
        from torchrl_vllm_ext.engine.validation import make_sampling_params

        return make_sampling_params(self._sampling)

    @property
    def model(self):
        """The service, as TorchRL's wrappers' ``.model`` is their engine: TorchRL's
        collectors hand it out (``get_policy_model``) and its ``vLLMUpdater`` (V1) calls it,
        which the service refuses naming the supported pushes."""
        return self.service

    # ------------------------------------------------------------------ TorchRL hooks
    # What the output holds, derived from the mode as in TorchRL's wrappers.
    @property
    def return_text(self) -> bool:
        return self.input_mode != "tokens"

    @property
    def return_history(self) -> bool:
        return self.input_mode == "history"

    @property
    def return_tokens(self) -> bool:
        return True

    @property
    def return_masks(self) -> bool:
        return True

    def get_new_version(self, **kwargs) -> VLLMPolicy:
        """A policy on the same service with some options changed.

        TorchRL's ``RetrieveKL("from_collector")`` calls it with ``generate=False``;
        TorchRL-only arguments it passes (``return_log_probs``, ``input_key``) are checked
        and dropped.
        """
        for name, value in list(kwargs.items()):
            # NOTE: RetrieveKL("from_collector") passes log_probs_key as a 1-tuple.
            if name.endswith("_key") and isinstance(value, tuple) and len(value) == 1:
                kwargs[name] = value[0]
        if not kwargs.get("generate", self.generate):
            kwargs.setdefault("num_samples", None)
        policy = VLLMPolicy(self.service, self.options.replace(**kwargs))
        return policy

    def register_collector(self, collector) -> None:
        """Called by TorchRL's LLMCollector; kept as a weak reference."""
        self._collector = weakref.ref(collector)

    @property
    def collector(self):
        return self._collector() if self._collector is not None else None

    # ------------------------------------------------------------------ forward
    @set_list_to_stack(True)
    def forward(self, tensordict: TensorDictBase, **sampling_overrides) -> TensorDictBase:
        """Generate (or score) for every element of ``tensordict``; see the class docstring.

        ``sampling_overrides`` replace this call's sampling parameters (vLLM field names).
        """
        call = self._prepare(tensordict, sampling_overrides)
        batch = self.service.generate_request_batch(
            call.read.token_ids,
            call.params,
            timeout=self.timeout,
            lora=call.lora,
            return_log_probs=self._engine_log_probs,
            seeds=call.seeds,
        )
        return self._finish(call, batch)

    async def aforward(self, tensordict: TensorDictBase, **sampling_overrides) -> TensorDictBase:
        """Awaitable :meth:`forward`: many calls can be in flight at once on the service."""
        with set_list_to_stack(True):
            call = self._prepare(tensordict, sampling_overrides)
        batch = await self.service.agenerate_request_batch(
            call.read.token_ids,
            call.params,
            timeout=self.timeout,
            lora=call.lora,
            return_log_probs=self._engine_log_probs,
            seeds=call.seeds,
        )
        with set_list_to_stack(True):
            return self._finish(call, batch)

    # ------------------------------------------------------------------ steps
    def _prepare(self, td: TensorDictBase, overrides: Mapping[str, Any]) -> _Call:
        if not isinstance(td, TensorDictBase):
            raise InvalidRequestError(
                f"VLLMPolicy takes a TensorDict, got {type(td).__name__}; wrap your prompts, e.g. "
                f'TensorDict({{("tokens", "prompt"): ids}}, batch_size=[len(ids)]).'
            )
        key = self.in_keys[0]
        read = inputs.read_input(
            td,
            key,
            self.input_mode,
            tokenizer=self.tokenizer,
            mask_key=self.attention_mask_key,
            pad_token_id=self.pad_token_id,
            add_generation_prompt=self.generate,
            chat_template_kwargs=self.chat_template_kwargs,
            tokens_key=(
                (self.tokens_key, "prompt")
                if self.prefer_tokens and self.generate and self.input_mode == "history"
                else None
            ),
        )
        inputs.check_vocab(read.token_ids, key, self._vocab_max())
        # An AdapterSync gives its newest version, fixed for this call.
        lora = self.lora if self.lora is None or isinstance(self.lora, str) else self.lora.current
        n = len(read.token_ids)
        return _Call(td, read, self._params(overrides), lora, self._seeds(td, n))

    @property
    def _engine_log_probs(self) -> bool:
        """Whether vLLM computes the sampled tokens' log-probs: only when they are returned
        (scoring reads the prompt log-probs, never the one sampled token's)."""
        return self.generate and self.return_log_probs

    def _vocab_max(self) -> int | None:
        if self._max_token_id is None:
            self._max_token_id = self.service.max_token_id
        return self._max_token_id

    def _params(self, overrides: Mapping[str, Any]) -> dict:
        if not self.generate:
            return dict(SCORE_PARAMS)
        if "n" in overrides:
            raise InvalidRequestError(
                "n cannot be overridden per call; build the policy with num_samples=G."
            )
        return {**self._sampling, **overrides}

    def _seeds(self, td: TensorDictBase, n: int) -> np.ndarray | None:
        """The per-element seeds (``seed_key``) as one int64 array, or None."""
        seeds = td.get(self.seed_key, None) if self.seed_key is not None and self.generate else None
        if seeds is None:
            return None
        if not isinstance(seeds, torch.Tensor) or seeds.dtype.is_floating_point:
            raise InvalidRequestError(
                f"{inputs.key_str(self.seed_key)} must be an integer tensor (one seed per element), "
                f"got {getattr(seeds, 'dtype', type(seeds).__name__)}."
            )
        seeds = seeds.reshape(-1).cpu().numpy().astype(np.int64)
        if len(seeds) != n:
            raise InvalidRequestError(
                f"{inputs.key_str(self.seed_key)} holds {len(seeds)} seeds for {n} prompts; give "
                "one int per batch element (shape = batch size)."
            )
        return seeds

    def _finish(self, call: _Call, batch: RequestBatch) -> TensorDictBase:
        td, keys, read = call.td, self.keys, call.read
        if not self.generate:
            out = scoring.scored_output(td, read, batch, self.options)
            if read.texts is not None:
                add_scored_text(out, read.texts, read.histories, keys)
        else:
            with_prompt_lp = self.return_prompt_log_probs
            if self.pad_output:
                out = convert.generated_padded(batch, self.pad_token_id, keys, with_prompt_lp)
            else:
                out = convert.generated_rows(batch, keys, with_prompt_lp)
            if read.texts is not None:
                eos = self.tokenizer.eos_token if read.histories is not None else None
                add_text(out, batch, read.texts, read.histories, self.num_samples or 1, eos, keys)
            if not self.return_log_probs:
                out = _without(out, keys.log_probs)
            if call.lora is not None:  # which adapter version made each sample
                _tag(out, (keys.extra, "lora"), call.lora)
        shape = td.batch_size
        if self.num_samples is not None:
            return _shaped(out, torch.Size([*shape, self.num_samples]))
        if self.inplace is False:
            return _shaped(out, shape)
        return _merge(td.empty() if self.inplace == "empty" else td, out, self.out_keys)


def _without(out, key: str):
    """The output rows (or dense output) without ``key``."""
    if isinstance(out, list):
        for row in out:
            del row[key]
        return out
    return out.exclude(key)


def _tag(out, key, value: str) -> None:
    """Write the string ``value`` under ``key`` for every sample of the output."""
    if isinstance(out, list):
        shared = NonTensorData(value)
        for row in out:
            row.set(key, shared)
    else:
        out.set(key, NonTensorData(value, batch_size=out.batch_size))


def _merge(td: TensorDictBase, out, out_keys: list) -> TensorDictBase:
    """Write the output into the input (TorchRL's wrappers do), replacing ``out_keys``."""
    shape = td.batch_size
    if isinstance(out, list):  # ragged rows: merge into the input's rows
        if isinstance(td, LazyStackedTensorDict) and td.batch_dims == 1:
            # In place, as TorchRL's wrappers: the caller's lazy stack holds the outputs.
            for row, new in zip(td.tensordicts, out, strict=True):
                row.exclude(*out_keys, inplace=True).update(new)
            return td
        merged = []
        for row, new in zip(inputs.rows_of(td), out, strict=True):
            keep = {k: v for k, v in row.items() if k not in out_keys}
            merged.append(row_td({**keep, **dict(new.items())}))
        return _shaped(merged, shape)
    out = out.reshape(shape) if shape else out[0]
    return td.exclude(*out_keys, inplace=True).update(out, keys_to_update=out_keys)


def _shaped(out, shape: torch.Size):
    """Give flat rows (a list of 0-dim TDs, or a dense ``(N,)`` TD) the batch ``shape``."""
    if not isinstance(out, list):
        return out.reshape(shape)
    if len(shape) == 0:
        return out[0]
    if len(shape) == 1:
        return LazyStackedTensorDict(*out, stack_dim=0)
    step = math.prod(shape[1:])
    return LazyStackedTensorDict(
        *(_shaped(out[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])),
        stack_dim=0,
    )


def _option(name: str) -> property:
    return property(
        lambda self: getattr(self.options, name),
        doc=f"``PolicyOptions.{name}`` (read-only; TorchRL reads it as a policy attribute).",
    )


# TorchRL's transforms and collectors read the options as attributes of the policy: each
# one delegates to the frozen options, the one place they live.
for _name in sorted(OPTION_NAMES - {"sampling_params", "input_key"}):  # both: own meaning
    setattr(VLLMPolicy, _name, _option(_name))


__all__ = ["VLLMPolicy"]

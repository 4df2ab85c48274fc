"""VLLMPolicy: a TensorDict module over a :class:`~torchrl_vllm_ext.VLLMService`.

It reads prompts (tokens, text or chat history), sends the whole batch to the service
in one call, and writes TorchRL's LLM wrapper layout back. Reading lives in
:mod:`.inputs`, the vectorised RequestData -> tensors conversion in :mod:`.convert`;
this module only wires keys, checks arguments and merges the output into the input.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tensordict import (
    LazyStackedTensorDict,
    NonTensorData,
    TensorDictBase,
    set_list_to_stack,
)
from tensordict.nn import TensorDictModuleBase

from torchrl_vllm_ext.errors import ConfigurationError, InvalidRequestError
from torchrl_vllm_ext.wrappers import convert, inputs
from torchrl_vllm_ext.wrappers.convert import OutputKeys
from torchrl_vllm_ext.wrappers.inputs import flatten_rows

INPUT_MODES = ("tokens", "text", "history")
_SCORE_PARAMS = {"max_tokens": 1, "prompt_logprobs": 0, "detokenize": False}


@dataclass
class _Plan:
    """One call's prompts and parameters, between reading the input and writing the output."""

    td: TensorDictBase
    prompts: list[np.ndarray]
    params: dict | list[dict]
    prompt_texts: list[str] | None = None
    histories: list | None = None


class VLLMPolicy(TensorDictModuleBase):
    """Generate (or score) with a :class:`~torchrl_vllm_ext.VLLMService`, TensorDict in and out.

    The output follows TorchRL's LLM wrappers (``torchrl.modules.llm.policies``), so
    ``GRPOLoss``, ``LLMCollector`` and the LLM envs take it unchanged:

    - ``("tokens", "prompt" | "response" | "full")``: int64 token ids, ``full = prompt ++ response``.
    - ``("log_probs", "response")``: float32 log-prob of each sampled token under the engine;
      ``("log_probs", "full")``: the same aligned with ``tokens.full``, prompt positions NaN
      ("no score") unless ``return_prompt_log_probs=True`` (then real, first token 0.0);
      ``("log_probs", "prompt")`` only when computed.
    - ``("masks", "all_attention_mask" | "all_assistant_mask")``: bool, shaped like ``tokens.full``.
    - ``("text", ...)`` in text and history modes; ``("history", "prompt" | "response" | "full")``
      in history mode.
    - Additive: ``("vllm", "weight_version")`` (str, the engine weight version the sample's
      request was admitted at), ``("vllm", "weight_version_end")`` (str, the version when it
      finished: later only if a ``keep`` sync happened mid-generation) and
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
        input_mode: ``"tokens"``, ``"text"`` or ``"history"``.
        generate: generate (True) or score the given sequences (False).
        pad_output: dense padded output (True) or ragged rows (False).
        num_samples: samples per prompt ``G``; adds a trailing batch dim of size ``G``.
        sampling_params: vLLM ``SamplingParams`` fields as a dict (``max_tokens``,
            ``temperature``, ...); any call can override them: ``policy(td, temperature=0)``.
        tokenizer: a Hugging Face tokenizer; required by text and history modes.
        pad_token_id: pad id of padded outputs and inputs (default: the tokenizer's).
        return_prompt_log_probs: also compute prompt log-probs while generating.
        attention_mask_key: where a padded token input's bool mask is read.
        seed_key: an int per element under this key seeds that element's sampling.
        timeout: seconds per call (the requests are aborted in vLLM on expiry).
        chat_template_kwargs: extra ``apply_chat_template`` arguments (history mode).
        tokens_key, log_probs_key, masks_key, text_key, history_key: top-level output keys.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict, lazy_stack
        >>> from torchrl_vllm_ext import VLLMPolicy, VLLMService
        >>> from torchrl_vllm_ext.testing import make_tiny_model
        >>> svc = VLLMService.launch(make_tiny_model(), dtype="float32")  # doctest: +SKIP
        >>> policy = VLLMPolicy(svc, sampling_params={"max_tokens": 8})  # doctest: +SKIP
        >>> td = lazy_stack([TensorDict({("tokens", "prompt"): torch.tensor([5, 6, 7])}),
        ...                  TensorDict({("tokens", "prompt"): torch.tensor([8, 9])})])
        >>> out = policy(td)  # doctest: +SKIP
        >>> [t.shape for t in out.get(("tokens", "full"), as_list=True)]  # doctest: +SKIP
        [torch.Size([11]), torch.Size([10])]
        >>> out.get(("vllm", "weight_version")).tolist()  # doctest: +SKIP
        ['0', '0']
    """

    def __init__(
        self,
        service,
        *,
        input_mode: str = "tokens",
        generate: bool = True,
        pad_output: bool = False,
        num_samples: int | None = None,
        sampling_params: Mapping[str, Any] | None = None,
        tokenizer=None,
        pad_token_id: int | None = None,
        return_prompt_log_probs: bool = False,
        attention_mask_key: str | tuple[str, ...] = ("masks", "all_attention_mask"),
        seed_key: str | tuple[str, ...] | None = "seed",
        timeout: float | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tokens_key: str = "tokens",
        log_probs_key: str = "log_probs",
        masks_key: str = "masks",
        text_key: str = "text",
        history_key: str = "history",
    ):
        super().__init__()
        if input_mode not in INPUT_MODES:
            raise ConfigurationError(
                f"input_mode={input_mode!r} is not one of {INPUT_MODES}; pick the one your data has."
            )
        if input_mode != "tokens" and tokenizer is None:
            raise ConfigurationError(
                f"input_mode={input_mode!r} needs a tokenizer to turn {input_mode} into token ids; "
                "pass tokenizer=AutoTokenizer.from_pretrained(service.config.model)."
            )
        if num_samples is not None and (not isinstance(num_samples, int) or num_samples < 1):
            raise ConfigurationError(f"num_samples={num_samples!r} must be None or an int >= 1.")
        if num_samples is not None and not generate:
            raise ConfigurationError("num_samples applies to generation; use generate=True.")
        sampling = dict(sampling_params or {})
        if not isinstance(sampling_params, Mapping | None):
            raise ConfigurationError(
                f"sampling_params must be a dict of vllm.SamplingParams fields, got "
                f"{type(sampling_params).__name__}; e.g. {{'max_tokens': 32, 'temperature': 1.0}}."
            )
        if "n" in sampling:
            raise ConfigurationError(
                "sampling_params['n'] is set by num_samples; pass num_samples=G instead."
            )
        if pad_token_id is None and tokenizer is not None:
            pad_token_id = (
                tokenizer.pad_token_id
                if tokenizer.pad_token_id is not None
                else tokenizer.eos_token_id
            )
        if pad_output and pad_token_id is None:
            raise ConfigurationError(
                "pad_output=True needs a pad id; pass pad_token_id= or a tokenizer."
            )
        if num_samples is not None:
            sampling["n"] = num_samples
        if return_prompt_log_probs:
            sampling["prompt_logprobs"] = 0
        if input_mode == "tokens":
            sampling.setdefault("detokenize", False)  # nobody reads the text: skip the work
        else:
            # Text that decodes exactly to the tokens (EOS included), as TorchRL's wrapper.
            sampling.setdefault("skip_special_tokens", False)
        self.service = service
        self.input_mode = input_mode
        self.generate = generate
        self.pad_output = pad_output
        self.num_samples = num_samples
        self.tokenizer = tokenizer
        self.pad_token_id = pad_token_id
        self.return_prompt_log_probs = return_prompt_log_probs
        self.return_log_probs = True
        self.attention_mask_key = attention_mask_key
        self.seed_key = seed_key
        self.timeout = timeout
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.layout = None if pad_output else torch.strided
        self.keys = OutputKeys(tokens_key, log_probs_key, masks_key, text_key, history_key)
        self.tokens_key, self.log_probs_key, self.masks_key = tokens_key, log_probs_key, masks_key
        self.text_key, self.history_key = text_key, history_key
        self.sampling_params = sampling
        self._init_args = {
            "input_mode": input_mode,
            "generate": generate,
            "pad_output": pad_output,
            "num_samples": num_samples,
            "sampling_params": sampling_params,
            "tokenizer": tokenizer,
            "pad_token_id": pad_token_id,
            "return_prompt_log_probs": return_prompt_log_probs,
            "attention_mask_key": attention_mask_key,
            "seed_key": seed_key,
            "timeout": timeout,
            "chat_template_kwargs": chat_template_kwargs,
            "tokens_key": tokens_key,
            "log_probs_key": log_probs_key,
            "masks_key": masks_key,
            "text_key": text_key,
            "history_key": history_key,
        }
        mode_key = {"tokens": tokens_key, "text": text_key, "history": history_key}[input_mode]
        self.in_keys = [(mode_key, "prompt" if generate else "full")]
        out = [masks_key, tokens_key, log_probs_key]
        if input_mode != "tokens":
            out.insert(0, text_key)
        if input_mode == "history":
            out.append(history_key)
        if generate:
            out.append(self.keys.extra)
        self.out_keys = out
        self._max_token_id: int | None = None
        self._collector = None

    # ------------------------------------------------------------------ TorchRL hooks
    def get_new_version(self, **kwargs) -> VLLMPolicy:
        """A policy on the same service with some constructor arguments changed.

        TorchRL's ``RetrieveKL("from_collector")`` calls it with ``generate=False``;
        TorchRL-only arguments it passes (``return_log_probs``, ``input_key``) are checked
        and dropped.
        """
        if not kwargs.pop("return_log_probs", True):
            raise ConfigurationError("VLLMPolicy always returns log-probs.")
        input_key = kwargs.pop("input_key", None)
        args = {**self._init_args, **kwargs}
        if args["num_samples"] is not None and not args["generate"]:
            args["num_samples"] = None
        policy = VLLMPolicy(self.service, **args)
        if input_key is not None and policy.in_keys[0] != tuple(input_key):
            raise ConfigurationError(
                f"input_key={input_key!r} differs from this policy's {policy.in_keys[0]!r}; "
                "change input_mode or the *_key arguments instead."
            )
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
        plan = self._prepare(tensordict, sampling_overrides)
        data = self.service.generate_batch(plan.prompts, plan.params, timeout=self.timeout)
        return self._finish(plan, data)

    async def aforward(self, tensordict: TensorDictBase, **sampling_overrides) -> TensorDictBase:
        """Awaitable :meth:`forward`: many calls can be in flight at once on the service."""
        with set_list_to_stack(True):
            plan = self._prepare(tensordict, sampling_overrides)
        data = await self.service.agenerate_batch(plan.prompts, plan.params, timeout=self.timeout)
        with set_list_to_stack(True):
            return self._finish(plan, data)

    # ------------------------------------------------------------------ steps
    def _prepare(self, td: TensorDictBase, overrides: Mapping[str, Any]) -> _Plan:
        if not isinstance(td, TensorDictBase):
            raise InvalidRequestError(
                f"VLLMPolicy takes a TensorDict, got {type(td).__name__}; wrap your prompts, e.g. "
                f'TensorDict({{("tokens", "prompt"): ids}}, batch_size=[len(ids)]).'
            )
        key = self.in_keys[0]
        plan = _Plan(td=td, prompts=[], params={})
        if self.input_mode == "tokens":
            plan.prompts = inputs.read_tokens(td, key, self.attention_mask_key, self.pad_token_id)
        elif self.input_mode == "text":
            plan.prompt_texts = inputs.read_texts(td, key)
            plan.prompts = self._tokenize(plan.prompt_texts)
        else:
            plan.histories = inputs.read_histories(inputs.rows_of(td), key)
            plan.prompt_texts = [
                h.apply_chat_template(
                    tokenizer=self.tokenizer,
                    add_generation_prompt=self.generate,
                    **self.chat_template_kwargs,
                )
                for h in plan.histories
            ]
            plan.prompts = self._tokenize(plan.prompt_texts, add_special_tokens=False)
        inputs.check_vocab(plan.prompts, key, self._vocab_max())
        plan.params = self._params(td, overrides, len(plan.prompts))
        return plan

    def _tokenize(self, texts: list[str], add_special_tokens: bool = True) -> list[np.ndarray]:
        ids = self.tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]
        return [np.asarray(x, dtype=np.int64) for x in ids]

    def _vocab_max(self) -> int | None:
        if self._max_token_id is None:
            self._max_token_id = self.service.max_token_id
        return self._max_token_id

    def _params(self, td: TensorDictBase, overrides: Mapping[str, Any], n: int):
        if not self.generate:
            return dict(_SCORE_PARAMS)
        if "n" in overrides:
            raise InvalidRequestError(
                "n cannot be overridden per call; build the policy with num_samples=G."
            )
        params = {**self.sampling_params, **overrides}
        seeds = td.get(self.seed_key, None) if self.seed_key is not None else None
        if seeds is None:
            return params
        if not isinstance(seeds, torch.Tensor) or seeds.dtype.is_floating_point:
            raise InvalidRequestError(
                f"{inputs.key_str(self.seed_key)} must be an integer tensor (one seed per element), "
                f"got {getattr(seeds, 'dtype', type(seeds).__name__)}."
            )
        seeds = seeds.reshape(-1).tolist()
        if len(seeds) != n:
            raise InvalidRequestError(
                f"{inputs.key_str(self.seed_key)} holds {len(seeds)} seeds for {n} prompts; give "
                "one int per batch element (shape = batch size)."
            )
        return [{**params, "seed": int(s)} for s in seeds]

    def _finish(self, plan: _Plan, data) -> TensorDictBase:
        td, keys = plan.td, self.keys
        shape = td.batch_size
        if not self.generate:
            out = self._scored(plan, data)
        else:
            flat = convert.flatten(data)
            if self.pad_output:
                out = convert.generated_padded(
                    flat, self.pad_token_id, keys, self.return_prompt_log_probs
                )
            else:
                out = convert.generated_rows(flat, keys, self.return_prompt_log_probs)
            if self.input_mode != "tokens":
                self._add_text(out, plan, flat)
        if self.num_samples is not None:
            shape = torch.Size([*shape, self.num_samples])
            return _shaped(out, shape)
        out_keys = list(self.out_keys)
        if isinstance(out, list):  # ragged rows: merge into the input's rows
            if isinstance(td, LazyStackedTensorDict) and td.batch_dims == 1:
                # In place, as TorchRL's wrappers: the caller's lazy stack holds the outputs.
                for row, new in zip(td.tensordicts, out, strict=True):
                    row.exclude(*out_keys, inplace=True).update(new)
                return td
            merged = []
            for row, new in zip(inputs.rows_of(td), out, strict=True):
                keep = {k: v for k, v in row.items() if k not in out_keys}
                merged.append(convert._td({**keep, **dict(new.items())}))
            return _shaped(merged, shape)
        out = out.reshape(shape) if shape else out[0]
        return td.exclude(*out_keys, inplace=True).update(out, keys_to_update=out_keys)

    def _scored(self, plan: _Plan, data):
        td, keys = plan.td, self.keys
        prompt_key, asst_key = (keys.tokens, "prompt"), (keys.masks, "all_assistant_mask")
        if self.pad_output:
            full = _dense(td, self.in_keys[0]) if self.input_mode == "tokens" else None
            if full is None:  # ragged or non-token input: pad what was scored
                full = _left_padded(plan.prompts, self.pad_token_id)
                mask = _left_mask(plan.prompts)
            else:
                full = full.reshape(-1, full.shape[-1])
                mask = _dense(td, self.attention_mask_key)
                mask = torch.ones_like(full, dtype=torch.bool) if mask is None else mask
                mask = mask.reshape(full.shape).bool()
            prompt = _dense(td, prompt_key)
            width = prompt.shape[-1] if prompt is not None else None
            assistant = _dense(td, asst_key)
            if assistant is not None and assistant.numel() == full.numel():
                assistant = assistant.reshape(full.shape).bool()
            else:
                assistant = None
            return convert.scored_padded(full, mask, data, width, assistant, keys)
        lengths = None
        if prompt_key in td.keys(True):
            prompts = inputs.read_tokens(td, prompt_key, None, None)
            lengths = np.fromiter((len(p) for p in prompts), dtype=np.int64, count=len(prompts))
        asst = None
        if asst_key in td.keys(True):
            asst = list(flatten_rows(td.get(asst_key, as_list=True)))
            if len(asst) != len(plan.prompts) or any(
                len(a) != len(p) for a, p in zip(asst, plan.prompts, strict=True)
            ):
                asst = None  # a mask of a padded input does not align with the scored rows
        return convert.scored_rows(plan.prompts, data, lengths, asst, keys)

    def _add_text(self, out, plan: _Plan, flat) -> None:
        """Text (and chat history) fields: decoded by vLLM, not re-tokenised here."""
        from torchrl.data.llm import History
        from torchrl.modules.llm.policies import ChatHistory, Text

        g = self.num_samples or 1
        prompt_texts = [t for t in plan.prompt_texts for _ in range(g)]
        responses = flat.texts
        keys = self.keys
        histories = None
        if plan.histories is not None:
            eos = self.tokenizer.eos_token or ""
            histories = []
            for i, (text, reason) in enumerate(zip(responses, flat.finish_reasons, strict=True)):
                content = text.removesuffix(eos) if eos else text
                reply = History(role="assistant", content=content, is_complete=reason == "stop")
                prompt = plan.histories[i // g]
                histories.append((prompt, reply.unsqueeze(0), prompt.append(reply, inplace=False)))
        if isinstance(out, list):
            for i, row in enumerate(out):
                p, r = prompt_texts[i], responses[i]
                row.set(
                    keys.text,
                    Text(prompt=NonTensorData(p), response=NonTensorData(r), full=p + r),
                )
                if histories is not None:
                    prompt, reply, full = histories[i]
                    row.set(keys.history, ChatHistory(prompt=prompt, response=reply, full=full))
            return
        out.set(
            keys.text,
            Text(
                prompt=convert.strings(prompt_texts),
                response=convert.strings(responses),
                full=convert.strings([p + r for p, r in zip(prompt_texts, responses, strict=True)]),
                batch_size=out.batch_size,
            ),
        )
        if histories is not None:
            from tensordict import lazy_stack

            out.set(
                keys.history,
                lazy_stack([ChatHistory(prompt=p, response=r, full=f) for p, r, f in histories]),
            )


def _dense(td: TensorDictBase, key) -> torch.Tensor | None:
    """The dense tensor under ``key``; None when absent, ragged or nested."""
    if key not in td.keys(True):
        return None
    try:
        value = td.get(key)
    except RuntimeError:  # ragged rows
        return None
    if not isinstance(value, torch.Tensor) or value.is_nested:
        return None
    return value


def _left_padded(seqs: Sequence[np.ndarray], pad: int) -> torch.Tensor:
    lengths = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
    return torch.from_numpy(convert._left_pad(seqs, lengths, pad, np.int64))


def _left_mask(seqs: Sequence[np.ndarray]) -> torch.Tensor:
    lengths = torch.tensor([len(s) for s in seqs])
    width = int(lengths.max())
    return torch.arange(width) >= (width - lengths)[:, None]


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


__all__ = ["VLLMPolicy"]

"""PolicyOptions: every option of :class:`~torchrl_vllm_ext.VLLMPolicy`, declared once.

``VLLMPolicy(service, **options)`` builds one with :meth:`PolicyOptions.from_kwargs`
(which folds TorchRL's ``generate_kwargs`` in and fills derived defaults); the options
are frozen, every check runs at construction, so a policy that exists can run, and the
policy reads its options from here only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torchrl_vllm_ext.errors import ConfigurationError
from torchrl_vllm_ext.hf import pad_token_id as default_pad_id
from torchrl_vllm_ext.wrappers.layout import OutputKeys

INPUT_MODES = ("tokens", "text", "history")
SCORE_PARAMS = {"max_tokens": 1, "prompt_logprobs": 0, "detokenize": False}
"""vLLM sampling parameters of a scoring call: prompt log-probs, one ignored token."""

NestedKey = str | tuple[str, ...]
HF_NAMES = {
    "max_new_tokens": "max_tokens",
    "num_return_sequences": "n",
    "stop_sequences": "stop",
}
"""Hugging Face ``generate`` names in ``generate_kwargs`` -> vLLM ``SamplingParams`` names."""


@dataclass(frozen=True)
class PolicyOptions:
    """How a :class:`~torchrl_vllm_ext.VLLMPolicy` reads, generates and writes (frozen).

    Examples:
        >>> opts = PolicyOptions(input_mode="tokens", num_samples=4, sampling_params={"max_tokens": 8})
        >>> opts.engine_sampling()
        {'max_tokens': 8, 'n': 4, 'detokenize': False}
        >>> opts = PolicyOptions.from_kwargs(
        ...     input_mode="tokens", generate_kwargs={"max_new_tokens": 8, "n": 2}
        ... )
        >>> opts.sampling_params, opts.num_samples
        ({'max_tokens': 8}, 2)
    """

    input_mode: str = "history"
    """``"history"`` (TorchRL's default: chat histories), ``"text"`` or ``"tokens"``."""
    generate: bool = True
    """Generate (True) or score the given sequences (False)."""
    pad_output: bool = False
    """Dense padded output (True) or ragged rows (False)."""
    num_samples: int | None = None
    """Samples per prompt ``G``; adds a trailing batch dim of size ``G``."""
    sampling_params: Mapping[str, Any] | None = None
    """vLLM ``SamplingParams`` fields (``max_tokens``, ``temperature``, ...); a call can
    override them: ``policy(td, temperature=0)``."""
    input_key: NestedKey | None = None
    """Where the input is read (default ``(mode, "prompt")``, or ``(mode, "full")`` when
    scoring); a flat key such as ``"text"`` (strings), ``"history"`` (a ``History``) or
    ``"input_ids"`` works as in TorchRL's wrapper."""
    inplace: bool | str | None = None
    """TorchRL's meaning: True writes the output into the input TensorDict (the default
    for one sample per prompt), False returns a new TensorDict of the output keys only
    (the default, and the only choice, with ``num_samples``), ``"empty"`` writes into an
    empty TensorDict shaped like the input."""
    prefer_tokens: bool = False
    """History mode (TorchRL's name): generate from ``(tokens_key, "prompt")`` when the
    input has it (:class:`~torchrl_vllm_ext.envs.ScriptedChat` keeps it), not from the re-tokenised
    history: multi-turn token-in / token-out, so a turn's context holds exactly the
    tokens earlier turns sampled."""
    tokenizer: Any = None
    """A Hugging Face tokenizer; required by text and history modes (``VLLMPolicy`` takes
    the service's, ``service.get_tokenizer()``, when none is given, as TorchRL's wrapper)."""
    pad_token_id: int | None = None
    """Pad id of padded outputs and inputs (default: the tokenizer's, else its EOS)."""
    return_log_probs: bool = True
    """Write ``log_probs`` (TorchRL's ``return_log_probs``); scoring needs it True."""
    return_prompt_log_probs: bool = False
    """Also compute prompt log-probs while generating."""
    attention_mask_key: NestedKey = ("masks", "all_attention_mask")
    """Where a padded token input's bool mask is read."""
    seed_key: NestedKey | None = "seed"
    """An int per element under this key seeds that element's sampling."""
    timeout: float | None = None
    """Seconds per call (the requests are aborted in vLLM on expiry)."""
    lora: Any = None
    """A LoRA adapter the service serves (``service.add_lora(name, path)``): generate and
    score with it; an :class:`~torchrl_vllm_ext.weight_sync.adapters.AdapterSync`: its
    newest pushed version at each call; None: the base weights."""
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Extra ``apply_chat_template`` arguments (history mode)."""
    tokens_key: str = "tokens"
    """Top-level key of ``Tokens``."""
    log_probs_key: str = "log_probs"
    """Top-level key of ``LogProbs``."""
    masks_key: str = "masks"
    """Top-level key of ``Masks``."""
    text_key: str = "text"
    """Top-level key of ``Text`` (text and history modes)."""
    history_key: str = "history"
    """Top-level key of ``ChatHistory`` (history mode)."""

    def __post_init__(self):
        if self.input_mode not in INPUT_MODES:
            raise ConfigurationError(
                f"input_mode={self.input_mode!r} is not one of {INPUT_MODES}; pick the one "
                "your data has."
            )
        if self.input_mode != "tokens" and self.tokenizer is None:
            raise ConfigurationError(
                f"input_mode={self.input_mode!r} needs a tokenizer to turn {self.input_mode} "
                "into token ids; pass tokenizer= (VLLMPolicy reads service.get_tokenizer()), or "
                "input_mode='tokens' for token-id prompts."
            )
        n = self.num_samples
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise ConfigurationError(f"num_samples={n!r} must be None or an int >= 1.")
        if n is not None and not self.generate:
            raise ConfigurationError("num_samples applies to generation; use generate=True.")
        if not isinstance(self.sampling_params, Mapping | None):
            raise ConfigurationError(
                f"sampling_params must be a dict of vllm.SamplingParams fields, got "
                f"{type(self.sampling_params).__name__}; e.g. {{'max_tokens': 32, 'temperature': 1.0}}."
            )
        if "n" in (self.sampling_params or {}):
            raise ConfigurationError(
                "sampling_params['n'] is set by num_samples; pass num_samples=G instead."
            )
        if self.inplace not in (None, True, False, "empty"):
            raise ConfigurationError(
                f"inplace={self.inplace!r} must be True, False, 'empty' or None (TorchRL's values)."
            )
        if self.num_samples is not None and self.inplace in (True, "empty"):
            raise ConfigurationError(
                f"inplace={self.inplace!r} with num_samples={self.num_samples}: the output has a "
                "new (batch, num_samples) shape; use inplace=False or leave it None."
            )
        if not self.return_log_probs and not self.generate:
            raise ConfigurationError(
                "return_log_probs=False with generate=False: scoring returns log-probs and "
                "nothing else; use return_log_probs=True (as TorchRL's wrappers require)."
            )
        if self.pad_output and self.pad_token_id is None:
            raise ConfigurationError(
                "pad_output=True needs a pad id; pass pad_token_id= or a tokenizer."
            )
        if self.generate:  # bad sampling values fail here, not at the first call
            from torchrl_vllm_ext.engine.validation import make_sampling_params
            from torchrl_vllm_ext.errors import InvalidRequestError

            try:
                make_sampling_params(self.engine_sampling())
            except InvalidRequestError as e:
                raise ConfigurationError(str(e)) from e

    @classmethod
    def from_kwargs(cls, generate_kwargs: Mapping[str, Any] | None = None, **fields):
        """Options from :class:`~torchrl_vllm_ext.VLLMPolicy`'s keywords.

        ``generate_kwargs`` is TorchRL's ``vLLMWrapper`` name for ``sampling_params``:
        Hugging Face names are translated (``max_new_tokens``, ``num_return_sequences``
        or ``n`` -> ``num_samples``, ``do_sample=False`` -> greedy, ``stop_sequences``);
        other keys are vLLM fields. ``pad_token_id`` defaults to the tokenizer's.
        """
        if generate_kwargs:
            fields.update(
                fold_generate_kwargs(
                    dict(generate_kwargs), fields.get("sampling_params"), fields.get("num_samples")
                )
            )
        if fields.get("pad_token_id") is None:
            fields["pad_token_id"] = default_pad_id(fields.get("tokenizer"))
        fields["chat_template_kwargs"] = dict(fields.get("chat_template_kwargs") or {})
        return cls(**fields)

    def replace(self, **changes) -> PolicyOptions:
        """A copy with ``changes`` (``generate_kwargs`` too), checked again."""
        current = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return PolicyOptions.from_kwargs(**{**current, **changes})

    @property
    def keys(self) -> OutputKeys:
        return OutputKeys(
            self.tokens_key, self.log_probs_key, self.masks_key, self.text_key, self.history_key
        )

    @property
    def read_key(self) -> NestedKey:
        """Where the prompts (or, scoring, the whole sequences) are read."""
        if self.input_key is not None:
            return self.input_key
        top = {"tokens": self.tokens_key, "text": self.text_key, "history": self.history_key}
        return (top[self.input_mode], "prompt" if self.generate else "full")

    @property
    def output_keys(self) -> list:
        """The top-level keys a call writes (TorchRL's order)."""
        out = [self.masks_key, self.tokens_key]
        if self.return_log_probs:
            out.append(self.log_probs_key)
        if self.input_mode != "tokens":
            out.insert(0, self.text_key)
        if self.input_mode == "history":
            out.append(self.history_key)
        if self.generate:
            out.append(self.keys.extra)
        return out

    def engine_sampling(self) -> dict[str, Any]:
        """The vLLM sampling fields of a generation call (before per-call overrides)."""
        sampling = dict(self.sampling_params or {})
        if self.num_samples is not None:
            sampling["n"] = self.num_samples
        if self.return_prompt_log_probs:
            sampling["prompt_logprobs"] = 0
        if self.input_mode == "tokens":
            sampling.setdefault("detokenize", False)  # nobody reads the text: skip the work
        else:
            # Text that decodes exactly to the tokens (EOS included), as TorchRL's wrapper.
            sampling.setdefault("skip_special_tokens", False)
        return sampling


def fold_generate_kwargs(
    kwargs: dict[str, Any], sampling_params: Any, num_samples: int | None
) -> dict[str, Any]:
    """TorchRL's ``generate_kwargs`` as ``sampling_params`` and ``num_samples`` fields.

    Examples:
        >>> fold_generate_kwargs({"max_new_tokens": 4, "do_sample": False}, None, None)
        {'sampling_params': {'max_tokens': 4, 'temperature': 0.0}, 'num_samples': None}
    """
    for hf_name, name in HF_NAMES.items():
        if hf_name in kwargs:
            if name in kwargs:
                raise ConfigurationError(
                    f"generate_kwargs gives both {hf_name!r} and {name!r}; pass one."
                )
            kwargs[name] = kwargs.pop(hf_name)
    n = kwargs.pop("n", None)
    if n is not None:
        if num_samples not in (None, n):
            raise ConfigurationError(
                f"generate_kwargs n={n!r} differs from num_samples={num_samples!r}."
            )
        if not isinstance(n, int) or n < 1:
            raise ConfigurationError(f"generate_kwargs n={n!r} must be an int >= 1.")
        num_samples = n
    if kwargs.pop("do_sample", True) is False:
        if kwargs.get("temperature", 0.0) != 0.0:
            raise ConfigurationError(
                f"do_sample=False is greedy decoding but temperature={kwargs['temperature']!r}; "
                "drop one of them."
            )
        kwargs["temperature"] = 0.0
    if not isinstance(sampling_params, Mapping | None):  # PolicyOptions names the fix
        return {"num_samples": num_samples}
    both = sorted(set(kwargs) & set(sampling_params or {}))
    if both:
        raise ConfigurationError(
            f"{both} given in both sampling_params and generate_kwargs; pass each once."
        )
    return {"sampling_params": {**(sampling_params or {}), **kwargs}, "num_samples": num_samples}


OPTION_NAMES = frozenset(f.name for f in dataclasses.fields(PolicyOptions))
"""The fields of :class:`PolicyOptions` (what ``VLLMPolicy`` takes, with ``generate_kwargs``)."""

__all__ = ["INPUT_MODES", "OPTION_NAMES", "SCORE_PARAMS", "PolicyOptions", "fold_generate_kwargs"]

"""GenerateCalls: the service's three ways to generate, and the tokenizer they encode
text prompts with.

* ``generate``: as ``vllm.LLM.generate`` (and TorchRL's ``AsyncVLLM.generate``): every
  prompt form in, vLLM ``RequestOutput``s out;
* ``generate_request_data``: every prompt form in, plain
  :class:`~torchrl_vllm_ext.messages.RequestData` out;
* ``generate_request_batch``: token ids in, one columnar
  :class:`~torchrl_vllm_ext.batches.RequestBatch` out (the hot path ``VLLMPolicy`` takes).

All three run :meth:`Generation.run <.generation.Generation.run>`. A part of
:class:`~torchrl_vllm_ext.VLLMService`, which makes each coroutine a blocking method and
its ``a``-prefixed form (:func:`~torchrl_vllm_ext.engine.handles.owner.sync_and_async`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from torchrl_vllm_ext.batches import RequestBatch
from torchrl_vllm_ext.engine.config import ServiceConfig
from torchrl_vllm_ext.engine.driver.generation import Generation
from torchrl_vllm_ext.engine.driver.prompt_forms import encode_texts, one_of, parse_prompts
from torchrl_vllm_ext.engine.driver.torchrl_engine import lora_name, request_outputs
from torchrl_vllm_ext.hf import load_tokenizer
from torchrl_vllm_ext.messages import RequestData


class GenerateCalls:
    """The generate calls over one :class:`~.generation.Generation`.

    Args:
        generation: routes, sends, retries and merges the batches.
        config: the service's configuration (the model, its ``tokenizer``).
        name: the service's name (the prefix of vLLM request ids in ``RequestOutput``).
    """

    def __init__(self, generation: Generation, config: ServiceConfig, name: str):
        self._generation = generation
        self.config = config
        self.name = name
        self._tokenizer = None  # loaded at the first text prompt, not for token prompts

    async def generate(
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
        parsed = parse_prompts(one_of(prompts, prompt_token_ids), encode)
        batch = await self._generation.run(
            parsed.token_ids, sampling_params, timeout, routing, lora_name(lora, lora_request)
        )
        return request_outputs(batch, parsed.texts, sampling_params, self.name)

    async def generate_request_data(
        self, prompts, sampling_params=None, *, timeout=None, routing=None, lora=None
    ) -> list[RequestData]:
        """Like :meth:`generate` (every prompt form) but returns plain :class:`RequestData`
        (numpy arrays)."""
        parsed = parse_prompts(prompts, self._encode)
        batch = await self._generation.run(
            parsed.token_ids, sampling_params, timeout, routing, lora
        )
        return batch.unpack()

    async def generate_request_batch(
        self,
        prompt_token_ids,
        sampling_params=None,
        *,
        timeout=None,
        routing=None,
        lora=None,
        return_log_probs: bool = True,
        seeds=None,
    ) -> RequestBatch:
        """Like :meth:`generate` but returns one :class:`RequestBatch` of flat arrays, in
        input order: the fastest form, which ``VLLMPolicy`` converts to a TensorDict.
        ``prompt_token_ids`` is a list of token-id sequences (no text: the hot path).

        ``return_log_probs=False`` skips vLLM's sampled-token log-probs (NaN in the batch).
        ``seeds``: one int per prompt (an int64 array), each seeding its prompt's sampling
        (``sampling_params`` then hold no seed); it stays one array up to the replica.
        """
        return await self._generation.run(
            prompt_token_ids, sampling_params, timeout, routing, lora, return_log_probs, seeds
        )

    def get_tokenizer(self):
        """The served model's tokenizer (``transformers.AutoTokenizer``, loaded once): what
        TorchRL's ``vLLMWrapper`` and :class:`~torchrl_vllm_ext.VLLMPolicy` read by default."""
        if self._tokenizer is None:
            source = self.config.engine_kwargs.get("tokenizer") or self.config.model
            self._tokenizer = load_tokenizer(source, "tokenizer")
        return self._tokenizer

    @property
    def routing(self) -> tuple[str, ...]:
        """The routing strategies a batch uses unless it names others."""
        return self._generation.routing

    def _encode(self, texts: list[str], tokenization_kwargs=None) -> list[list[int]]:
        return encode_texts(self.get_tokenizer(), texts, tokenization_kwargs)


GENERATE_CALLS = ["generate", "generate_request_data", "generate_request_batch"]
"""The coroutines the service makes blocking methods and ``a``-prefixed forms of."""
READERS = ["get_tokenizer", "routing"]
"""The :class:`GenerateCalls` names the service exposes as they are."""

__all__ = ["GENERATE_CALLS", "READERS", "GenerateCalls"]

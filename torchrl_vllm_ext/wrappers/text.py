"""Text and chat-history fields of the output (text and history input modes).

The response text is vLLM's own detokenisation of the generated ids (special tokens
kept, so it decodes exactly to the tokens, as TorchRL's wrapper), never a
re-tokenisation here; a chat reply is that text without its EOS token.
"""

from __future__ import annotations

from tensordict import NonTensorData, TensorDict, lazy_stack

from torchrl_vllm_ext.batches import RequestBatch
from torchrl_vllm_ext.wrappers.layout import OutputKeys, texts


def add_text(
    out: list[TensorDict] | TensorDict,
    batch: RequestBatch,
    prompt_texts: list[str],
    histories: list | None,
    samples: int,
    eos_token: str | None,
    keys: OutputKeys,
) -> None:
    """Write ``Text`` (and ``ChatHistory`` when ``histories``) into ``out``, in place.

    ``out`` is a list of per-sample rows (unpadded) or one ``(N,)`` TensorDict
    (padded); prompt ``i`` has ``samples`` consecutive samples.
    """
    from torchrl.data.llm import History
    from torchrl.modules.llm.policies import ChatHistory, Text

    prompts = [t for t in prompt_texts for _ in range(samples)]
    responses = batch.texts
    chats = None
    if histories is not None:
        chats = []
        for i, (text, reason) in enumerate(zip(responses, batch.finish_reasons, strict=True)):
            content = text.removesuffix(eos_token) if eos_token else text
            reply = History(role="assistant", content=content, is_complete=reason == "stop")
            prompt = histories[i // samples]
            chats.append((prompt, reply.unsqueeze(0), prompt.append(reply, inplace=False)))
    if isinstance(out, list):
        for i, row in enumerate(out):
            p, r = prompts[i], responses[i]
            row.set(keys.text, Text(prompt=NonTensorData(p), response=NonTensorData(r), full=p + r))
            if chats is not None:
                prompt, reply, full = chats[i]
                row.set(keys.history, ChatHistory(prompt=prompt, response=reply, full=full))
        return
    out.set(
        keys.text,
        Text(
            prompt=texts(prompts),
            response=texts(responses),
            full=texts([p + r for p, r in zip(prompts, responses, strict=True)]),
            batch_size=out.batch_size,
        ),
    )
    if chats is not None:
        out.set(
            keys.history,
            lazy_stack([ChatHistory(prompt=p, response=r, full=f) for p, r, f in chats]),
        )


def add_scored_text(
    out: list[TensorDict] | TensorDict,
    full_texts: list[str],
    histories: list | None,
    keys: OutputKeys,
) -> None:
    """Scoring keeps what it scored, as TorchRL's wrappers: ``text.full`` (the chat-templated
    string in history mode) and ``history.full``, in place."""
    from torchrl.modules.llm.policies import ChatHistory, Text

    if isinstance(out, list):
        for i, row in enumerate(out):
            row.set(keys.text, Text(full=NonTensorData(full_texts[i])))
            if histories is not None:
                row.set(keys.history, ChatHistory(full=histories[i]))
        return
    out.set(keys.text, Text(full=texts(full_texts), batch_size=out.batch_size))
    if histories is not None:
        out.set(keys.history, lazy_stack([ChatHistory(full=h) for h in histories]))

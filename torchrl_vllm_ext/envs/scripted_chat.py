"""ScriptedChat: a multi-turn task on TorchRL's own ChatEnv, with scripted user turns.

TorchRL's ``ChatEnv`` (history mode) makes the policy's reply the next prompt and stops
there: it never adds a user turn or ends an episode. This transform plays the user:
each reset opens every row's dialog with a query, each step appends the next scripted
user message until the dialog has ``turns`` assistant replies, then ends it.

Token-in / token-out: the transform also keeps ``("tokens", "prompt")``, as TorchRL's
``IncrementalTokenizer`` would (which, in TorchRL 0.14, cannot read a ragged
``("tokens", "full")``): the opening prompt's template tokens on reset, then the reply's
``("tokens", "full")`` plus the user turn's template tokens. With
``VLLMPolicy(..., prefer_tokens=True)`` every turn's context is then exactly the tokens
the engine sampled in the earlier turns; nothing is re-tokenised.
"""

from __future__ import annotations

import torch
from tensordict import NonTensorStack, TensorDict, TensorDictBase, lazy_stack
from torchrl.data import Bounded
from torchrl.data.llm import History
from torchrl.envs import Transform

SENTINEL = "\x00reply\x00"


def user_turn_tokens(tokenizer, message: str, after_eos: bool) -> list[int]:
    """The template's tokens between an assistant reply and the next one: the end of the
    reply (unless the reply already ended with EOS), the user ``message``, and the
    generation prompt of the next reply."""
    text = tokenizer.apply_chat_template(
        [{"role": "assistant", "content": SENTINEL}, {"role": "user", "content": message}],
        tokenize=False,
        add_generation_prompt=True,
    )
    delta = text.split(SENTINEL, 1)[1]
    eos = tokenizer.eos_token
    if after_eos and eos and delta.startswith(eos):
        delta = delta[len(eos) :]
    return tokenizer(delta, add_special_tokens=False)["input_ids"]


def _set_ragged(td: TensorDictBase, key, rows: list[torch.Tensor]) -> None:
    """One 1-D tensor per row of ``td`` under ``key`` (as TorchRL's ``IncrementalTokenizer``:
    a nested tensor, read back with ``get(key, as_list=True)``)."""
    rows = [r.to(torch.int64) for r in rows]
    td.set(key, torch.nested.as_nested_tensor(rows) if td.batch_dims else rows[0])


class ScriptedChat(Transform):
    """Opening queries on reset, scripted user turns on step, ``done`` after ``turns`` replies.

    Args:
        tokenizer: the policy's tokenizer (its chat template renders the user turns).
        queries: opening user messages; row ``i`` of reset ``k`` takes
            ``queries[(k * batch + i) % len(queries)]``.
        follow_ups: the user's later messages, in order (the last one repeats).
        turns: assistant replies per dialog; the step that receives the last one sets
            ``done`` and ``terminated``.
    """

    def __init__(self, tokenizer, queries: list[str], follow_ups: list[str], *, turns: int = 2):
        super().__init__()
        if turns < 1 or not queries or not follow_ups:
            raise ValueError("ScriptedChat needs turns >= 1, queries and follow_ups.")
        self.tokenizer = tokenizer
        self.queries, self.follow_ups, self.turns = list(queries), list(follow_ups), turns
        self._resets = 0
        self._turn_tokens: dict[tuple[str, bool], torch.Tensor] = {}

    def transform_observation_spec(self, observation_spec):
        observation_spec[("tokens", "prompt")] = Bounded(
            0,
            len(self.tokenizer),
            shape=(*observation_spec.shape, -1),
            dtype=torch.int64,
            device=observation_spec.device,
        )
        return observation_spec

    def _reset_env_preprocess(self, tensordict: TensorDictBase | None) -> TensorDictBase:
        batch = self.parent.batch_size
        n = batch.numel()
        start = self._resets * n
        self._resets += 1
        picked = [self.queries[(start + i) % len(self.queries)] for i in range(n)]
        query = NonTensorStack.from_list(picked).reshape(batch) if batch else picked[0]
        if tensordict is None:
            tensordict = TensorDict(batch_size=batch)
        tensordict.set("query", query)
        return tensordict

    def _reset(self, tensordict: TensorDictBase, tensordict_reset: TensorDictBase):
        rows = tensordict_reset.unbind(0) if tensordict_reset.batch_dims else [tensordict_reset]
        ids = []
        for row in rows:
            text = row.get(("history", "prompt")).apply_chat_template(
                tokenizer=self.tokenizer, add_generation_prompt=True
            )
            ids.append(torch.tensor(self.tokenizer(text, add_special_tokens=False)["input_ids"]))
        _set_ragged(tensordict_reset, ("tokens", "prompt"), ids)
        return tensordict_reset

    def _user_turn(self, message: str, after_eos: bool) -> torch.Tensor:
        """:func:`user_turn_tokens`, rendered once per message (every row repeats them)."""
        key = (message, after_eos)
        if key not in self._turn_tokens:
            ids = user_turn_tokens(self.tokenizer, message, after_eos=after_eos)
            self._turn_tokens[key] = torch.tensor(ids, dtype=torch.int64)
        return self._turn_tokens[key]

    def _step(self, tensordict: TensorDictBase, next_tensordict: TensorDictBase):
        history = next_tensordict.get("history")  # ChatEnv: prompt = the finished turn
        prompts = list(history.prompt.unbind(0))
        tokens = tensordict.get(("tokens", "full"), as_list=True, default=None)
        eos = self.tokenizer.eos_token_id
        done, new_prompts, new_tokens = [], [], []
        for i, prompt in enumerate(prompts):
            replies = sum(role == "assistant" for role in prompt.role)
            finished = replies >= self.turns
            done.append(finished)
            if finished:
                new_prompts.append(prompt)
                if tokens is not None:
                    new_tokens.append(tokens[i])
                continue
            message = self.follow_ups[min(replies - 1, len(self.follow_ups) - 1)]
            new_prompts.append(
                prompt.append(History(role="user", content=message), inplace=False, dim=-1)
            )
            if tokens is not None:
                ids = tokens[i]
                extra = self._user_turn(message, after_eos=bool(len(ids) and int(ids[-1]) == eos))
                new_tokens.append(torch.cat([ids, extra.to(ids.dtype)]))
        history.prompt = lazy_stack(new_prompts)
        next_tensordict.set("history", history)
        if tokens is not None:
            _set_ragged(next_tensordict, ("tokens", "prompt"), new_tokens)
        flags = torch.tensor(done, dtype=torch.bool).reshape(*next_tensordict.batch_size, 1)
        next_tensordict.set("done", flags)
        next_tensordict.set("terminated", flags.clone())
        return next_tensordict


__all__ = ["ScriptedChat", "user_turn_tokens"]

"""TokenTaskEnv: the base of the one-step token tasks (prompt ids in, verifiable reward out).

A subclass draws prompts and their answers and scores a response; the base owns the
TorchRL side: specs, seeding, GRPO groups, and the LLM env layout of TorchRL's own
``ChatEnv`` in tokens mode.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.data import Bounded, Composite, Unbounded
from torchrl.envs import EnvBase
from torchrl.modules.llm.policies import Tokens

from torchrl_vllm_ext.errors import ConfigurationError
from torchrl_vllm_ext.wrappers.inputs import flatten_rows

SEED_HIGH = 2**31  # vLLM takes any int seed; int32 keeps it portable


class TokenTaskEnv(EnvBase):
    """One dialog turn on token ids: reset poses prompts, step scores ``("tokens", "full")``.

    Reset writes ``("tokens", "prompt")`` (int64, ``(*batch, prompt_len)``), its
    ``("masks", "all_attention_mask")`` (all True) and the ``"answer"``
    (``(*batch, answer_len)``); the action is ``("tokens", "full")`` (prompt ++ response,
    what TorchRL's LLM wrappers and :class:`~torchrl_vllm_ext.VLLMPolicy` write, ragged
    rows accepted); the step writes ``"reward"`` shaped ``(*batch, 1, 1)`` (the layout of
    TorchRL's LLM rewards, which ``MCAdvantage`` and ``GRPOLoss`` expect) and
    ``done = terminated = True``.

    ``group_size=G`` poses each prompt to ``G`` consecutive rows of the (flattened) batch,
    the groups GRPO compares samples within. Prompts come from a ``torch.Generator``
    seeded by ``seed``: two envs with the same seed pose the same prompts in the same order.
    With ``sample_seeds=True`` reset also writes a ``"seed"`` per row from that generator,
    which :class:`~torchrl_vllm_ext.VLLMPolicy` uses as the row's sampling seed: a run is
    then reproducible whatever replica serves each row.

    Subclasses implement :meth:`draw` and :meth:`score`.

    Args:
        batch_size: rows per reset (env batch).
        prompt_len: ids in each prompt.
        answer_len: ids in each answer (and the response length that is scored).
        low: smallest id of the task's alphabet.
        high: one past the largest id of the alphabet.
        group_size: consecutive rows that share a prompt.
        seed: seed of the prompt generator.
        sample_seeds: also write a per-row ``"seed"`` for the policy's sampling.
    """

    answer_len: int

    def __init__(
        self,
        batch_size: tuple[int, ...] | torch.Size = (1,),
        *,
        prompt_len: int = 4,
        answer_len: int = 4,
        low: int = 5,
        high: int = 15,
        group_size: int = 1,
        seed: int = 0,
        sample_seeds: bool = False,
    ):
        batch_size = torch.Size(batch_size)
        if prompt_len < 1 or answer_len < 1:
            raise ConfigurationError(
                f"prompt_len={prompt_len} and answer_len={answer_len} must both be >= 1."
            )
        if not 0 <= low < high:
            raise ConfigurationError(
                f"token range [low={low}, high={high}) is empty or negative; pick 0 <= low < high."
            )
        if group_size < 1 or batch_size.numel() % group_size:
            raise ConfigurationError(
                f"group_size={group_size} must be >= 1 and divide the batch of "
                f"{batch_size.numel()} rows; pick a batch_size that is a multiple of it."
            )
        super().__init__(batch_size=batch_size)
        self.prompt_len, self.answer_len = prompt_len, answer_len
        self.low, self.high = low, high
        self.group_size = group_size
        self.sample_seeds = sample_seeds
        shape = self.batch_size
        ids = Bounded(low, high - 1, shape=(*shape, prompt_len), dtype=torch.int64)
        mask = Bounded(0, 1, shape=(*shape, prompt_len), dtype=torch.bool)
        self.full_observation_spec = Composite(
            tokens=Composite(prompt=ids, shape=shape),
            masks=Composite(all_attention_mask=mask, shape=shape),
            shape=shape,
        )
        answer = Bounded(low, high - 1, shape=(*shape, answer_len), dtype=torch.int64)
        self.full_state_spec = Composite(answer=answer, shape=shape)
        if sample_seeds:
            self.full_state_spec["seed"] = Bounded(0, SEED_HIGH - 1, shape=shape, dtype=torch.int64)
        # Ragged: each row's prompt ++ response has its own length.
        self.full_action_spec = Composite(
            tokens=Composite(full=Unbounded((*shape, -1), dtype=torch.int64), shape=shape),
            shape=shape,
        )
        self.reward_spec = Unbounded((*shape, 1, 1))
        self._set_seed(seed)

    @property
    def task_token_ids(self) -> list[int]:
        """The ids a prompt or an answer can contain: a policy may restrict sampling to them."""
        return list(range(self.low, self.high))

    def draw(self, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """``n`` prompts ``(n, prompt_len)`` and their answers ``(n, answer_len)``."""
        raise NotImplementedError

    def score(self, prompt: torch.Tensor, answer: torch.Tensor, response: torch.Tensor) -> float:
        """The reward of one ``response`` (1-D ids) in ``[0, 1]``."""
        raise NotImplementedError

    def _set_seed(self, seed: int | None) -> None:
        self.rng = torch.Generator().manual_seed(0 if seed is None else seed)

    def _reset(self, tensordict: TensorDictBase | None, **kwargs) -> TensorDictBase:
        # Every episode ends after one step, so every row resets together: new prompts
        # for the whole batch.
        groups = self.batch_size.numel() // self.group_size
        prompt, answer = self.draw(groups, self.rng)
        prompt = prompt.repeat_interleave(self.group_size, 0).reshape(*self.batch_size, -1)
        answer = answer.repeat_interleave(self.group_size, 0).reshape(*self.batch_size, -1)
        out = TensorDict(batch_size=self.batch_size)
        out.set("tokens", Tokens(prompt=prompt, batch_size=self.batch_size))
        out.set("answer", answer)
        if self.sample_seeds:
            out.set("seed", torch.randint(SEED_HIGH, self.batch_size, generator=self.rng))
        # NOTE: the collector carries the last step's keys into the reset TD; a fresh
        # prompt mask replaces the previous turn's (prompt ++ response) one, which a
        # policy reading ("masks", "all_attention_mask") would otherwise pair with the
        # new, shorter prompt.
        out.set(("masks", "all_attention_mask"), torch.ones_like(prompt, dtype=torch.bool))
        out.update(self.full_done_spec.zero())
        return out

    def _step(self, tensordict: TensorDictBase) -> TensorDictBase:
        full = flatten_rows(tensordict.get(("tokens", "full"), as_list=True))
        prompt = tensordict.get(("tokens", "prompt")).reshape(-1, self.prompt_len)
        answer = tensordict.get("answer").reshape(-1, self.answer_len)
        rewards = [
            self.score(p, a, f[self.prompt_len :])
            for p, a, f in zip(prompt, answer, full, strict=True)
        ]
        shape = self.batch_size
        out = TensorDict(
            {
                "reward": torch.tensor(rewards).reshape(*shape, 1, 1),
                "done": torch.ones(*shape, 1, dtype=torch.bool),
                "terminated": torch.ones(*shape, 1, dtype=torch.bool),
                "answer": tensordict.get("answer"),
                **({"seed": tensordict.get("seed")} if self.sample_seeds else {}),
            },
            batch_size=shape,
        )
        # The next observation is the finished dialog, as in TorchRL's ChatEnv.
        out.set(("tokens", "prompt"), tensordict.get(("tokens", "prompt")))
        out.set(
            ("masks", "all_attention_mask"),
            torch.ones(*shape, self.prompt_len, dtype=torch.bool),
        )
        return out


__all__ = ["TokenTaskEnv"]

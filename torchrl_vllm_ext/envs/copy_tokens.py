"""TokenCopyEnv: a one-step token task with a verifiable reward ("repeat the prompt").

The prompt is ``prompt_len`` token ids drawn from ``[low, high)``; the reward is the
fraction of the first ``prompt_len`` response tokens that equal the prompt, position
by position. No tokenizer, no data set, no network: the task is defined on token ids,
so it runs with any model whose vocabulary covers ``[low, high)``.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.data import Bounded, Composite, Unbounded
from torchrl.envs import EnvBase
from torchrl.modules.llm.policies import Tokens

from torchrl_vllm_ext.errors import ConfigurationError
from torchrl_vllm_ext.wrappers.inputs import flatten_rows


def copy_reward(prompt: torch.Tensor, response: torch.Tensor) -> float:
    """Fraction of ``prompt`` repeated at the start of ``response``, position by position.

    A response shorter than the prompt scores its matching prefix over the full length,
    so stopping early never pays.

    Examples:
        >>> copy_reward(torch.tensor([5, 6, 7, 8]), torch.tensor([5, 6, 9]))
        0.5
    """
    n = prompt.numel()
    head = response[:n]
    return (head == prompt[: head.numel()]).sum().item() / n


class TokenCopyEnv(EnvBase):
    """Copy the prompt: TorchRL tokens-mode LLM env with a verifiable reward.

    Every episode is one dialog turn. Reset writes ``("tokens", "prompt")`` (int64,
    ``(*batch, prompt_len)``), its ``("masks", "all_attention_mask")`` (all True) and the
    ``"answer"`` to check against; the action is
    ``("tokens", "full")`` (prompt ++ response, what TorchRL's LLM wrappers and
    :class:`~torchrl_vllm_ext.VLLMPolicy` write, ragged rows accepted); the step writes
    ``"reward"`` shaped ``(*batch, 1, 1)`` (the layout of TorchRL's LLM rewards, which
    ``MCAdvantage`` and ``GRPOLoss`` expect) and ``done = terminated = True``.

    Prompts come from a ``torch.Generator`` seeded by ``seed``, so two envs with the same
    seed pose the same prompts in the same order.

    Args:
        batch_size: number of prompts per reset (env batch).
        prompt_len: tokens to copy.
        low: smallest token id used in prompts.
        high: one past the largest token id used in prompts.
        seed: seed of the prompt generator.

    Examples:
        >>> env = TokenCopyEnv(batch_size=(2,), prompt_len=3, seed=0)
        >>> td = env.reset()
        >>> td["tokens", "prompt"].shape
        torch.Size([2, 3])
        >>> prompt = td["tokens", "prompt"]
        >>> td["tokens", "full"] = torch.cat([prompt, prompt], -1)  # a perfect copy
        >>> env.step(td)["next", "reward"].flatten().tolist()
        [1.0, 1.0]
    """

    def __init__(
        self,
        batch_size: tuple[int, ...] | torch.Size = (1,),
        *,
        prompt_len: int = 4,
        low: int = 5,
        high: int = 15,
        seed: int = 0,
    ):
        if prompt_len < 1:
            raise ConfigurationError(f"prompt_len={prompt_len} must be >= 1.")
        if not 0 <= low < high:
            raise ConfigurationError(
                f"token range [low={low}, high={high}) is empty or negative; pick 0 <= low < high."
            )
        super().__init__(batch_size=torch.Size(batch_size))
        self.prompt_len = prompt_len
        self.low, self.high = low, high
        shape = self.batch_size
        ids = Bounded(low, high - 1, shape=(*shape, prompt_len), dtype=torch.int64)
        mask = Bounded(0, 1, shape=(*shape, prompt_len), dtype=torch.bool)
        self.full_observation_spec = Composite(
            tokens=Composite(prompt=ids, shape=shape),
            masks=Composite(all_attention_mask=mask, shape=shape),
            shape=shape,
        )
        self.full_state_spec = Composite(answer=ids.clone(), shape=shape)
        # Ragged: each row's prompt ++ response has its own length.
        self.full_action_spec = Composite(
            tokens=Composite(full=Unbounded((*shape, -1), dtype=torch.int64), shape=shape),
            shape=shape,
        )
        self.reward_spec = Unbounded((*shape, 1, 1))
        self._set_seed(seed)

    def _set_seed(self, seed: int | None) -> None:
        self.rng = torch.Generator().manual_seed(0 if seed is None else seed)

    def _reset(self, tensordict: TensorDictBase | None, **kwargs) -> TensorDictBase:
        # Every episode ends after one step, so every row resets together: new prompts
        # for the whole batch.
        prompt = torch.randint(
            self.low, self.high, (*self.batch_size, self.prompt_len), generator=self.rng
        )
        out = TensorDict(batch_size=self.batch_size)
        out.set("tokens", Tokens(prompt=prompt, batch_size=self.batch_size))
        out.set("answer", prompt.clone())
        # NOTE: the collector carries the last step's keys into the reset TD; a fresh
        # prompt mask replaces the previous turn's (prompt ++ response) one, which a
        # policy reading ("masks", "all_attention_mask") would otherwise pair with the
        # new, shorter prompt.
        out.set(("masks", "all_attention_mask"), torch.ones_like(prompt, dtype=torch.bool))
        out.update(self.full_done_spec.zero())
        return out

    def _step(self, tensordict: TensorDictBase) -> TensorDictBase:
        full = tensordict.get(("tokens", "full"), as_list=True)
        answer = tensordict.get("answer").reshape(-1, self.prompt_len)
        rewards = [
            copy_reward(a, f[self.prompt_len :])
            for a, f in zip(answer, flatten_rows(full), strict=True)
        ]
        shape = self.batch_size
        out = TensorDict(
            {
                "reward": torch.tensor(rewards).reshape(*shape, 1, 1),
                "done": torch.ones(*shape, 1, dtype=torch.bool),
                "terminated": torch.ones(*shape, 1, dtype=torch.bool),
                "answer": tensordict.get("answer"),
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


__all__ = ["TokenCopyEnv", "copy_reward"]

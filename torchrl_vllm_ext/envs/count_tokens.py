"""TokenCountEnv: continue counting, on a cyclic alphabet of token ids.

The prompt is a run of consecutive ids, ``[a, a+1, ..., a+prompt_len-1]`` taken modulo the
alphabet ``[low, high)``; the answer continues it for ``answer_len`` ids. The reward is the
fraction of response positions holding the successor of the id before them (the prompt's
last id for the first position): a local, dense signal, so a policy that gets one step
wrong still earns the steps it counts right after it. A uniformly random policy over the
alphabet scores ``1 / (high - low)``.

Why this task for the GRPO demo: a tiny random transformer learns it from reward alone in a
few hundred GRPO steps on 2 CPU cores (the copy task needs attention learned from a
sequence-level reward and plateaus far below that budget).
"""

from __future__ import annotations

import torch

from torchrl_vllm_ext.envs.token_task import TokenTaskEnv


def count_reward(last_prompt_id: int, response: torch.Tensor, *, low: int, high: int) -> float:
    """Fraction of the ``len(response)`` positions whose id follows the one before, cyclically.

    Examples:
        >>> count_reward(8, torch.tensor([9, 5, 6]), low=5, high=10)  # 9 -> 5 wraps around
        1.0
        >>> count_reward(8, torch.tensor([9, 9, 5]), low=5, high=10)
        0.6666666666666666
    """
    if response.numel() == 0:
        return 0.0
    prev = torch.cat([torch.tensor([last_prompt_id]), response[:-1]])
    successor = (prev - low + 1) % (high - low) + low
    return (response == successor).sum().item() / response.numel()


class TokenCountEnv(TokenTaskEnv):
    """Continue a run of consecutive token ids; the reward counts correct successor steps.

    The response is scored over ``answer_len`` positions: a shorter response scores its
    correct steps over the full length, so stopping early never pays, and tokens after
    the first ``answer_len`` are ignored. See :class:`~torchrl_vllm_ext.envs.TokenTaskEnv`
    for the keys, groups and seeding.

    Examples:
        >>> env = TokenCountEnv(batch_size=(2,), prompt_len=3, answer_len=2, low=5, high=10)
        >>> td = env.reset()
        >>> prompt, answer = td["tokens", "prompt"], td["answer"]
        >>> bool(((prompt[:, 1:] - prompt[:, :-1]) % 5 == 1).all())
        True
        >>> td["tokens", "full"] = torch.cat([prompt, answer], -1)
        >>> env.step(td)["next", "reward"].flatten().tolist()
        [1.0, 1.0]
    """

    def draw(self, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        span = self.high - self.low
        start = torch.randint(0, span, (n, 1), generator=generator)
        run = (start + torch.arange(self.prompt_len + self.answer_len)) % span + self.low
        return run[:, : self.prompt_len], run[:, self.prompt_len :]

    def score(self, prompt: torch.Tensor, answer: torch.Tensor, response: torch.Tensor) -> float:
        # Over answer_len positions: missing positions count as wrong.
        head = response[: self.answer_len]
        got = count_reward(int(prompt[-1]), head, low=self.low, high=self.high)
        return got * head.numel() / self.answer_len


__all__ = ["TokenCountEnv", "count_reward"]

"""TokenCopyEnv: repeat the prompt, scored position by position.

No tokenizer, no data set, no network: the task is defined on token ids, so it runs with
any model whose vocabulary covers ``[low, high)``.
"""

from __future__ import annotations

import torch

from torchrl_vllm_ext.envs.token_task import TokenTaskEnv


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


class TokenCopyEnv(TokenTaskEnv):
    """Copy the prompt: ``prompt_len`` ids drawn from ``[low, high)``, the answer is the prompt.

    See :class:`~torchrl_vllm_ext.envs.TokenTaskEnv` for the keys, groups and seeding.

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
        group_size: int = 1,
        seed: int = 0,
        sample_seeds: bool = False,
    ):
        super().__init__(
            batch_size,
            prompt_len=prompt_len,
            answer_len=prompt_len,
            low=low,
            high=high,
            group_size=group_size,
            seed=seed,
            sample_seeds=sample_seeds,
        )

    def draw(self, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        prompt = torch.randint(self.low, self.high, (n, self.prompt_len), generator=generator)
        return prompt, prompt.clone()

    def score(self, prompt: torch.Tensor, answer: torch.Tensor, response: torch.Tensor) -> float:
        return copy_reward(answer, response)


__all__ = ["TokenCopyEnv", "copy_reward"]

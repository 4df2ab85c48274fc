"""ReferenceKL: a frozen reference model's log-probs and the KL to it, as an env transform.

TorchRL 0.14's ``RetrieveLogProb`` scores a rollout with a reference model, but appended
to an env it fails TorchRL's own spec check (its observation spec names ``kl_penalty``
and not the log-prob key it writes), and its ``KLComputation`` reads the policy's
log-probs from ``"next"``, where no LLM wrapper writes them. This transform is that
``RetrieveLogProb`` with a working spec, plus the KL from the policy's own log-probs:

* ``("next", "ref_log_probs", "full")``: the reference's log-prob of every token of
  ``("tokens", "full")``, in the policy's layout (padded or ragged): what TorchRL's
  ``GRPOLoss(kl_to_ref_coeff=...)`` reads, so the trainer runs no reference forward;
* ``("next", "kl_penalty")``: per sample, ``sum_t log pi(y_t) - log pi_ref(y_t)`` over the
  response tokens (the assistant mask), shape ``(*batch, 1)``;
* with ``coeff > 0``, ``reward -= coeff * kl_penalty`` (TorchRL's ``KLRewardTransform``).

The reference is any scoring policy, typically a :class:`~torchrl_vllm_ext.VLLMPolicy`
with ``generate=False`` on its own :class:`~torchrl_vllm_ext.VLLMService` that no weight
sync ever pushes to.
"""

from __future__ import annotations

import time

import torch
from tensordict import TensorDictBase
from torchrl.data import Unbounded
from torchrl.envs.llm.transforms import RetrieveLogProb

from torchrl_vllm_ext.wrappers.inputs import flatten_rows

GEN_LOG_PROBS = ("log_probs", "full")
ASSISTANT_MASK = ("masks", "all_assistant_mask")


def _rows(td: TensorDictBase, key) -> list[torch.Tensor]:
    """Per-sample 1-D values under ``key`` (padded rows keep their padding)."""
    value = td.get(key, as_list=True)
    if isinstance(value, torch.Tensor):
        return list(value.reshape(-1, value.shape[-1]).unbind(0))
    return list(flatten_rows(value))


def sequence_kl(
    log_probs: list[torch.Tensor], ref_log_probs: list[torch.Tensor], masks: list[torch.Tensor]
) -> torch.Tensor:
    """Per-sample ``sum(log_probs - ref_log_probs)`` over the positions ``masks`` selects.

    Examples:
        >>> lp, ref = [torch.tensor([float("nan"), -1.0, -2.0])], [torch.tensor([0.0, -1.5, -2.0])]
        >>> sequence_kl(lp, ref, [torch.tensor([False, True, True])])
        tensor([0.5000])
    """
    out = []
    for lp, ref, mask in zip(log_probs, ref_log_probs, masks, strict=True):
        out.append(torch.where(mask, lp - ref, 0.0).sum())
    return torch.stack(out) if out else torch.zeros(0)


class ReferenceKL(RetrieveLogProb):
    """Write a reference model's log-probs and the KL to it into each env step.

    Args:
        ref_model: a scoring policy (``generate=False``, tokens mode, reading
            ``("tokens", "full")``), e.g. ``VLLMPolicy(ref_service, generate=False,
            input_mode="tokens", log_probs_key="ref_log_probs", pad_output=...)`` with the
            same ``pad_output`` as the policy.
        coeff: ``reward -= coeff * kl_penalty`` when > 0 (0: the KL is only recorded, e.g.
            for ``GRPOLoss(kl_to_ref_coeff=...)``).
        kl_key: where the per-sample KL goes in ``"next"``.
        log_probs_key: where the policy's own log-probs of ``("tokens", "full")`` are.
        mask_key: the policy's response-token mask.

    ``seconds`` holds the time of the last reference call (what the reference costs).
    """

    def __init__(
        self,
        ref_model,
        *,
        coeff: float = 0.0,
        kl_key: str = "kl_penalty",
        log_probs_key=GEN_LOG_PROBS,
        mask_key=ASSISTANT_MASK,
    ):
        super().__init__(ref_model, assistant_only=False)
        self.coeff = float(coeff)
        self.kl_key = kl_key
        self.gen_log_probs_key = log_probs_key
        self.mask_key = mask_key
        self.out_keys = [self.log_probs_full_key, kl_key]
        self.seconds = 0.0

    def _step(self, tensordict: TensorDictBase, next_tensordict: TensorDictBase):
        start = time.perf_counter()
        next_tensordict = super()._step(tensordict, next_tensordict)
        self.seconds = time.perf_counter() - start
        kl = sequence_kl(
            _rows(tensordict, self.gen_log_probs_key),
            _rows(next_tensordict, self.log_probs_full_key),
            [m.bool() for m in _rows(tensordict, self.mask_key)],
        ).reshape(*next_tensordict.batch_size, 1)
        next_tensordict.set(self.kl_key, kl)
        if self.coeff > 0:
            reward = next_tensordict.get("reward")
            penalty = kl.reshape(*kl.shape, *([1] * (reward.ndim - kl.ndim)))
            next_tensordict.set("reward", reward - self.coeff * penalty.to(reward.dtype))
        return next_tensordict

    def transform_observation_spec(self, observation_spec):
        shape = observation_spec.shape
        observation_spec[self.log_probs_full_key] = Unbounded(
            shape=(*shape, -1), device=observation_spec.device
        )
        observation_spec[self.kl_key] = Unbounded(shape=(*shape, 1), device=observation_spec.device)
        return observation_spec


__all__ = ["ReferenceKL", "sequence_kl"]

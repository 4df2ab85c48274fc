"""The trainer side of GRPO: group advantages, TorchRL's GRPOLoss, one optimizer step."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence

import torch
from tensordict import TensorDictBase
from torch.distributed.tensor import DTensor

from torchrl_vllm_ext.grpo.rollouts import response_rows

# Added to the logits of ids outside the task's alphabet: exp() of it is exactly 0 in
# fp32/bf16, like vLLM's -inf mask, without the NaN that 0 * -inf brings to entropies.
MASKED_LOGIT = -1e9


def restrict_vocabulary(model: torch.nn.Module, token_ids: Sequence[int]) -> VocabularyMask:
    """Mask the model's output logits to ``token_ids``; returns the mask (``remove()``
    lifts it for good, ``lifted()`` for a while).

    The replicas sample with ``allowed_token_ids=token_ids`` and report processed
    log-probs (``logprobs_mode="processed_logprobs"``), i.e. log-softmax over the allowed
    ids; the trainer must score with the same distribution for GRPO's importance weights
    to be 1 on fresh samples.

    Examples:
        >>> from transformers import AutoModelForCausalLM
        >>> from torchrl_vllm_ext.testing import make_tiny_model
        >>> model = AutoModelForCausalLM.from_pretrained(make_tiny_model())
        >>> handle = restrict_vocabulary(model, [5, 6, 7])
        >>> probs = model(torch.tensor([[5, 6]])).logits[0, -1].detach().softmax(-1)
        >>> round(float(probs[[5, 6, 7]].sum()), 6)
        1.0
        >>> handle.remove()
    """
    return VocabularyMask(model.get_output_embeddings(), token_ids)


class VocabularyMask:
    """A forward hook on the output embeddings adding :data:`MASKED_LOGIT` to every id
    outside ``token_ids`` (see :func:`restrict_vocabulary`).

    Examples:
        >>> head = torch.nn.Linear(2, 4)
        >>> mask = VocabularyMask(head, [1, 2])
        >>> bool(head(torch.ones(2))[0] < -1e8)
        True
        >>> with mask.lifted():  # the model's own logits meanwhile
        ...     bool(head(torch.ones(2))[0] < -1e8)
        False
        >>> mask.remove()
    """

    def __init__(self, head: torch.nn.Module, token_ids: Sequence[int]):
        self.head = head
        self.mask = torch.full((head.weight.shape[0],), MASKED_LOGIT)
        self.mask[list(token_ids)] = 0.0
        self.handle = head.register_forward_hook(self.add_mask)

    def add_mask(self, module, inputs, logits):
        return logits + self.mask.to(device=logits.device, dtype=logits.dtype)

    def remove(self) -> None:
        """Lift the mask for good."""
        self.handle.remove()

    @contextlib.contextmanager
    def lifted(self):
        """The model's own logits inside the block: what a sharded push's value check
        scores (its reference is the model's forward; the replicas' probe has no
        ``allowed_token_ids``)."""
        self.handle.remove()
        try:
            yield
        finally:
            self.handle = self.head.register_forward_hook(self.add_mask)


def group_advantage(reward: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """GRPO's advantage: each reward standardised within its group of ``group_size`` rows.

    Rows ``[k*G, (k+1)*G)`` answer the same prompt (see ``TokenTaskEnv(group_size=G)``).
    A group whose samples all score the same gets advantage 0: it carries no signal.

    Examples:
        >>> group_advantage(torch.tensor([1.0, 0.0, 0.5, 0.5]), group_size=2)
        tensor([ 0.7071, -0.7071,  0.0000,  0.0000])
    """
    groups = reward.reshape(-1, group_size)
    centred = groups - groups.mean(-1, keepdim=True)
    return (centred / (groups.std(-1, keepdim=True) + eps)).reshape(reward.shape)


def sample_entropy(batch: TensorDictBase) -> float:
    """The policy's per-token entropy (nats), estimated by its samples' mean surprisal.

    An entropy near 0 means the engine samples one answer: every sample of a group is
    then the same, GRPO's group advantages are 0, and nothing more is learned there.
    """
    rows = response_rows(batch, ("log_probs", "response"))
    return -torch.cat([r.reshape(-1) for r in rows]).mean().item()


class GRPOTrainer:
    """TorchRL's ``GRPOLoss`` over a transformers model, with Adam: ``step(batch)`` learns once.

    The loss is :class:`~torchrl_vllm_ext.CorrectedGRPOLoss` (TorchRL's, plus the
    trainer-engine mismatch metrics of every batch and the optional rollout correction).

    ``batch`` is what :class:`torchrl.collectors.llm.LLMCollector` yields with a
    :class:`~torchrl_vllm_ext.VLLMPolicy` (``pad_output`` as given here) on a
    :class:`~torchrl_vllm_ext.envs.TokenTaskEnv` with ``group_size`` rows per prompt.

    Args:
        model: the Hugging Face causal LM being trained (its weights are pushed to the
            replicas after each step).
        tokenizer: its tokenizer.
        group_size: rows per prompt in the batch.
        lr: Adam learning rate.
        clip_epsilon: GRPOLoss clipping of the importance weight.
        max_grad_norm: gradient clipping.
        entropy_coeff: weight of GRPOLoss's entropy bonus (0 turns it off).
        kl_to_ref_coeff: weight of GRPOLoss's KL to the reference (0 turns it off); the
            batch then carries ``("next", "ref_log_probs", "full")`` (:class:`ReferenceKL`).
        pad_output: the batch's layout (the policy's ``pad_output``).
        rollout_correction: None (TorchRL's loss) or a mode of
            :data:`torchrl_vllm_ext.losses.MODES`.
        is_clip: upper bound of the correction's importance weight.
        is_clip_low: its lower bound (two-sided); None: none.

    Examples:
        >>> trainer = GRPOTrainer(model, tokenizer, group_size=16)  # doctest: +SKIP
        >>> metrics = trainer.step(next(iter(collector)))  # doctest: +SKIP
        >>> metrics["reward"], metrics["ess"]  # doctest: +SKIP
        (0.11, 1.0)
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        *,
        group_size: int,
        lr: float = 1e-3,
        clip_epsilon: float = 0.2,
        max_grad_norm: float = 1.0,
        entropy_coeff: float = 0.0,
        kl_to_ref_coeff: float = 0.0,
        pad_output: bool = True,
        rollout_correction: str | None = None,
        is_clip: float = 2.0,
        is_clip_low: float | None = None,
    ):
        from torchrl.modules.llm import TransformersWrapper

        from torchrl_vllm_ext.losses import CorrectedGRPOLoss

        self.model = model.eval()  # GRPOLoss's advice: eval mode keeps the weights exact
        self.group_size = group_size
        self.max_grad_norm = max_grad_norm
        actor = TransformersWrapper(
            model, tokenizer=tokenizer, input_mode="tokens", generate=False, pad_output=pad_output
        )
        self.loss = CorrectedGRPOLoss(
            actor,
            clip_epsilon=clip_epsilon,
            masking_strategy="sft",
            entropy_bonus=entropy_coeff > 0,
            entropy_coeff=entropy_coeff,
            kl_to_ref_coeff=kl_to_ref_coeff or None,
            rollout_correction=rollout_correction,
            is_clip=is_clip,
            is_clip_low=is_clip_low,
        )
        self.optimizer = torch.optim.Adam(model.parameters(), lr=lr)

    def set_advantage(self, batch: TensorDictBase) -> torch.Tensor:
        """Write each row's group advantage into ``batch`` (``"advantage"``, which the
        rollout recorder reads); returns the rewards, flat."""
        reward = batch.get(("next", "reward")).reshape(-1).float()
        advantage = group_advantage(reward, self.group_size)
        batch.set("advantage", advantage.view(*batch.shape, 1, 1))
        return reward

    def step(self, batch: TensorDictBase) -> dict[str, float]:
        """Advantages, loss, backward, optimizer step; returns the step's metrics.

        ``score_s`` is the trainer's forward pass (its log-probs of the samples),
        ``train_s`` the backward pass and the update. ``ess`` and ``kl_to_engine`` compare
        the trainer's log-probs with the engine's: on fresh samples from the trainer's
        own weights they are 1 and 0 up to float error, the visible proof that the
        replicas serve exactly what the trainer holds (``ess`` is TorchRL's, of its PPO
        ratio: with a correction mode that ratio is against the trainer's own log-probs,
        and ``mismatch_ess`` is the engine's). ``mismatch_<name>`` are the loss's
        mismatch figures (:data:`torchrl_vllm_ext.losses.METRICS`, the correction's
        fractions) and ``mismatch_s`` the time the loss spent on them (inside ``score_s``).
        """
        reward = self.set_advantage(batch)
        data = batch.reshape(-1)
        start = time.perf_counter()
        out = self.loss(data)
        scored = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        loss = out.loss_objective
        for extra in (out.loss_entropy, out.loss_kl_to_ref):
            if extra is not None:
                loss = loss + extra
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        if isinstance(grad_norm, DTensor):  # FSDP2: the norm over every rank's shards
            grad_norm = grad_norm.full_tensor()
        self.optimizer.step()
        done = time.perf_counter()
        return {
            "reward": reward.mean().item(),
            "loss": out.loss_objective.item(),
            "entropy": sample_entropy(data),
            **({"kl_to_ref": float(out.kl_to_ref)} if out.kl_to_ref is not None else {}),
            "ess": float(out.ESS),
            "kl_to_engine": float(out.kl_approx),
            "grad_norm": float(grad_norm),
            **{f"mismatch_{k}": float(v) for k, v in out.mismatch.items()},
            "mismatch_s": self.loss.metrics_seconds,
            "score_s": scored - start,
            "train_s": done - scored,
        }


__all__ = [
    "MASKED_LOGIT",
    "GRPOTrainer",
    "VocabularyMask",
    "group_advantage",
    "restrict_vocabulary",
]

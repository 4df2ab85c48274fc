"""CorrectedGRPOLoss: TorchRL's ``GRPOLoss`` with the mismatch metrics and the rollout correction.

A TorchRL user switches in one line::

    loss = CorrectedGRPOLoss(actor, rollout_correction="token_truncate", is_clip=2.0, ...)

(every other argument is ``GRPOLoss``'s). The output is TorchRL's ``GRPOLossOutput`` with
one more field, ``mismatch`` (a TensorDict of :data:`~torchrl_vllm_ext.losses.METRICS`
and the correction's ``clipped_fraction``, ``masked_fraction``, ``weight_mean``).

How the correction composes with TorchRL's ratio: ``GRPOLoss`` takes its PPO ratio
against the engine's log-probs (``("log_probs", "full")``, what vLLM reported), so
``pi_theta / q = (pi_theta / pi_old) * (pi_old / q)`` mixes the update's own drift with the
mismatch ``r = pi_old / q``, unbounded inside the clip (verl calls this "bypass"). With a
correction mode the ratio is taken against the trainer's own log-probs of the batch
(``pi_old``: ``("trainer_log_probs", "full")`` when the batch carries them, else this
forward's, detached), and each token's loss is multiplied by the bounded weight of ``r``
(Yao et al.'s truncated IS for PPO). Without a mode the loss is TorchRL's, unchanged.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from tensordict import NestedKey, TensorDict, TensorDictBase
from torchrl.objectives.llm import GRPOLoss
from torchrl.objectives.llm.grpo import GRPOLossOutput

from torchrl_vllm_ext.losses.correction import RolloutCorrection
from torchrl_vllm_ext.losses.mismatch import log_ratio_metrics


class CorrectedGRPOLossOutput(GRPOLossOutput):
    """``GRPOLossOutput`` plus ``mismatch``: the batch's trainer-engine mismatch figures
    (None with ``mismatch_metrics=False``)."""

    mismatch: TensorDict | None = None


class CorrectedGRPOLoss(GRPOLoss):
    """TorchRL's ``GRPOLoss``, measuring the trainer-engine mismatch of every batch and,
    with ``rollout_correction``, correcting the policy gradient for it.

    Keyword Args:
        rollout_correction: None (TorchRL's loss, metrics only) or a mode of
            :data:`~torchrl_vllm_ext.losses.MODES`: ``token_truncate`` (TIS),
            ``token_mask`` (IcePop with ``is_clip_low``), ``sequence_truncate``,
            ``sequence_mask``.
        is_clip: upper bound of the importance weight (2.0, as TIS).
        is_clip_low: lower bound (two-sided); None: none.
        mismatch_metrics: report ``mismatch`` in the output (a dozen reductions over
            the batch's tokens; False skips them).
        **kwargs: ``GRPOLoss``'s arguments (``clip_epsilon``, ``masking_strategy``,
            ``entropy_coeff``, ``kl_to_ref_coeff``, ...).

    Attributes:
        metrics_seconds: wall time the last forward spent on the metrics and weights.

    Examples:
        >>> from torchrl.modules.llm import TransformersWrapper
        >>> from transformers import AutoModelForCausalLM, AutoTokenizer
        >>> from torchrl_vllm_ext.testing import make_tiny_model
        >>> path = make_tiny_model()
        >>> actor = TransformersWrapper(AutoModelForCausalLM.from_pretrained(path).eval(),
        ...     tokenizer=AutoTokenizer.from_pretrained(path), input_mode="tokens",
        ...     generate=False, pad_output=True)
        >>> full = torch.tensor([[5, 6, 7, 8, 9, 10]])  # 4 prompt ids, 2 sampled
        >>> batch = TensorDict({("tokens", "prompt"): full[:, :4],
        ...     ("tokens", "response"): full[:, 4:], ("tokens", "full"): full,
        ...     ("masks", "all_attention_mask"): torch.ones(1, 6, dtype=torch.bool),
        ...     "advantage": torch.ones(1, 1, 1)}, [1])
        >>> engine = actor(batch.copy())["log_probs", "full"].detach()  # as if vLLM's
        >>> _ = batch.set(("log_probs", "full"), engine)
        >>> loss = CorrectedGRPOLoss(actor, masking_strategy="sft", entropy_bonus=False,
        ...     rollout_correction="token_truncate", is_clip=2.0)
        >>> out = loss(batch)
        >>> float(out.mismatch["tokens"]), float(out.mismatch["kl_k3"]), float(out.mismatch["weight_mean"])
        (2.0, 0.0, 1.0)
    """

    output_type = CorrectedGRPOLossOutput

    @dataclass
    class _AcceptedKeys(GRPOLoss._AcceptedKeys):
        """``GRPOLoss``'s keys, plus ``trainer_log_prob``: the trainer's own log-probs of the
        batch from its first pass, the PPO anchor of a corrected loss (absent: this
        forward's, detached, exact for one update per batch)."""

        trainer_log_prob: NestedKey = ("trainer_log_probs", "full")

    def __init__(
        self,
        actor_network=None,
        *,
        rollout_correction: str | None = None,
        is_clip: float = 2.0,
        is_clip_low: float | None = None,
        mismatch_metrics: bool = True,
        **kwargs,
    ):
        super().__init__(actor_network, **kwargs)
        self.correction = (
            None
            if rollout_correction is None
            else RolloutCorrection(rollout_correction, clip=is_clip, low=is_clip_low)
        )
        self.mismatch_metrics = mismatch_metrics
        self.metrics_seconds = 0.0
        # NOTE: GRPOLoss.forward hands _compute_policy_objective the log-weight only, so the
        # weights of the forward in progress wait here between the two (cleared after it).
        self._weights: torch.Tensor | None = None
        self._mismatch: TensorDict | None = None

    def forward(self, tensordict: TensorDictBase) -> CorrectedGRPOLossOutput:
        try:
            out = super().forward(tensordict)
            out.mismatch = self._mismatch
            return out
        finally:
            self._weights = self._mismatch = None

    def _log_weight(self, tensordict: TensorDictBase, adv_shape: torch.Size):
        log_weight, dist, kl_approx, mask = super()._log_weight(tensordict, adv_shape)
        start = time.perf_counter()
        # GRPOLoss's log-weight is log pi_theta - log q on valid tokens, 0 elsewhere.
        current = tensordict.get("_cur_log_prob")
        engine = current.detach() - log_weight.detach().squeeze(-1)
        old = tensordict.get(
            self.tensor_keys.trainer_log_prob,
            None,
            as_padded_tensor=True,
            padding_side="left",
            padding_value=0.0,
        )
        old = current.detach() if old is None else torch.where(mask, old.to(current), 0.0)
        log_ratio = torch.where(mask, old - engine, 0.0)
        mismatch = log_ratio_metrics(log_ratio, mask) if self.mismatch_metrics else None
        if self.correction is not None:
            weights = self.correction.weights(log_ratio, mask)
            self._weights = weights.weights.unsqueeze(-1).to(log_weight.dtype)
            log_weight = (current - old).unsqueeze(-1)  # PPO's ratio against pi_old
            fractions = weights.fractions(mask)
        else:
            zero = log_ratio.new_zeros(())
            fractions = {
                "clipped_fraction": zero,
                "masked_fraction": zero,
                "weight_mean": zero + 1,
            }
        if mismatch is not None:
            self._mismatch = TensorDict({**mismatch, **fractions}, batch_size=[])
        self.metrics_seconds = time.perf_counter() - start
        return log_weight, dist, kl_approx, mask

    def _compute_policy_objective(self, log_weight: torch.Tensor, advantage: torch.Tensor):
        loss, clip_fraction = super()._compute_policy_objective(log_weight, advantage)
        if self._weights is not None:
            loss = loss * self._weights
        return loss, clip_fraction


__all__ = ["CorrectedGRPOLoss", "CorrectedGRPOLossOutput"]

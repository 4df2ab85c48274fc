"""GRPOConfig: every knob of the GRPO main job, one documented field each."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from torchrl_vllm_ext.errors import ConfigurationError

STALE_POLICIES = ("wait", "drop")
"""What the asynchronous job does about the staleness bound: hold the rollout side back
before a batch that would break it (``wait``), or let it run and leave the tokens past the
bound out of the loss (``drop``)."""


@dataclass
class GRPOConfig:
    """The GRPO job on :class:`~torchrl_vllm_ext.TokenCountEnv` (see ``torchrl-vllm demo``).

    Examples:
        >>> cfg = GRPOConfig(steps=10, group_size=4)
        >>> cfg.rows_per_step
        32
    """

    model: str | None = None
    """Local Hugging Face causal LM directory; None builds the package's tiny random Qwen2."""
    output: Path = Path("grpo_demo")
    """Directory for the reward curve, the metrics JSON and the memmapped rollouts."""
    steps: int = 200
    """GRPO steps: one collection of ``prompts_per_step * group_size`` samples, one update."""
    prompts_per_step: int = 8
    """Distinct prompts per step (GRPO groups)."""
    group_size: int = 16
    """Samples per prompt; advantages are normalised within each group."""
    prompt_len: int = 4
    """Ids in each prompt (a run of consecutive ids)."""
    answer_len: int = 4
    """Ids to continue the run by; also the generation length."""
    low: int = 5
    """Smallest token id of the task's alphabet."""
    high: int = 15
    """One past the largest token id of the alphabet (random policy reward 1/(high-low))."""
    lr: float = 1e-3
    """Adam learning rate of the trainer."""
    clip_epsilon: float = 0.2
    """GRPOLoss clipping of the importance weight."""
    entropy_coeff: float = 0.3
    """GRPOLoss entropy bonus weight (0: off). Without it the tiny model's sampling turns
    deterministic on some prompts within ~20 steps (entropy -> 0) before it finds their
    answer; a group's 16 samples then agree, its advantages are 0, and the reward stalls
    near 0.8 (seeds 0, 1). 0.3 keeps exploring until every answer is found (reward 1.0)."""
    temperature: float = 1.0
    """Sampling temperature of the replicas (the trainer's log-probs assume 1.0)."""
    replicas: int = 2
    """vLLM replicas (Ray actors)."""
    lora_rank: int = 0
    """Train a PEFT LoRA adapter of this rank on every linear layer instead of all
    weights, and push only the adapter (AdapterSync); 0: full weights."""
    kl_coef: float = 0.0
    """GRPOLoss's KL-to-reference weight (``kl_to_ref_coeff``); > 0 starts a reference
    service on the initial weights whose log-probs each rollout carries (0: off)."""
    ref_replicas: int = 1
    """Replicas of the reference service (with ``kl_coef > 0``)."""
    trainer_ranks: int = 1
    """Trainer processes: more than 1 shards the model with FSDP2 over as many CPU ranks
    (gloo; the job spawns ranks 1..N-1), each training on its share of every step's
    groups and pushing its shards (ShardedWeightSync); must divide ``prompts_per_step``."""
    transport: str = "auto"
    """Weight-sync transport: auto, storage or broadcast."""
    delta: str = "auto"
    """Delta pushes (only what changed since the replicas' version): auto (where they pay:
    16-bit replicas on storage or broadcast), on or off."""
    seed: int = 0
    """Seeds the tiny model, the prompts, the trainer and the engines."""
    dtype: str = "float32"
    """dtype of the trainer and of the replicas (fp32 keeps their log-probs equal)."""
    replica_dtype: str | None = None
    """dtype of the replicas when it differs from the trainer's (bfloat16 replicas beside a
    float32 trainer: the trainer-engine mismatch of 16-bit serving); None: ``dtype``."""
    rollout_correction: str | None = None
    """Correct the policy gradient for the trainer-engine mismatch: token_truncate (TIS),
    token_mask (IcePop with --is-clip-low), sequence_truncate or sequence_mask; None: off
    (the mismatch is measured either way)."""
    is_clip: float = 2.0
    """Upper bound of the rollout correction's importance weight."""
    is_clip_low: float | None = None
    """Lower bound of the rollout correction's importance weight (two-sided); None: none."""
    cpus_per_replica: float | None = None
    """Ray CPUs per replica; None splits the machine between the replicas."""
    ray_address: str | None = None
    """Ray cluster to join (head's host:port); None: a local one on this machine."""
    placement: str = "any"
    """Which node each replica goes to: any, pack, spread or strict_spread."""
    log_file: Path | None = None
    """File the replicas' output (vLLM's logs, warnings) is appended to; None: the terminal."""
    target_fraction: float = 0.8
    """The reward (fraction of the task's maximum of 1.0) the run reports the time to reach."""
    async_mode: bool = False
    """Asynchronous GRPO: the rollout side keeps generating (a producer thread into a
    queue) while the trainer trains on the previous batch; batches are consumed in order,
    at most ``max_policy_lag`` versions old (docs/guide/async.md). With it, a
    ``rollout_correction`` of None means token_truncate (TIS against the engine's
    log-probs)."""
    max_policy_lag: int = 1
    """Asynchronous mode: the most versions a trained token's weights may be behind the
    trainer's (0: on-policy, the rollout side waits for every push)."""
    in_flight_updates: bool = False
    """Asynchronous mode: pushes land while generations are in flight (pause mode
    ``keep``: a sample may span versions); off: a push waits for the generations in flight
    to finish (pause mode ``wait``), so every sample comes from one version."""
    stale_policy: str = "wait"
    """Asynchronous mode: wait (hold the rollout side before a batch that would break the
    bound) or drop (let it run; tokens past the bound are left out of the loss)."""

    def __post_init__(self):
        lag = self.max_policy_lag
        if isinstance(lag, bool) or not isinstance(lag, int) or lag < 0:
            raise ConfigurationError(
                f"max_policy_lag={lag!r} must be an int >= 0 (0: on-policy only)."
            )
        if self.stale_policy not in STALE_POLICIES:
            raise ConfigurationError(
                f"stale_policy={self.stale_policy!r} is not one of {STALE_POLICIES}: 'wait' "
                "holds the rollout side back, 'drop' leaves stale tokens out of the loss."
            )
        if self.async_mode and (self.trainer_ranks > 1 or self.lora_rank):
            raise ConfigurationError(
                "async_mode runs one trainer rank pushing full weights: pass "
                f"trainer_ranks=1 (got {self.trainer_ranks}) and lora_rank=0 (got "
                f"{self.lora_rank}), or leave async_mode off."
            )

    @property
    def pause_mode(self) -> str | None:
        """The weight pushes' pause mode: ``keep`` (in-flight updates), ``wait`` (async,
        between generations), or None (the scheme's default, synchronous job)."""
        if not self.async_mode:
            return None
        return "keep" if self.in_flight_updates else "wait"

    @property
    def rows_per_step(self) -> int:
        """Samples generated per step."""
        return self.prompts_per_step * self.group_size

    def to_json(self) -> dict:
        """The config as JSON-ready values."""
        return {
            k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(self).items()
        }


__all__ = ["GRPOConfig"]

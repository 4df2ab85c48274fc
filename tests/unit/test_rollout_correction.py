"""Mismatch metrics and rollout correction against hand-computed values (no vLLM): every
metric, every mode, masked tokens, an all-masked row, ratios far outside the bounds,
one-token sequences; and CorrectedGRPOLoss beside TorchRL's GRPOLoss on a tiny model."""

from __future__ import annotations

import math

import pytest
import torch
from tensordict import TensorDict

from torchrl_vllm_ext import ConfigurationError
from torchrl_vllm_ext.losses import (
    METRICS,
    MODES,
    CorrectedGRPOLoss,
    RolloutCorrection,
    mismatch_metrics,
)

E = math.e
# Row 0: log r = 1, -1 and a padded token (its engine log-prob NaN, as TorchRL pads);
# row 1: nothing valid; row 2: one token, log r = ln 4 (far above a bound of 2);
# row 3: one token, log r = -ln 10 (far below a lower bound of 0.5).
TRAINER = torch.tensor(
    [[-1.0, -3.0, -2.0], [-1.0, -1.0, -1.0], [-2.0 + math.log(4), 0.0, 0.0], [-1.0, 0, 0]]
)
ENGINE = torch.tensor(
    [[-2.0, -2.0, float("nan")], [-5.0, -5.0, -5.0], [-2.0, 0.0, 0.0], [-1.0 + math.log(10), 0, 0]]
)
MASK = torch.tensor(
    [[True, True, False], [False, False, False], [True, False, False], [True, False, False]]
)
RATIOS = [E, 1 / E, 4.0, 0.1]  # r of the valid tokens, in order
LOG_RATIOS = [1.0, -1.0, math.log(4), -math.log(10)]


def close(value, expected):
    assert float(value) == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_every_metric_by_hand():
    m = mismatch_metrics(TRAINER, ENGINE, MASK)
    assert list(m) == list(METRICS)
    n = 4
    close(m["tokens"], n)
    close(m["logp_abs_diff_mean"], sum(map(abs, LOG_RATIOS)) / n)
    close(m["logp_abs_diff_max"], math.log(10))
    close(m["kl_k1"], -sum(LOG_RATIOS) / n)
    close(m["kl_k3"], sum(r - 1 - lr for r, lr in zip(RATIOS, LOG_RATIOS, strict=True)) / n)
    close(m["chi2_token"], sum(r * r for r in RATIOS) / n - 1)
    # rho per row with a valid token: e * 1/e = 1, 4, 0.1 (the all-masked row counts nowhere)
    close(m["chi2_seq"], (1 + 16 + 0.01) / 3 - 1)
    close(m["is_ratio_min"], 0.1)
    close(m["is_ratio_max"], 4.0)
    close(m["is_ratio_mean"], sum(RATIOS) / n)
    close(m["ess"], sum(RATIOS) ** 2 / (n * sum(r * r for r in RATIOS)))
    assert all(torch.isfinite(v) for v in m.values())  # the padded NaN stays out


def test_equal_log_probs_mean_no_mismatch():
    m = mismatch_metrics(TRAINER, TRAINER, MASK)
    for name in ("logp_abs_diff_mean", "logp_abs_diff_max", "kl_k1", "kl_k3"):
        close(m[name], 0.0)
    for name in ("chi2_token", "chi2_seq"):
        close(m[name], 0.0)
    for name in ("is_ratio_min", "is_ratio_mean", "is_ratio_max", "ess"):
        close(m[name], 1.0)


def test_one_token_sequences_have_equal_token_and_sequence_chi2():
    m = mismatch_metrics(TRAINER[2:], ENGINE[2:], MASK[2:])
    close(m["chi2_token"], float(m["chi2_seq"]))
    close(m["chi2_seq"], (16 + 0.01) / 2 - 1)


def test_nothing_valid_gives_no_figures():
    m = mismatch_metrics(TRAINER, ENGINE, torch.zeros_like(MASK))
    close(m["tokens"], 0)
    assert all(math.isnan(float(v)) for k, v in m.items() if k != "tokens")


LOG_R = torch.where(MASK, TRAINER - ENGINE, 0.0)
# (mode, low) -> expected weights of the valid tokens, in RATIOS order; clip = 2.
EXPECTED = {
    ("token_truncate", None): ([2.0, 1 / E, 2.0, 0.1], [True, False, True, False], None),
    ("token_truncate", 0.5): ([2.0, 0.5, 2.0, 0.5], [True, True, True, True], None),
    ("token_mask", None): ([0.0, 1 / E, 0.0, 0.1], None, [True, False, True, False]),
    ("token_mask", 0.5): ([0.0, 0.0, 0.0, 0.0], None, [True, True, True, True]),
    # rho of row 0 is e * 1/e = 1: inside every bound, both of its tokens weigh 1.
    ("sequence_truncate", None): ([1.0, 1.0, 2.0, 0.1], [False, False, True, False], None),
    ("sequence_truncate", 0.5): ([1.0, 1.0, 2.0, 0.5], [False, False, True, True], None),
    ("sequence_mask", None): ([1.0, 1.0, 0.0, 0.1], None, [False, False, True, False]),
    ("sequence_mask", 0.5): ([1.0, 1.0, 0.0, 0.0], None, [False, False, True, True]),
}


@pytest.mark.parametrize(("mode", "low"), list(EXPECTED), ids=lambda v: str(v))
def test_every_mode_by_hand(mode, low):
    weights_, clipped, masked = EXPECTED[(mode, low)]
    out = RolloutCorrection(mode, clip=2.0, low=low).weights(LOG_R, MASK)
    torch.testing.assert_close(out.weights[MASK], torch.tensor(weights_), rtol=1e-6, atol=1e-6)
    assert not out.weights[~MASK].any()  # padding and the all-masked row weigh 0
    none = [False] * 4
    assert out.clipped[MASK].tolist() == (clipped or none)
    assert out.masked[MASK].tolist() == (masked or none)
    fractions = out.fractions(MASK)
    close(fractions["clipped_fraction"], sum(clipped or none) / 4)
    close(fractions["masked_fraction"], sum(masked or none) / 4)
    close(fractions["weight_mean"], sum(weights_) / 4)


@pytest.mark.parametrize("mode", MODES)
def test_equal_log_probs_weigh_one_in_every_mode(mode):
    out = RolloutCorrection(mode, clip=2.0, low=0.5).weights(torch.zeros_like(LOG_R), MASK)
    assert (out.weights[MASK] == 1).all() and not out.clipped.any() and not out.masked.any()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mode": "tis"}, "not one of"),
        ({"mode": "token_truncate", "clip": 0.0}, "is_clip"),
        ({"mode": "token_mask", "clip": 2.0, "low": 2.0}, "is_clip_low"),
        ({"mode": "token_mask", "low": -0.1}, "is_clip_low"),
    ],
)
def test_bad_corrections_are_refused(kwargs, match):
    with pytest.raises(ConfigurationError, match=match):
        RolloutCorrection(**kwargs)


# ---------------------------------------------------------------- the loss on a tiny model
@pytest.fixture(scope="module")
def scored_batch():
    """A padded TorchRL batch of 3 rows (prompt 4 ids, response 3) whose engine log-probs
    are the trainer's own, and the trainer's actor."""
    from torchrl.modules.llm import TransformersWrapper
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from torchrl_vllm_ext.testing import make_tiny_model

    path = make_tiny_model()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    actor = TransformersWrapper(
        model, tokenizer=tokenizer, input_mode="tokens", generate=False, pad_output=True
    )
    torch.manual_seed(0)
    full = torch.randint(5, 15, (3, 7))
    batch = TensorDict(
        {
            ("tokens", "prompt"): full[:, :4],
            ("tokens", "response"): full[:, 4:],
            ("tokens", "full"): full,
            ("masks", "all_attention_mask"): torch.ones(3, 7, dtype=torch.bool),
            "advantage": torch.tensor([1.0, -0.5, 2.0]).view(3, 1, 1),
        },
        batch_size=[3],
    )
    with torch.no_grad():
        own = actor(batch.copy())["log_probs", "full"]
    batch.set(("log_probs", "full"), own.detach().clone())
    return actor, batch


def losses(actor, batch, **kwargs):
    from torchrl.objectives.llm import GRPOLoss

    common = {"masking_strategy": "sft", "entropy_bonus": False}
    ref = GRPOLoss(actor, **common)(batch.copy())
    ours = CorrectedGRPOLoss(actor, **common, **kwargs)(batch.copy())
    return ref, ours


@pytest.mark.parametrize("mode", [None, *MODES])
def test_equal_log_probs_give_torchrls_loss(scored_batch, mode):
    actor, batch = scored_batch
    ref, ours = losses(actor, batch, rollout_correction=mode, is_clip_low=0.5)
    torch.testing.assert_close(ours.loss_objective, ref.loss_objective, rtol=1e-6, atol=1e-7)
    mm = ours.mismatch
    close(mm["tokens"], 9)  # 3 rows x 3 response tokens (sft: the response only)
    assert float(mm["kl_k3"]) < 1e-10 and float(mm["logp_abs_diff_max"]) < 1e-5
    close(mm["weight_mean"], 1.0)
    close(mm["clipped_fraction"], 0.0)
    close(mm["masked_fraction"], 0.0)


def shifted(batch, row: int, col: int, by: float):
    """The batch with the engine's log-prob of one response token lowered by ``by``
    (the trainer's ratio there is e^by)."""
    out = batch.copy()
    lp = out.get(("log_probs", "full")).clone()
    lp[row, 4 + col] -= by
    out.set(("log_probs", "full"), lp)
    return out


def test_without_a_mode_the_loss_is_torchrls_and_the_mismatch_shows(scored_batch):
    actor, batch = scored_batch
    batch = shifted(batch, 0, 1, 2.0)
    ref, ours = losses(actor, batch)
    torch.testing.assert_close(ours.loss_objective, ref.loss_objective, rtol=0, atol=0)
    torch.testing.assert_close(ours.ESS, ref.ESS, rtol=0, atol=0)
    close(ours.mismatch["logp_abs_diff_max"], 2.0)
    close(ours.mismatch["is_ratio_max"], math.exp(2.0))
    close(ours.mismatch["kl_k3"], (math.exp(2.0) - 1 - 2.0) / 9)


def test_token_truncate_weighs_each_token_by_its_bounded_ratio(scored_batch):
    actor, batch = scored_batch
    batch = shifted(shifted(batch, 0, 1, 2.0), 2, 0, -3.0)  # r = e^2 (row A=1), e^-3 (A=2)
    ref, ours = losses(actor, batch, rollout_correction="token_truncate", is_clip=2.0)
    # PPO's ratio is now against the trainer's own log-probs (1 on this first pass), so
    # each token's loss is -weight * advantage, averaged over the 9 tokens.
    advantage = [1.0, -0.5, 2.0]
    weights = [[1, 2.0, 1], [1, 1, 1], [math.exp(-3.0), 1, 1]]
    expected = -sum(a * sum(w) for a, w in zip(advantage, weights, strict=True)) / 9
    close(ours.loss_objective, expected)
    assert not torch.isclose(ours.loss_objective, ref.loss_objective)
    close(ours.mismatch["clipped_fraction"], 1 / 9)
    close(ours.clip_fraction, 0.0)


def test_masked_token_gets_no_gradient(scored_batch):
    actor, batch = scored_batch
    batch = shifted(batch, 0, 1, 2.0)
    loss = CorrectedGRPOLoss(
        actor, masking_strategy="sft", entropy_bonus=False, rollout_correction="token_mask"
    )
    out = loss(batch)
    close(out.mismatch["masked_fraction"], 1 / 9)
    # Only the masked token's weight changed: the loss is -sum(A * tokens) / 9 without it.
    close(out.loss_objective, -(1.0 * 2 - 0.5 * 3 + 2.0 * 3) / 9)
    assert loss.metrics_seconds > 0


def test_the_trainer_log_probs_key_anchors_later_updates(scored_batch):
    actor, batch = scored_batch
    batch = shifted(batch, 0, 1, 2.0)
    # A later update whose first pass scored every token 0.1 above the engine: r counts
    # from that pass (this forward's r is e^2 on one token, which token_truncate would clip).
    first = batch.get(("log_probs", "full")).clone()
    first[:, 4:] += 0.1
    batch.set(("trainer_log_probs", "full"), first)
    loss = CorrectedGRPOLoss(
        actor, masking_strategy="sft", entropy_bonus=False, rollout_correction="token_truncate"
    )
    out = loss(batch)
    close(out.mismatch["kl_k1"], -0.1)
    close(out.mismatch["clipped_fraction"], 0.0)


def test_metrics_can_be_turned_off(scored_batch):
    actor, batch = scored_batch
    _, ours = losses(actor, batch, rollout_correction="token_truncate", mismatch_metrics=False)
    assert ours.mismatch is None


# ---------------------------------------------------------------- the GRPO job's pieces
def test_the_job_summarises_the_mismatch_at_start_middle_and_end():
    from torchrl_vllm_ext.grpo.report import MISMATCH_FIGURES, mismatch_summary, mismatch_table

    steps = [
        {"mismatch_s": 0.002, **{f"mismatch_{k}": float(i) for k in MISMATCH_FIGURES}}
        for i in range(40)
    ]
    out = mismatch_summary(steps, step_s=0.25, window=10)
    assert out["mismatch"]["kl_k3"] == {"start": 4.5, "middle": 19.5, "end": 34.5}
    assert out["mismatch_share_of_step"] == pytest.approx(0.008)
    assert "kl_k3" in mismatch_table(out) and "0.80% of the median step" in mismatch_table(out)
    assert mismatch_summary([{"reward": 1.0}], step_s=0.25) == {}  # a run without the metrics


def test_the_reward_plot_draws_the_mismatch_beside_it(tmp_path):
    from torchrl_vllm_ext.grpo.report import MISMATCH_FIGURES, PHASES, plot_run, summarize

    steps = [
        {
            "step": i,
            "reward": i / 20,
            "elapsed_s": i * 0.2,
            "tokens_per_s": 100.0,
            "kl_to_engine": 0.0,
            "mismatch_s": 0.001,
            **{f"{p}_s": 0.05 for p in PHASES},
            **{f"mismatch_{k}": 0.0 if i % 2 else 1e-4 for k in MISMATCH_FIGURES},
        }
        for i in range(20)
    ]
    summary = summarize(steps, target=0.8, random_reward=0.1)
    assert plot_run(steps, summary, tmp_path / "curve.png").stat().st_size > 0


def test_the_demo_takes_the_correction_flags():
    from torchrl_vllm_ext.cli import build_parser
    from torchrl_vllm_ext.grpo.config import GRPOConfig
    from torchrl_vllm_ext.jobs.demo import FLAGS
    from torchrl_vllm_ext.jobs.flags import config_from_args

    args = build_parser().parse_args(
        "demo --rollout-correction token_mask --is-clip 2.5 --is-clip-low 0.5 "
        "--replica-dtype bfloat16".split()
    )
    cfg = config_from_args(GRPOConfig, args, FLAGS)
    assert (cfg.rollout_correction, cfg.is_clip, cfg.is_clip_low) == ("token_mask", 2.5, 0.5)
    assert cfg.replica_dtype == "bfloat16" and cfg.dtype == "float32"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--rollout-correction", "tis"])


# ---------------------------------------------------------------- the batch-invariant switch
def test_batch_invariant_kernels_are_refused_where_they_cannot_run():
    from types import SimpleNamespace

    from torchrl_vllm_ext.engine.driver import batch_invariance

    on = SimpleNamespace(batch_invariant=True)
    with pytest.raises(ConfigurationError, match="needs GPU replicas"):
        batch_invariance.check(False, on)  # CPU replicas
    batch_invariance.check(False, SimpleNamespace(batch_invariant=False))  # off: no check
    why = batch_invariance.refusal(use_gpu=True, kernels=True, capabilities=[(9, 0), (7, 5)])
    assert "compute capability >= 8.0" in why and "7.5" in why
    assert "no batch-invariant kernels" in batch_invariance.refusal(
        use_gpu=True, kernels=False, capabilities=[(9, 0)]
    )
    assert batch_invariance.refusal(use_gpu=True, kernels=True, capabilities=[(8, 0)]) is None
    assert batch_invariance.replica_env(on) == {"VLLM_BATCH_INVARIANT": "1"}
    assert batch_invariance.replica_env(SimpleNamespace(batch_invariant=False)) == {}

"""GRPO on TorchRL's CountdownEnv with vLLM replicas as the rollout engine.

The layout of TorchRL's ``sota-implementations/grpo/grpo-sync.py``, with this package in
place of TorchRL's vLLM backend:

1. engine: ``VLLMService`` (vLLM replicas as Ray actors; TorchRL: ``AsyncVLLM``);
2. inference policy: ``VLLMPolicy`` in history mode (TorchRL: ``vLLMWrapper``);
3. ``LLMCollector`` on ``CountdownEnv`` (``repeats`` = GRPO group size), writing into a
   ``ReplayBuffer`` (``LazyStackStorage``) whose ``MCAdvantage`` transform computes each
   group's advantages as the group lands;
4. ``GRPOLoss`` on a ``TransformersWrapper`` around the trainer's transformers model;
5. after each optimizer step, ``collector.update_policy_weights_(...)`` pushes the new
   weights into every replica (``WeightSyncUpdater`` over ``WeightSyncScheme``).

Run it (the tiny random model cannot learn Countdown: rewards stay near 0; the point is
the plumbing, and the numbers it prints are real)::

    python examples/grpo_countdown.py --steps 20 --replicas 2

It writes ``metrics.json`` (per-step reward, loss, timings, versions and a summary) and
``vllm.log`` (the replicas' output) to ``--output``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import statistics
import time
import warnings
from pathlib import Path

import torch

logger = logging.getLogger("grpo_countdown")

# vLLM-CPU engine settings: CountdownEnv's system + user prompt is ~370 tokens with the
# tiny model's tokenizer, so 512 positions hold it and a short answer.
MAX_MODEL_LEN = 512
CPU_KV_CACHE_BYTES = 64 << 20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20, help="GRPO steps (collect, train, push)")
    p.add_argument("--replicas", type=int, default=1, help="vLLM replicas")
    p.add_argument("--seed", type=int, default=0, help="seed of the model, problems and sampling")
    p.add_argument("--output", default="grpo_countdown", help="metrics.json, vllm.log go here")
    p.add_argument("--model", default=None, help="local HF model dir (default: the tiny Qwen2)")
    p.add_argument("--prompts", type=int, default=2, help="Countdown problems per step")
    p.add_argument("--group-size", type=int, default=4, help="samples per problem (env repeats)")
    p.add_argument("--max-tokens", type=int, default=24, help="tokens sampled per answer")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--entropy-coeff", type=float, default=1e-4)
    p.add_argument("--kl-to-inference-coeff", type=float, default=1e-2)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    for name in ("steps", "replicas", "prompts", "group_size", "max_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.group_size < 2:
        p.error("--group-size must be >= 2: GRPO normalises rewards within a group")
    return args


# ---------------------------------------------------------------------------- builders
def make_env(tokenizer, args: argparse.Namespace):
    """CountdownEnv: ``prompts`` problems per batch, each repeated ``group_size`` times
    (sota's ``make_env``: ``repeats`` is the GRPO group, one dialog turn per episode)."""
    from torchrl.envs.llm.datasets.countdown import CountdownEnv

    return CountdownEnv(
        tokenizer=tokenizer,
        num_envs=args.prompts * args.group_size,
        repeats=args.group_size,
        max_steps=1,
        seed=args.seed,
        device=torch.device("cpu"),
    )


def launch_engine(model_path: Path, args: argparse.Namespace, log_file: Path):
    """The rollout engine: ``args.replicas`` vLLM replicas behind one service."""
    from torchrl_vllm_ext import VLLMService

    engine_kwargs = {"max_model_len": MAX_MODEL_LEN, "seed": args.seed}
    if not torch.cuda.is_available():
        engine_kwargs.update(enforce_eager=True, kv_cache_memory_bytes=CPU_KV_CACHE_BYTES)
    # This line replaces TorchRL's AsyncVLLM.from_pretrained(model_name, num_replicas=...).
    return VLLMService.launch(
        model_path,
        num_replicas=args.replicas,
        dtype="float32",
        log_file=str(log_file),  # vLLM's own output goes there, not to the terminal
        **engine_kwargs,
    )


def make_inference_policy(service, args: argparse.Namespace):
    """The vLLMWrapper-compatible policy (sota's ``get_inference_model``): TorchRL's
    defaults (history mode, the engine's tokenizer). ``vLLMWrapper(service, ...)`` works
    here too; ``VLLMPolicy`` reads the replicas' batches without rebuilding vLLM objects."""
    from torchrl_vllm_ext import VLLMPolicy

    return VLLMPolicy(
        service,
        input_mode="history",
        pad_output=False,
        generate_kwargs={"max_tokens": args.max_tokens, "temperature": args.temperature},
    )


def make_train_policy(model_path: Path, tokenizer):
    """The trainer: TorchRL's TransformersWrapper scoring ``("tokens", "full")``
    (sota's ``get_train_model``, without LoRA and in fp32 so trainer and engine agree)."""
    from torchrl.modules.llm import TransformersWrapper
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    policy = TransformersWrapper(
        model,
        tokenizer=tokenizer,
        input_mode="tokens",
        generate=False,
        return_log_probs=True,
        pad_output=False,
    )
    policy.model.eval()  # as sota: no dropout, so the importance weights are exact
    return policy


def make_replay_buffer(args: argparse.Namespace):
    """LazyStackStorage of one step's samples; MCAdvantage writes a group's advantages
    when its ``group_size`` trajectories have arrived (grouped by the prompt, ``query``)."""
    from torchrl.data import LazyStackStorage, ReplayBuffer, SamplerWithoutReplacement
    from torchrl.objectives.llm import MCAdvantage

    size = args.prompts * args.group_size
    return ReplayBuffer(
        storage=LazyStackStorage(size),
        sampler=SamplerWithoutReplacement(),
        transform=MCAdvantage(grpo_size=args.group_size),
        batch_size=size,  # one optimizer step per collected batch
    )


def make_collector(env, policy, replay_buffer, scheme, args: argparse.Namespace):
    from torchrl.collectors.llm import LLMCollector

    from torchrl_vllm_ext import WeightSyncUpdater

    with warnings.catch_warnings():
        # torchrl 0.14's LLMCollector takes only the legacy WeightUpdaterBase path.
        warnings.simplefilter("ignore", DeprecationWarning)
        # One dialog turn per episode: the InitTracker TorchRL 0.14 asks for any nn.Module
        # policy has nothing to track (LLMCollector does not take its opt-out flag yet).
        warnings.filterwarnings("ignore", "The env passed to LLMCollector is missing")
        return LLMCollector(
            env,
            policy=policy,
            dialog_turns_per_batch=args.prompts * args.group_size,
            replay_buffer=replay_buffer,
            # Not vLLMUpdaterV2(service) (the service is an RLvLLMEngine and it takes it),
            # because torchrl 0.14.1's update_policy_weights_ calls
            # push_weights(policy_or_weights=...), which vLLMUpdaterV2 refuses (TypeError).
            weight_updater=WeightSyncUpdater(scheme),
            track_policy_version=True,
        )


def make_loss(policy_training, args: argparse.Namespace):
    from torchrl.objectives.llm import GRPOLoss

    return GRPOLoss(
        policy_training,
        masking_strategy="sft",  # single turn: score the response tokens
        entropy_coeff=args.entropy_coeff,
        kl_to_inference_coeff=args.kl_to_inference_coeff,
    )


def total_loss(out) -> torch.Tensor:
    """The terms GRPOLoss returned that are losses (objective, entropy, KL)."""
    terms = (out.loss_objective, out.loss_entropy, out.loss_kl_to_ref, out.loss_kl_to_inference)
    return sum(t for t in terms if t is not None)


# ---------------------------------------------------------------------------- training
def train(args: argparse.Namespace) -> dict:
    """Collect -> train -> push for ``args.steps`` steps; returns the metrics written."""
    from tqdm.auto import tqdm

    from torchrl_vllm_ext import WeightSyncScheme
    from torchrl_vllm_ext.testing import make_tiny_model

    torch.manual_seed(args.seed)
    out_dir = Path(args.output)
    out_dir.mkdir(parents=True, exist_ok=True)
    model_path = Path(args.model) if args.model else make_tiny_model(seed=args.seed)

    started = time.perf_counter()
    steps: list[dict] = []
    with contextlib.ExitStack() as stack:  # closes collector, scheme, replicas, Ray
        # Inference side, as sota's main(): engine, policy, buffer, collector.
        service = stack.enter_context(launch_engine(model_path, args, out_dir / "vllm.log"))
        scheme = stack.enter_context(WeightSyncScheme(service))
        startup_s = time.perf_counter() - started
        logger.info("%d replica(s) up in %.1f s", args.replicas, startup_s)
        tokenizer = service.get_tokenizer()  # the served model's (TorchRL's engine API)
        policy = make_inference_policy(service, args)
        replay_buffer = make_replay_buffer(args)
        collector = make_collector(make_env(tokenizer, args), policy, replay_buffer, scheme, args)
        stack.callback(collector.shutdown)
        # Trainer side, as sota's train(): TransformersWrapper, GRPOLoss, optimizer.
        policy_training = make_train_policy(model_path, tokenizer)
        loss_fn = make_loss(policy_training, args)
        optimizer = torch.optim.Adam(policy_training.parameters(), lr=args.lr)
        # No first push (sota makes one): the replicas load the checkpoint the trainer
        # loaded, so they start on the same weights as version 0.
        batches = iter(collector)
        bar = stack.enter_context(
            tqdm(total=args.steps, desc="GRPO", unit="step", disable=args.no_progress)
        )
        loop_start = time.perf_counter()
        while len(steps) < args.steps:
            t0 = time.perf_counter()
            # 1. collect: the collector writes a batch into the buffer (and yields None);
            #    MCAdvantage holds samples back until their group is complete.
            next(batches)
            if not len(replay_buffer):
                continue
            t1 = time.perf_counter()
            # 2. train: one GRPOLoss step per sampled batch (sota iterates the buffer).
            for batch in replay_buffer:
                out = loss_fn(batch)
                optimizer.zero_grad(set_to_none=True)
                loss = total_loss(out)
                loss.backward()
                grad_norm = torch.nn.utils.clip_grad_norm_(policy_training.parameters(), 1.0)
                optimizer.step()
            replay_buffer.empty()
            t2 = time.perf_counter()
            # 3. push the new weights into every replica; the collector bumps its version.
            # The TransformersWrapper itself: the push reads its transformers model.
            collector.update_policy_weights_(policy_training)
            t3 = time.perf_counter()
            reward = batch.get(("next", "reward"), as_padded_tensor=True)
            metrics = {
                "step": len(steps),
                "reward": reward.mean().item(),
                "reward_max": reward.max().item(),
                "loss": loss.item(),
                "loss_objective": out.loss_objective.item(),
                "ess": float(out.ESS),
                "kl_to_inference": float(out.kl_approx),
                "grad_norm": float(grad_norm),
                "response_tokens": sum(
                    len(t) for t in batch.get(("tokens", "response"), as_list=True)
                ),
                "policy_version": collector.policy_version,
                "weight_version": service.weight_version,
                "collect_s": t1 - t0,
                "train_s": t2 - t1,
                "sync_s": t3 - t2,
                "step_s": t3 - t0,
            }
            steps.append(metrics)
            logger.info(
                "step %d reward %.3f loss %.4f ess %.3f | collect %.2f s train %.2f s "
                "sync %.2f s | version %s",
                *(metrics[k] for k in ("step", "reward", "loss", "ess", "collect_s")),
                *(metrics[k] for k in ("train_s", "sync_s", "policy_version")),
            )
            bar.update(1)
            bar.set_postfix(reward=f"{metrics['reward']:.2f}", loss=f"{metrics['loss']:.4f}")
        loop_s = time.perf_counter() - loop_start
        served = service.weight_versions()  # what each replica serves at the end

    step_times = [m["step_s"] for m in steps]
    summary = {
        "steps": len(steps),
        "replicas": args.replicas,
        "samples_per_step": args.prompts * args.group_size,
        "startup_s": startup_s,
        "loop_s": loop_s,
        "steps_per_s": len(steps) / loop_s,
        "median_step_s": statistics.median(step_times),
        "median_collect_s": statistics.median(m["collect_s"] for m in steps),
        "median_train_s": statistics.median(m["train_s"] for m in steps),
        "median_sync_s": statistics.median(m["sync_s"] for m in steps),
        "reward_mean": statistics.fmean(m["reward"] for m in steps),
        "final_policy_version": steps[-1]["policy_version"],
        "replica_weight_versions": {str(k): v for k, v in served.items()},
    }
    result = {"config": vars(args), "summary": summary, "steps": steps}
    (out_dir / "metrics.json").write_text(json.dumps(result, indent=2))
    return result


def main(argv: list[str] | None = None) -> int:
    from tqdm.contrib.logging import logging_redirect_tqdm

    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    with logging_redirect_tqdm():  # log lines above the progress bar, not through it
        result = train(args)
    s = result["summary"]
    finite = all(math.isfinite(m["loss"]) for m in result["steps"])
    print(
        f"{s['steps']} steps in {s['loop_s']:.1f} s: {s['steps_per_s']:.2f} steps/s "
        f"(median step {s['median_step_s']:.2f} s: collect {s['median_collect_s']:.2f}, "
        f"train {s['median_train_s']:.2f}, sync {s['median_sync_s']:.2f}); "
        f"mean reward {s['reward_mean']:.3f}; policy version {s['final_policy_version']}; "
        f"losses finite: {finite}; metrics: {Path(args.output) / 'metrics.json'}"
    )
    return 0


if __name__ == "__main__":  # vLLM spawns processes: nothing runs at import
    raise SystemExit(main())

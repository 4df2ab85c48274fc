"""run_grpo: the GRPO main job, step by step (collect -> score -> train -> sync).

1. build or load the model; the trainer holds it, the replicas serve the same weights;
2. launch the replicas (Ray actors) and the weight-sync scheme;
3. loop: the LLMCollector samples ``group_size`` answers per prompt through
   :class:`~torchrl_vllm_ext.VLLMPolicy`, the env scores them, the trainer takes one
   GRPOLoss step, and ``collector.update_policy_weights_`` pushes the new weights;
4. write the rollouts (memmapped TensorDict), the metrics JSON and the reward curve.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from torchrl_vllm_ext.errors import ConfigurationError
from torchrl_vllm_ext.grpo.async_loop import AsyncLoop
from torchrl_vllm_ext.grpo.async_metrics import (
    async_summary,
    batch_staleness,
    idle_figures,
    idle_postfix,
)
from torchrl_vllm_ext.grpo.config import GRPOConfig
from torchrl_vllm_ext.grpo.data_parallel import (
    DataParallelStep,
    check_trainer_ranks,
    shard_model,
    start_trainer_ranks,
)
from torchrl_vllm_ext.grpo.report import mismatch_postfix, plot_run, summarize
from torchrl_vllm_ext.grpo.rollouts import RolloutRecorder
from torchrl_vllm_ext.grpo.trainer import restrict_vocabulary
from torchrl_vllm_ext.grpo.trainer_model import build_trainer, load_trainer_model

logger = logging.getLogger(__name__)

# A replica only ever sees prompt_len + answer_len tokens: a small context keeps its KV
# cache (and start-up) small on CPU.
MAX_MODEL_LEN = 128
CPU_KV_CACHE_BYTES = 64 << 20


LORA_RANKS = (8, 16, 32, 64, 128, 256)  # vLLM's max_lora_rank values


def engine_kwargs(cfg: GRPOConfig, *, gpu: bool) -> dict:
    """vLLM engine arguments of the demo's replicas."""
    kwargs = {
        "dtype": cfg.replica_dtype or cfg.dtype,
        "seed": cfg.seed,
        "max_model_len": MAX_MODEL_LEN,
        # The policy samples from the task's alphabet only (allowed_token_ids): report the
        # log-probs of that distribution, which the trainer's masked model reproduces.
        "logprobs_mode": "processed_logprobs",
    }
    if not gpu:
        kwargs.update(enforce_eager=True, kv_cache_memory_bytes=CPU_KV_CACHE_BYTES)
    if cfg.lora_rank:
        rank = next((r for r in LORA_RANKS if r >= cfg.lora_rank), None)
        if rank is None:
            raise ConfigurationError(
                f"--lora-rank {cfg.lora_rank} is above vLLM's {LORA_RANKS[-1]}."
            )
        kwargs.update(enable_lora=True, max_lora_rank=rank, max_loras=3)
    return kwargs


def with_lora(model, rank: int):
    """The model wrapped in a PEFT LoRA adapter of ``rank`` on every linear layer (the
    trainer then trains and pushes only the adapter)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", lora_dropout=0.0)
    return get_peft_model(model, config)


@contextlib.contextmanager
def replicas_without_torch_compile(gpu: bool):
    """CPU replicas that this process starts (with the local Ray cluster it starts for
    them) run without torch.compile; the driver's own environment is restored after.

    NOTE: under ``enforce_eager`` vLLM-CPU still compiles one op (the rank of each sampled
    token's log-prob) with inductor at a replica's first request: 12 s of a cold start on
    2 cores, 2 s once cached, and the 200 steps sample no slower without it. Ray's
    processes inherit the environment of the driver that starts the cluster, so a cluster
    joined with ``--ray-address`` keeps its own setting; so does a user's
    ``TORCH_COMPILE_DISABLE``.
    """
    if gpu or "TORCH_COMPILE_DISABLE" in os.environ:
        yield
        return
    os.environ["TORCH_COMPILE_DISABLE"] = "1"
    try:
        yield
    finally:
        del os.environ["TORCH_COMPILE_DISABLE"]


def launch_services(cfg: GRPOConfig, model_path, gpu: bool, stack: contextlib.ExitStack):
    """The policy's service and, with ``cfg.kl_coef > 0``, the reference's (else None).

    Both are entered on ``stack`` (the reference closes first; the first service owns the
    Ray cluster). Without ``cfg.cpus_per_replica`` the CPUs are split evenly between all
    replicas of both.
    """
    from torchrl_vllm_ext import VLLMService

    ref_replicas = cfg.ref_replicas if cfg.kl_coef > 0 else 0
    cpus = cfg.cpus_per_replica
    if cpus is None and ref_replicas and not gpu:
        cpus = (os.cpu_count() or 1) / (cfg.replicas + ref_replicas)
    kwargs = dict(
        cpus_per_replica=cpus,
        ray_address=cfg.ray_address,
        placement=cfg.placement,
        log_file=cfg.log_file,
        **engine_kwargs(cfg, gpu=gpu),
    )
    service = stack.enter_context(
        VLLMService.launch(model_path, num_replicas=cfg.replicas, **kwargs)
    )
    if not ref_replicas:
        return service, None
    ref = stack.enter_context(VLLMService.launch(model_path, num_replicas=ref_replicas, **kwargs))
    return service, ref


def run_grpo(
    cfg: GRPOConfig, *, progress: bool = True, on_step: Callable[[dict], None] | None = None
) -> dict:
    """Train with GRPO on vLLM replicas; returns the metrics also written to ``metrics.json``.

    ``on_step`` receives each step's metrics as they come (a notebook can plot live). With
    ``cfg.trainer_ranks > 1`` the trainer is sharded over ranks this call spawns and ends
    (:mod:`torchrl_vllm_ext.grpo.data_parallel`); call it under
    ``if __name__ == "__main__":`` in a script, as any use of multiprocessing's spawn.
    """
    check_trainer_ranks(cfg)
    if cfg.async_mode and cfg.rollout_correction is None:
        # Off-policy samples: TIS against the engine's log-probs (the behaviour policy).
        cfg = dataclasses.replace(cfg, rollout_correction="token_truncate")
    torch.manual_seed(cfg.seed)
    out_dir = Path(cfg.output)
    out_dir.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.is_available()
    model_path, tokenizer, model = load_trainer_model(cfg)
    # NOTE: sharded trainer ranks meet over gloo on the host (NCCL is not built yet).
    model.to(torch.device("cuda" if gpu and cfg.trainer_ranks == 1 else "cpu"))
    model, env, mask = _task(cfg, model)
    recorder = RolloutRecorder(
        out_dir / "rollouts",
        steps=cfg.steps,
        rows=cfg.rows_per_step,
        prompt_len=cfg.prompt_len,
        response_len=cfg.answer_len,
    )
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if cfg.trainer_ranks > 1:  # the other ranks load and shard while the replicas start
            stack.enter_context(start_trainer_ranks(cfg, model_path, env.task_token_ids))
            model = shard_model(model)
        trainer = build_trainer(cfg, model, tokenizer)
        with replicas_without_torch_compile(gpu):
            service, ref_service = launch_services(cfg, model_path, gpu, stack)
        scheme, pushes = _weight_sync(cfg, service, stack)
        startup_s = time.perf_counter() - started
        logger.info(
            "%d replicas up in %.1f s%s; weight sync: %s",
            cfg.replicas,
            startup_s,
            f" (+ {cfg.ref_replicas} reference)" if ref_service is not None else "",
            scheme.transport,
        )
        if cfg.trainer_ranks > 1:
            trainer = stack.enter_context(DataParallelStep(trainer, cfg.trainer_ranks))
        loop = (AsyncLoop if cfg.async_mode else _Loop)(cfg, trainer, recorder, model, scheme)
        if cfg.trainer_ranks > 1:  # a sharded push's value check scores the model's forward
            loop.push_guard = mask.lifted
        loop.collector, loop.updater, loop.reference = _collector(
            cfg, env, service, ref_service, scheme, tokenizer, pushes
        )
        steps = loop.run(progress, on_step)
    if not steps:
        raise ConfigurationError("no GRPO step ran; pass --steps >= 1.")
    return _written(cfg, steps, startup_s, scheme.transport, out_dir)


def _weight_sync(cfg: GRPOConfig, service, stack: contextlib.ExitStack):
    """(the scheme, what the collector's updater pushes through), entered on ``stack``:
    AdapterSync (LoRA), a WeightSyncScheme, or one with a ShardedWeightSync over it (the
    collective call every trainer rank makes; the others make theirs in ``train_rank``)."""
    from torchrl_vllm_ext import AdapterSync, ShardedWeightSync, WeightSyncScheme

    if cfg.lora_rank:  # pushes carry the adapter only; the policy samples its newest
        scheme = stack.enter_context(AdapterSync(service, "policy", keep=2))
        return scheme, scheme
    delta = {"on": True, "off": False}.get(cfg.delta, cfg.delta)
    # Asynchronous: pushes land in flight (keep) or once the generations in flight end
    # (wait); the synchronous job pushes between batches with the scheme's default.
    pause = {} if cfg.pause_mode is None else {"pause_mode": cfg.pause_mode}
    scheme = stack.enter_context(
        WeightSyncScheme(service, transport=cfg.transport, delta=delta, **pause)
    )
    if cfg.trainer_ranks == 1:
        return scheme, scheme
    return scheme, stack.enter_context(ShardedWeightSync(scheme))


def _task(cfg: GRPOConfig, model):
    """The task's env, the trainer model restricted to its alphabet (LoRA-wrapped when
    ``cfg.lora_rank``) and that restriction (a VocabularyMask)."""
    from torchrl_vllm_ext import TokenCountEnv

    env = TokenCountEnv(
        batch_size=(cfg.rows_per_step,),
        prompt_len=cfg.prompt_len,
        answer_len=cfg.answer_len,
        low=cfg.low,
        high=cfg.high,
        group_size=cfg.group_size,
        seed=cfg.seed,
        sample_seeds=True,  # reproducible sampling whatever replica serves a row
    )
    mask = restrict_vocabulary(model, env.task_token_ids)
    if cfg.lora_rank:
        model = with_lora(model, cfg.lora_rank)
    return model, env, mask


def _collector(cfg: GRPOConfig, env, service, ref_service, scheme, tokenizer, pushes):
    """TorchRL's ``LLMCollector`` over the policy, its weight updater (pushing through
    ``pushes``), and the reference transform (None without a reference service)."""
    from torchrl.collectors.llm import LLMCollector

    from torchrl_vllm_ext import ReferenceKL, VLLMPolicy, WeightSyncUpdater

    reference = None
    if ref_service is not None:
        # Scores every rollout with the initial weights (never pushed to): GRPOLoss
        # reads ("next", "ref_log_probs", "full") and runs no reference forward.
        reference = ReferenceKL(
            VLLMPolicy(
                ref_service,
                input_mode="tokens",
                generate=False,
                log_probs_key="ref_log_probs",
                pad_output=True,
                tokenizer=tokenizer,
            )
        )
        env = env.append_transform(reference)
    # Padded: TorchRL's collector clones every batch twice, and a padded batch is a few
    # dense tensors where a ragged one is a TensorDict per sample
    # (benchmarks/bench_collect.py).
    policy = VLLMPolicy(
        service,
        input_mode="tokens",
        pad_output=True,
        tokenizer=tokenizer,
        lora=scheme if cfg.lora_rank else None,
        sampling_params={
            "max_tokens": cfg.answer_len,
            "temperature": cfg.temperature,
            "allowed_token_ids": env.task_token_ids,
        },
    )
    updater = WeightSyncUpdater(pushes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # TorchRL's legacy updater path
        # A one-step env needs no InitTracker, whatever TorchRL 0.14 guesses for any
        # nn.Module policy (LLMCollector does not take auto_register_policy_transforms).
        warnings.filterwarnings("ignore", "The env passed to LLMCollector is missing")
        collector = LLMCollector(
            env,
            policy=policy,
            dialog_turns_per_batch=cfg.rows_per_step,
            weight_updater=updater,
            track_policy_version=True,
        )
    return collector, updater, reference


class _Loop:
    """The training loop: collect -> score and train -> record -> push, one step at a time."""

    def __init__(self, cfg: GRPOConfig, trainer, recorder, model, scheme):
        self.cfg, self.trainer, self.recorder = cfg, trainer, recorder
        self.model, self.scheme = model, scheme
        self.collector = self.updater = self.reference = None
        self.push_guard = contextlib.nullcontext
        """The context each push runs in (sharded: the vocabulary mask lifted)."""

    def run(self, progress: bool, on_step) -> list[dict]:
        from tqdm.auto import tqdm

        steps: list[dict] = []
        batches = iter(self.collector)
        bar = tqdm(range(self.cfg.steps), desc="GRPO", disable=not progress, unit="step")
        train_start = time.perf_counter()
        try:
            for step in bar:
                metrics = self.step(step, batches)
                metrics["elapsed_s"] = time.perf_counter() - train_start
                steps.append(metrics)
                bar.set_postfix(
                    reward=f"{metrics['reward']:.2f}",
                    tok_s=f"{metrics['tokens_per_s']:.0f}",
                    sync_s=f"{metrics['sync_s']:.2f}",
                    **({"kl_ref": f"{metrics['kl_to_ref']:.3f}"} if "kl_to_ref" in metrics else {}),
                    **idle_postfix(metrics),
                    **mismatch_postfix(metrics),
                )
                if on_step is not None:
                    on_step(metrics)
        finally:
            bar.close()
            self.collector.shutdown()
        return steps

    def step(self, step: int, batches) -> dict:
        t0 = time.perf_counter()
        batch = next(batches)
        generate_s = time.perf_counter() - t0
        consumed = int(self.collector.policy_version)  # the weights trained (0: none pushed)
        metrics = self.trainer.step(batch)
        self.recorder.record(step, batch, consumed_version=consumed)
        t1 = time.perf_counter()
        with self.push_guard():
            self.collector.update_policy_weights_(self.model)
        sync_s = time.perf_counter() - t1
        report = self.updater.last_report
        if self.reference is not None:
            metrics["ref_s"] = self.reference.seconds
        metrics.update(
            step=step,
            generate_s=generate_s,
            sync_s=sync_s,
            sync_pause_s=max(report.pause_s.values(), default=0.0),
            sync_sent_share=getattr(report, "sent_share", 1.0),
            sync_delta=getattr(report, "base", None) is not None,
            tokens_per_s=self.cfg.rows_per_step * self.cfg.answer_len / generate_s,
            weight_version=int(self.scheme.version),
            consumed_version=consumed,
            # The same figures as the asynchronous loop's: here the trainer waits for
            # every generation and the replicas for every step and push.
            **batch_staleness(batch, consumed),
            **idle_figures(
                step_s=time.perf_counter() - t0,
                trainer_idle_s=generate_s,
                rollout_busy_s=generate_s,
                tokens=self.cfg.rows_per_step * self.cfg.answer_len,
            ),
        )
        return metrics


def _written(cfg: GRPOConfig, steps: list[dict], startup_s: float, transport, out_dir) -> dict:
    """The run's summary, its plot and ``metrics.json``, written; the result."""
    summary = summarize(steps, target=cfg.target_fraction, random_reward=1.0 / (cfg.high - cfg.low))
    summary.update(
        startup_s=startup_s,
        transport=transport,
        replicas=cfg.replicas,
        trainer_ranks=cfg.trainer_ranks,
        **async_summary(steps),
    )
    result = {
        "config": cfg.to_json(),
        "summary": summary,
        "steps": steps,
        "files": {
            "reward_curve": str(out_dir / "reward_curve.png"),
            "metrics": str(out_dir / "metrics.json"),
            "rollouts": str(out_dir / "rollouts"),
        },
    }
    plot_run(steps, summary, out_dir / "reward_curve.png")
    (out_dir / "metrics.json").write_text(json.dumps(result, indent=2))
    return result


__all__ = [
    "build_trainer",
    "engine_kwargs",
    "launch_services",
    "load_trainer_model",
    "run_grpo",
]

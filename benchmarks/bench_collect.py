"""Collected tokens/s: async collection against the synchronous loop, same task, one run.

Task: :class:`~torchrl_vllm_ext.TokenCopyEnv` on a tiny random Qwen2 served by two
replicas. Each of ``--rounds`` trainer steps is a simulated training step (``--train-s``
of sleep, so the trainer does not compete with the engines for the CPU), a weight
perturbation and a push through the storage transport:

* sync: collect one batch with ``LLMCollector``, train, push; repeat;
* async: :class:`~torchrl_vllm_ext.AsyncCollection` (TorchRL's ``LLMCollector.start()``
  thread into a ``ReplayBuffer``, ``staleness="wait"``, ``max_policy_lag=1``) collects
  while the trainer trains on batch ``k`` at version ``k`` and pushes.

The two alternate ``--repeats`` times; medians are reported.

Collector overhead (the demo's step, ``--overhead-rounds``): the same requests
(:class:`~torchrl_vllm_ext.TokenCountEnv`, 8 prompts x 16 samples, 4 tokens each, the
task's alphabet only, a seed per row) served three ways, back to back in alternating
order: ``engine`` (``VLLMService.generate_request_batch``: routing, the Ray calls, vLLM),
``policy`` (``VLLMPolicy`` on the env's reset TensorDict) and ``collector``
(``LLMCollector`` yielding one batch: reset, policy, env step, the collector's
bookkeeping), the last two also with ``pad_output=True`` (``_padded``), and the padded
collector with a :class:`~torchrl_vllm_ext.ReferenceKL` on the env
(``_padded_reference``; the same replicas score as the reference). ``*_over_engine``
are ratios of medians; ``reference_share_of_collector_step`` is the reference's scoring
time over that collector step. Tokens are response tokens
written to the buffer (async) or returned by the collector (sync) during the rounds;
``sync_share`` is the summed ``SyncReport.seconds`` over the wall time. Async also
reports the tokens of the rows the trainer consumed only (it collects up to
``max_policy_lag + 1`` batches ahead).

    python benchmarks/bench_collect.py [--rounds 6] [--repeats 2]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
import warnings

import torch

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def perturb(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.01)


def response_tokens(td) -> int:
    """Response tokens of every row of ``td`` (ragged, any batch shape)."""

    def count(rows) -> int:
        return sum(count(r) if isinstance(r, list) else r.numel() for r in rows)

    return count(td.get(("tokens", "response"), as_list=True))


def run_sync(svc, scheme, trainer, args, env) -> dict:
    from torchrl.collectors.llm import LLMCollector

    from torchrl_vllm_ext import VLLMPolicy, WeightSyncUpdater

    policy = VLLMPolicy(
        svc,
        input_mode="tokens",
        sampling_params={"max_tokens": args.max_tokens, "ignore_eos": True},
    )
    updater = WeightSyncUpdater(scheme)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        collector = LLMCollector(
            env,
            policy=policy,
            dialog_turns_per_batch=args.batch,
            weight_updater=updater,
            track_policy_version=True,
        )
    tokens, sync_s = 0, 0.0
    batches = iter(collector)
    start = time.perf_counter()
    for step in range(args.rounds):
        tokens += response_tokens(next(batches))
        time.sleep(args.train_s)  # the training step
        perturb(trainer, step)
        collector.update_policy_weights_(trainer)
        sync_s += updater.last_report.seconds
    wall = time.perf_counter() - start
    collector.shutdown()
    return {"tokens_per_s": tokens / wall, "wall_s": wall, "sync_share": sync_s / wall}


def run_async(svc, scheme, trainer, args, env) -> dict:
    from torchrl.data import LazyStackStorage, ReplayBuffer

    from torchrl_vllm_ext import AsyncCollection, VLLMPolicy

    policy = VLLMPolicy(
        svc,
        input_mode="tokens",
        sampling_params={"max_tokens": args.max_tokens, "ignore_eos": True},
    )
    rb = ReplayBuffer(storage=LazyStackStorage(100_000))
    collection = AsyncCollection(
        env,
        policy,
        scheme,
        rb,
        dialog_turns_per_batch=args.batch,
        max_policy_lag=1,
        staleness="wait",
    )
    sync_s = 0.0
    start = time.perf_counter()
    with collection:
        for step in range(args.rounds):
            while len(rb) < args.batch * (step + 1):  # batch ``step``, FIFO
                time.sleep(0.002)
            time.sleep(args.train_s)  # the training step
            perturb(trainer, step)
            sync_s += collection.update_policy_weights_(trainer).seconds
        wall = time.perf_counter() - start
        rows = rb.storage.get(list(range(len(rb.storage))))
    consumed = rows[: args.batch * args.rounds]
    return {
        "tokens_per_s": response_tokens(rows) / wall,
        "consumed_tokens_per_s": response_tokens(consumed) / wall,
        "wall_s": wall,
        "sync_share": sync_s / wall,
        "held_back_s": collection.gate.waited_s,
        "dropped": collection.dropped,
    }


def run_overhead(svc, rounds: int) -> dict:
    """Median seconds of one demo batch through the engine, the policy and the collector,
    in TorchRL's two layouts (ragged rows, and padded ``pad_output=True``)."""
    from torchrl.collectors.llm import LLMCollector

    from torchrl_vllm_ext import ReferenceKL, TokenCountEnv, VLLMPolicy

    def make_env():
        return TokenCountEnv(batch_size=(128,), group_size=16, seed=0, sample_seeds=True)

    env = make_env()
    sampling = {"max_tokens": env.answer_len, "allowed_token_ids": env.task_token_ids}
    first = env.reset()
    prompts = first.get(("tokens", "prompt")).tolist()
    params = [{**sampling, "seed": int(s)} for s in first.get("seed")]
    calls = {"engine": lambda: svc.generate_request_batch(prompts, params)}
    collectors = []
    reference = ReferenceKL(
        VLLMPolicy(svc, input_mode="tokens", generate=False, log_probs_key="ref_log_probs", pad_output=True,
                   pad_token_id=0)
    )  # fmt: skip
    ref_seconds: list[float] = []
    for suffix, pad, env in (
        ("", False, make_env()),
        ("_padded", True, make_env()),
        ("_padded_reference", True, make_env().append_transform(reference)),
    ):
        policy = VLLMPolicy(
            svc, input_mode="tokens", sampling_params=sampling, pad_output=pad, pad_token_id=0
        )
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "The env passed to LLMCollector is missing")
            collector = LLMCollector(env, policy=policy, dialog_turns_per_batch=128)
        collectors.append(collector)
        batches = iter(collector)
        if suffix != "_padded_reference":
            calls[f"policy{suffix}"] = lambda p=policy: p(first.clone())
            calls[f"collector{suffix}"] = lambda b=batches: next(b)
        else:

            def collect_with_reference(b=batches):
                next(b)
                ref_seconds.append(reference.seconds)

            calls[f"collector{suffix}"] = collect_with_reference
    times: dict[str, list[float]] = {name: [] for name in calls}
    for fn in calls.values():  # warm-up
        fn()
    for i in range(rounds):
        order = list(calls) if i % 2 == 0 else list(reversed(calls))
        for name in order:
            t0 = time.perf_counter()
            calls[name]()
            times[name].append(time.perf_counter() - t0)
    for collector in collectors:
        collector.shutdown()
    med = {name: statistics.median(v) for name, v in times.items()}
    step = med["collector_padded_reference"]
    return {
        # The reference scores on the same replicas here (one service): its share of the
        # collector step, as a GRPO step with a reference service on the same cores pays.
        "reference_s": round(statistics.median(ref_seconds), 4),
        "reference_share_of_collector_step": round(statistics.median(ref_seconds) / step, 3),
        "task": "TokenCountEnv 8 prompts x 16 samples, 4 tokens, allowed ids, seeded rows",
        "rounds": rounds,
        **{f"{name}_s": round(v, 4) for name, v in med.items()},
        **{f"{name}_over_engine": round(v / med["engine"], 3) for name, v in med.items()
           if name != "engine"},
    }  # fmt: skip


def main(args) -> dict:
    from transformers import AutoModelForCausalLM

    from torchrl_vllm_ext import TokenCopyEnv, VLLMService, WeightSyncScheme
    from torchrl_vllm_ext.testing import make_tiny_model

    model_dir = make_tiny_model(seed=0)
    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    runs: dict[str, list[dict]] = {"sync": [], "async": []}
    with VLLMService.launch(
        model_dir,
        num_replicas=args.replicas,
        cpus_per_replica=1.0,
        dtype="float32",
        max_model_len=256,
        enforce_eager=True,
        health_check_interval=0,
    ) as svc:
        overhead = run_overhead(svc, args.overhead_rounds) if args.overhead_rounds else None
        for i in range(args.repeats):
            for name, fn in (("sync", run_sync), ("async", run_async)):
                # A fresh scheme per run: versions restart at 1 with each collector.
                with WeightSyncScheme(svc, transport="storage", pause_mode="keep") as scheme:
                    env = TokenCopyEnv(batch_size=(args.batch,), prompt_len=4, seed=i)
                    runs[name].append(fn(svc, scheme, trainer, args, env))

    def med(name, key):
        return round(statistics.median(r[key] for r in runs[name]), 3)

    return {
        "task": f"TokenCopyEnv batch={args.batch} max_tokens={args.max_tokens}",
        "rounds": args.rounds,
        "repeats": args.repeats,
        "train_step_s": args.train_s,
        "sync_tokens_per_s": med("sync", "tokens_per_s"),
        "async_tokens_per_s": med("async", "tokens_per_s"),
        "async_over_sync": round(med("async", "tokens_per_s") / med("sync", "tokens_per_s"), 2),
        # Only the rows the trainer consumed (the sync loop collects nothing ahead).
        "async_consumed_tokens_per_s": med("async", "consumed_tokens_per_s"),
        "sync_wall_s": med("sync", "wall_s"),
        "async_wall_s": med("async", "wall_s"),
        "weight_sync_share_sync_loop": med("sync", "sync_share"),
        "weight_sync_share_async": med("async", "sync_share"),
        "async_held_back_s": med("async", "held_back_s"),
        "async_dropped_rows": sum(r["dropped"] for r in runs["async"]),
        "collector_overhead": overhead,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--train-s", type=float, default=0.3)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--overhead-rounds", type=int, default=20, help="0 skips it")
    logging.basicConfig(level=logging.WARNING)
    print(json.dumps(main(parser.parse_args()), indent=2))

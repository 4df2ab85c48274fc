"""LoRA RL figures: an adapter push against a full-weight push of the same base, in one run.

Model: a random Qwen2 of ~350 MB fp32 (the one ``bench_sync.py`` uses), two replicas
launched with ``enable_lora=True``; the adapter: PEFT LoRA of rank ``--rank`` on every
linear layer. Alternating each repeat, with no idle gap:

* full: ``WeightSyncScheme(transport="storage").push(model)``: time to every replica
  serving the new weights, and the longest generation pause;
* adapter: ``AdapterSync.push(peft_model)``: pack into a shared-memory slot (a memfd, no
  file) and validate there, then every replica (all on this node) maps it and its
  workers build the adapter from it, labelling the version in the same call; vLLM loads
  an adapter without pausing generation (pause 0);
* generation tokens/s of the same batch with and without the adapter.

    python benchmarks/bench_lora.py [--repeats 5] [--rank 16]

Prints one JSON object. Target: adapter push >= 10x faster than the full push.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time

import torch
from devices import CPU_PUSH_SERVICE

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def perturb(params, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn(p.shape, generator=gen) * 1e-3)


def tokens_per_s(svc, prompts, params, lora=None) -> float:
    start = time.perf_counter()
    out = svc.generate_request_batch(prompts, params, lora=lora)
    return int(out.sample_lengths.sum()) / (time.perf_counter() - start)


def main(args) -> dict:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from torchrl_vllm_ext import AdapterSync, VLLMService, WeightSyncScheme
    from torchrl_vllm_ext.testing import make_tiny_model

    model_dir = make_tiny_model(hidden_size=args.hidden, num_layers=args.layers, seed=0)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    full_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    peft_model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=TARGETS),
    )
    lora_params = [p for n, p in peft_model.named_parameters() if "lora_" in n]
    prompts = [[5 + i, 6, 7, 8] for i in range(args.prompts)]
    params = {"max_tokens": args.max_tokens, "ignore_eos": True}
    runs: dict[str, list[float]] = {
        k: [] for k in ("full_s", "full_pause_s", "adapter_s", "base_tok_s", "adapter_tok_s")
    }
    adapter_phases: list[dict] = []
    with (
        VLLMService.launch(
            model_dir,
            **CPU_PUSH_SERVICE,
            dtype="float32",
            enable_lora=True,
            max_lora_rank=max(16, args.rank),
            max_loras=3,
        ) as svc,
        WeightSyncScheme(svc, transport="storage") as scheme,
        AdapterSync(svc, "policy", keep=2) as sync,
    ):
        sync.push(peft_model, 0)  # warm-up both paths
        scheme.push(base, version=0)
        for i in range(args.repeats):
            perturb(lora_params, i)
            perturb(base.parameters(), i)
            order = ["adapter", "full"] if i % 2 == 0 else ["full", "adapter"]
            for kind in order:
                if kind == "adapter":
                    report = sync.push(peft_model, i + 1)
                    runs["adapter_s"].append(report.seconds)
                    adapter_phases.append(report.phases)
                else:
                    report = scheme.push(base, version=i + 1)
                    runs["full_s"].append(report.seconds)
                    runs["full_pause_s"].append(max(report.pause_s.values()))
            for lora in [None, sync.current] if i % 2 == 0 else [sync.current, None]:
                key = "base_tok_s" if lora is None else "adapter_tok_s"
                runs[key].append(tokens_per_s(svc, prompts, params, lora))
        adapter_bytes = sum(p.numel() * p.element_size() for p in lora_params)

    med = {k: statistics.median(v) for k, v in runs.items()}
    return {
        "model": f"random Qwen2 hidden={args.hidden} layers={args.layers}, {full_bytes / 1e6:.0f} MB fp32",
        "adapter": f"LoRA r={args.rank} on {','.join(TARGETS)}, {adapter_bytes / 1e6:.1f} MB",
        "repeats": args.repeats,
        "full_push_s": round(med["full_s"], 4),
        "full_pause_s": round(med["full_pause_s"], 4),
        "adapter_push_s": round(med["adapter_s"], 4),
        "adapter_pause_s": 0.0,
        "adapter_phases_s": {
            k: round(statistics.median(p[k] for p in adapter_phases), 4) for k in adapter_phases[0]
        },
        "adapter_speedup_vs_full": round(med["full_s"] / med["adapter_s"], 2),
        "bytes_ratio_full_over_adapter": round(full_bytes / adapter_bytes, 1),
        "base_tokens_per_s": round(med["base_tok_s"], 1),
        "adapter_tokens_per_s": round(med["adapter_tok_s"], 1),
        "adapter_over_base_tokens_per_s": round(med["adapter_tok_s"] / med["base_tok_s"], 3),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=640)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    logging.basicConfig(level=logging.WARNING)
    print(json.dumps(main(parser.parse_args()), indent=2))

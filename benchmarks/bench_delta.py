"""Delta pushes against full pushes, in the same run: fp32 masters trained by Adam, two CPU
replicas serving bfloat16.

Model: a random Qwen2 of ~350 MB fp32 (hidden 640, 24 layers; ``--hidden``/``--layers``).
For each learning rate (``--lrs``, default 1e-6 and 1e-5) a fresh trainer takes real Adam
steps (next-token loss on seeded random tokens) and pushes after every step. Per transport
(storage, gloo broadcast), ``--rounds`` rounds of two blocks of ``--block`` steps each,
alternating which block goes first: one block pushes through a scheme with
``delta="auto"`` (its first push, untimed, is the base: a full push), the other through one
with ``delta=False`` (every byte, as pushed: the package before delta pushes). After each
delta block the same weights are pushed whole and every replica's parameters must be bit
for bit what they were after the deltas (the testing worker's checksums); each block's
first push is checked by value (the scheme's default), the timed ones are not (the check
adds the same probe to both systems).

Per system: push wall time and the longest replica pause (medians), bytes moved
(``SyncReport.sent_bytes``), and the share of bf16 values a step changed. ``--dense-shares``
also times, on one 64 MB bf16 bucket, writing a share of changed values by position
against copying the bucket whole (what ``delta.DENSE_SHARE`` rests on); ``--scatter-shares``
the pause writing a share of every tensor by position (``loading.scatter``) against a replay
of the whole plan, on bf16 layers of the bench model's shapes (what
``scatter.SCATTER_SHARE`` rests on).

    python benchmarks/bench_delta.py [--lrs 1e-6 1e-5] [--rounds 2] [--block 5]

Prints one JSON object (last line).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time

import torch
from devices import CPU_PUSH_SERVICE

from torchrl_vllm_ext.weight_sync.transports import registry

logger = logging.getLogger("bench_delta")

TRANSPORTS = registry.delta_names()


def adam_trainer(model_dir: str, lr: float, seed: int = 0):
    """A fp32 model and a ``step()`` that takes one Adam step on seeded random tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size

    def step() -> None:
        ids = torch.randint(0, vocab, (2, 32), generator=generator)
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    return model, step


def changed_share(before: dict[str, torch.Tensor], model) -> float:
    """The share of bf16 values of ``model`` that differ from ``before`` (bf16 copies)."""
    changed = total = 0
    for name, p in model.named_parameters():
        now = p.detach().to(torch.bfloat16).view(torch.int16)
        changed += int((now != before[name].view(torch.int16)).sum())
        total += p.numel()
    return changed / total


def bf16_copy(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}


def served_sums(svc) -> dict:
    import ray

    from torchrl_vllm_ext.testing.worker import TestingMethods

    return {
        v.replica_id: ray.get(v.handle.collective_rpc.remote(TestingMethods.CHECKSUMS, ()))
        for v in svc.replicas()
    }


def block(svc, transport: str, system: str, model, step, n: int, tag: str) -> dict:
    """``n`` training steps, each pushed through a scheme of ``system`` (timed)."""
    from torchrl_vllm_ext import WeightSyncScheme

    delta = "auto" if system == "delta" else False
    out = {"push_s": [], "pause_s": [], "sent_bytes": [], "nbytes": 0, "changed": [], "bases": []}
    with WeightSyncScheme(svc, transport=transport, delta=delta) as scheme:
        # untimed, checked by value (verify="first"): the group, the base, the slot
        scheme.push(model, version=f"{tag}-base")
        for i in range(n):
            before = bf16_copy(model)
            step()
            out["changed"].append(changed_share(before, model))
            t0 = time.perf_counter()
            report = scheme.push(model, version=f"{tag}-{i}")
            out["push_s"].append(time.perf_counter() - t0)
            out["pause_s"].append(max(report.pause_s.values()))
            out["sent_bytes"].append(report.sent_bytes)
            out["bases"].append(report.base)
            out["nbytes"] = report.nbytes
            out["phases"] = {k: round(v, 4) for k, v in report.phases.items()}
    if system == "delta":  # the same weights pushed whole leave the same bits
        sums = served_sums(svc)
        with WeightSyncScheme(svc, transport=transport, delta=False) as full:
            full.push(model, version=f"{tag}-full")
        out["bitwise_equal_to_full"] = served_sums(svc) == sums
    return out


def merge(blocks: list[dict]) -> dict:
    push = [t for b in blocks for t in b["push_s"]]
    pause = [t for b in blocks for t in b["pause_s"]]
    sent = [s for b in blocks for s in b["sent_bytes"]]
    out = {
        "pushes": len(push),
        "push_s": statistics.median(push),
        "pause_s": statistics.median(pause),
        "sent_mb": statistics.median(sent) / 1e6,
        "model_mb": blocks[0]["nbytes"] / 1e6,
        "changed_share": statistics.median(c for b in blocks for c in b["changed"]),
        "phases": blocks[-1]["phases"],
    }
    if "bitwise_equal_to_full" in blocks[0]:
        out["bitwise_equal_to_full"] = all(b["bitwise_equal_to_full"] for b in blocks)
        out["full_pushes_among_them"] = sum(base is None for b in blocks for base in b["bases"])
    return out


def dense_shares(shares: list[float], mb: int = 64) -> dict:
    """Seconds to write ``share`` of a bf16 bucket's values by position vs whole."""
    from torchrl_vllm_ext.weight_sync import delta
    from torchrl_vllm_ext.weight_sync.specs import BucketSpec, TensorSpec

    n = (mb << 20) // 2
    old = torch.randn(n).to(torch.bfloat16).view(torch.uint8)
    spec = BucketSpec("bfloat16", (TensorSpec("w", "bfloat16", (n,)),), 2 * n, 0)
    out = {}
    for share in shares:
        new = old.clone().view(torch.int16)
        idx = torch.randperm(n, generator=torch.Generator().manual_seed(0))[: int(share * n)]
        new[idx] += 1
        new = new.view(torch.uint8)
        sparse, payload, _ = delta.diff_and_sum(new, old, spec, dense_share=1.0)
        held = old.clone()
        t0 = time.perf_counter()
        delta.apply_bucket(held, spec, sparse, payload)
        t1 = time.perf_counter()
        held.copy_(new)
        t2 = time.perf_counter()
        out[share] = {
            "by_position_s": t1 - t0,
            "whole_s": t2 - t1,
            "payload_mb": payload.numel() / 1e6,
        }
    return out


class _FusedLayers(torch.nn.Module):
    """bf16 layers shaped as the bench model's (fused qkv and gate_up, as vLLM serves them),
    loaded by a vLLM-style loader: what ``scatter_shares`` plans and scatters into."""

    def __init__(self, layers: int, hidden: int, ff: int):
        super().__init__()
        self.hidden, self.ff = hidden, ff
        shapes = {"qkv": (3 * hidden, hidden), "gate_up": (2 * ff, hidden)}
        shapes.update({"down": (hidden, ff), "o": (hidden, hidden)})
        self.p = torch.nn.ParameterDict(
            {
                f"{kind}{i}": torch.nn.Parameter(torch.zeros(shape, dtype=torch.bfloat16), False)
                for i in range(layers)
                for kind, shape in shapes.items()
            }
        )

    def checkpoint(self, layers: int) -> dict[str, torch.Tensor]:
        h, ff = self.hidden, self.ff
        shapes = {"q": (h, h), "k": (h, h), "v": (h, h), "gate": (ff, h), "up": (ff, h)}
        shapes.update({"down": (h, ff), "o": (h, h)})
        g = torch.Generator().manual_seed(0)
        return {
            f"{kind}.{i}": torch.randn(shape, generator=g).to(torch.bfloat16)
            for i in range(layers)
            for kind, shape in shapes.items()
        }

    def load_weights(self, weights) -> None:
        rows = {"q": ("qkv", 0), "k": ("qkv", 1), "v": ("qkv", 2), "gate": ("gate_up", 0)}
        rows["up"] = ("gate_up", 1)
        for name, w in weights:
            kind, layer = name.split(".")
            if kind in rows:
                target, at = rows[kind]
                self.p[f"{target}{layer}"].data.narrow(0, at * w.shape[0], w.shape[0]).copy_(w)
            else:
                self.p[f"{kind}{layer}"].data.copy_(w)


def scatter_shares(shares: list[float], layers: int, hidden: int, repeats: int = 3) -> dict:
    """Seconds for the pause to write a delta changing ``share`` of every tensor by position
    (``loading.scatter``, every tensor scattered) against replaying the whole plan: what
    ``scatter.SCATTER_SHARE`` rests on. Medians of ``repeats``, alternating."""
    from torchrl_vllm_ext.weight_sync import delta
    from torchrl_vllm_ext.weight_sync.loading import scatter
    from torchrl_vllm_ext.weight_sync.loading.planned import PlannedLoader, model_state
    from torchrl_vllm_ext.weight_sync.transports.packing import pack

    model = _FusedLayers(layers, hidden, ff=hidden * 27 // 5)
    named = model.checkpoint(layers)
    loader, state = PlannedLoader(), lambda: model_state(model)
    held = pack(named, "0", bucket_bytes=64 << 20)
    items = list(held.tensors().items())
    loader.load(model.load_weights, state, items)  # traced: every later load replays
    share_was, scatter.SCATTER_SHARE = scatter.SCATTER_SHARE, 1.0
    out = {}
    try:
        for share in shares:
            g = torch.Generator().manual_seed(int(share * 1e6))
            new = {}
            for name, t in named.items():
                t = t.clone().view(-1)
                at = torch.randint(0, t.numel(), (max(1, int(share * t.numel())),), generator=g)
                t.view(torch.int16)[at] += 1
                new[name] = t.view(named[name].shape)
            packed = pack(new, "1", bucket_bytes=64 << 20)
            changed = []
            buckets = zip(packed.header.buckets, held.buffers, packed.buffers, strict=True)
            for bucket, old, now in buckets:
                sparse, payload, _ = delta.diff_and_sum(now, old.clone(), bucket, dense_share=1.0)
                positions, values = delta.apply_bucket(old.clone(), bucket, sparse, payload)
                changed.append(delta.bucket_change(bucket, sparse, positions, values))
            changes = scatter.Changes("0", tuple(changed))
            times = {"replay_s": [], "scatter_s": []}
            for r in range(repeats):
                for system in (
                    ("replay_s", "scatter_s") if r % 2 == 0 else ("scatter_s", "replay_s")
                ):
                    loader.load(model.load_weights, state, items)  # the base, as a plan wrote it
                    t0 = time.perf_counter()
                    if system == "replay_s":
                        loader.load(model.load_weights, state, items)
                    else:
                        loader.scatter(model.load_weights, state, items, changes)
                    times[system].append(time.perf_counter() - t0)
            out[share] = {k: statistics.median(v) for k, v in times.items()}
            out[share]["positions"] = sum(c.positions.numel() for c in changed)
    finally:
        scatter.SCATTER_SHARE = share_was
    return out


def main(args) -> dict:
    from torchrl_vllm_ext import VLLMService
    from torchrl_vllm_ext.testing import make_tiny_model
    from torchrl_vllm_ext.testing.worker import TESTING_WORKER_EXTENSION

    model_dir = str(make_tiny_model(hidden_size=args.hidden, num_layers=args.layers, seed=0))
    out = {"benchmark": "delta_push", "lrs": {}}
    if args.dense_shares:
        out["dense_shares"] = dense_shares(args.dense_shares)
    if args.scatter_shares:
        out["scatter_shares"] = scatter_shares(args.scatter_shares, args.layers, args.hidden)
    with VLLMService.launch(
        model_dir,
        **CPU_PUSH_SERVICE,
        dtype="bfloat16",
        worker_extension_cls=TESTING_WORKER_EXTENSION,
    ) as svc:
        for lr in args.lrs:
            model, step = adam_trainer(model_dir, lr)
            per_lr = {}
            for transport in TRANSPORTS:
                runs: dict[str, list] = {"delta": [], "full": []}
                for r in range(args.rounds):
                    order = ("delta", "full") if r % 2 == 0 else ("full", "delta")
                    for system in order:
                        tag = f"{lr:g}-{transport}-{r}-{system}"
                        runs[system].append(
                            block(svc, transport, system, model, step, args.block, tag)
                        )
                delta, full = merge(runs["delta"]), merge(runs["full"])
                per_lr[transport] = {
                    "delta": delta,
                    "full": full,
                    "bytes_ratio": full["sent_mb"] / delta["sent_mb"],
                    "push_ratio": full["push_s"] / delta["push_s"],
                    "pause_ratio": full["pause_s"] / delta["pause_s"],
                }
                logger.info("lr %g %s: %s", lr, transport, json.dumps(per_lr[transport]))
            out["lrs"][f"{lr:g}"] = per_lr
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 1e-5])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--block", type=int, default=5, help="steps per block")
    parser.add_argument("--hidden", type=int, default=640)
    parser.add_argument("--layers", type=int, default=24)
    shares = {  # flag -> (default shares, what it times); no values: skipped
        "--dense-shares": ([0.02, 0.1, 0.25, 0.5], "writing a bucket by position vs whole"),
        "--scatter-shares": ([0.001, 0.003, 0.01, 0.02], "the pause's scatter vs a replay"),
    }
    for flag, (default, what) in shares.items():
        parser.add_argument(flag, type=float, nargs="*", default=default, help=f"time {what}")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    print(json.dumps(main(args)))

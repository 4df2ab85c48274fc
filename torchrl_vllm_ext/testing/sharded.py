"""A sharded trainer for tests, benchmarks and examples: the package's tiny model under
FSDP2 on CPU ranks (gloo), perturbed the same way on every rank."""

from __future__ import annotations

import functools
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from torchrl_vllm_ext.listening import listen, serve_store


def shard(model: nn.Module, mesh=None) -> nn.Module:
    """FSDP2 over ``model``: each decoder layer its own unit, then the root."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


@torch.no_grad()
def perturb(model: nn.Module, seed: int, scale: float = 0.02) -> nn.Module:
    """Add seeded noise to every floating parameter of an unsharded ``model`` (the same
    on every rank, so each rank's shards are blocks of the same full model)."""
    generator = torch.Generator().manual_seed(seed)
    for _, p in sorted(model.named_parameters()):
        if p.is_floating_point():
            p.add_(
                torch.randn(p.shape, generator=generator, dtype=torch.float32).to(p.dtype) * scale
            )
    return model


def load(model_dir: str | Path, seed: int | None = None, dtype=torch.float32) -> nn.Module:
    """The model from ``model_dir`` in transformers (eval), perturbed by ``seed`` if given."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    return perturb(model, seed) if seed is not None else model


def init_gloo(rank: int, world: int, port: int) -> None:
    """Join a gloo world of ``world`` ranks on the loopback at ``port``: rank 0 serves its
    store there only (``init_method="env://"`` would listen on every interface)."""
    host = "127.0.0.1"
    os.environ["MASTER_ADDR"] = host  # where ShardedWeightSync's own store listens
    timeout = timedelta(seconds=60)
    if rank == 0:
        store = serve_store(host, timeout, listener=listen(host, port))
    else:
        store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)


def peak_torch_bytes(work):
    """``work()``'s result and the peak of the bytes torch's CPU allocator held for it
    above where it started, from the profiler's memory events (every allocation and free
    of a tensor, in time order; files mapped are not counted): how the tests see that a
    storage push writes from the shards themselves. The profiler misses the frees of
    collectives' outputs (gloo's threads): for a gather, :func:`peak_anon_bytes`."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = work()
    # A file mapped (a storage slot, the first time a rank opens it) shows as allocated
    # by aten::from_file: shared pages of the file, not this rank's memory.
    events = sorted(
        (e for e in prof.events() if e.self_cpu_memory_usage and e.name != "aten::from_file"),
        key=lambda e: e.time_range.start,
    )
    held = peak = 0
    for event in events:
        held += event.self_cpu_memory_usage
        peak = max(peak, held)
    return out, peak


def anon_bytes() -> int:
    """This process's private (anonymous) resident memory: not the files it maps."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status (Linux only)")


def peak_anon_bytes(work, every_s: float = 0.0005):
    """``work()``'s result and the peak of this process's private resident memory above
    where it started, sampled every ``every_s`` by a thread (RSS that malloc keeps after
    a free counts until reused: an upper bound on what ``work`` held at once)."""
    import threading

    base = anon_bytes()
    peak = [base]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(every_s):
            peak[0] = max(peak[0], anon_bytes())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        out = work()
    finally:
        done.set()
        sampler.join()
    return out, max(peak[0], anon_bytes()) - base


def follow(rank: int, world: int, port: int, model_dir: str, steps: list[dict], results) -> None:
    """A rank other than 0 of a sharded trainer, in its own process: join the gloo world,
    then for each step push the model perturbed by ``step["seed"]`` (sharded with FSDP2)
    and put ``("ok", version, peak bytes)`` or ``("error", type, message, ranks)`` into
    ``results``. A step may instead ``"skip"`` (never call the push), hold a
    non-finite shard (``"nan"``), push another layout (``"shape"``), or ``"die"``
    (``os._exit``) half way through writing its blocks."""
    from torchrl_vllm_ext.weight_sync.sharded import ShardedWeightSync

    init_gloo(rank, world, port)
    sync = ShardedWeightSync(None)
    try:
        for step in steps:
            if step.get("skip"):
                continue
            model = shard(load(model_dir, step["seed"]))
            if step.get("nan"):
                with torch.no_grad():
                    next(model.parameters()).to_local().view(-1)[0] = float("nan")
            weights = model
            if step.get("shape"):
                weights = {k: v for k, v in model.state_dict().items() if "layers.1." not in k}
            if step.get("die"):
                _die_while_writing(sync)
            try:
                push = functools.partial(sync.push, weights, step.get("version"))
                report, peak = peak_torch_bytes(push)
                results.put(("ok", report.version, peak))
            except Exception as e:
                results.put(("error", type(e).__name__, str(e), getattr(e, "ranks", ())))
    finally:
        sync.close()
        dist.destroy_process_group()


def _die_while_writing(sync) -> None:
    """This rank's process exits after writing its first block of the next push."""
    write = sync.blocks.write

    def die(path, rank, parts):
        write(path, rank, parts[:1])
        os._exit(3)

    sync.blocks.write = die

"""Weight-sync figures for both transports against three baselines, in one run.

Model: a random Qwen2 of ~350 MB fp32 with ~290 tensors, served by two replicas.

* storage / broadcast: time from ``push`` to every replica serving the new version,
  GB/s, and the longest generation pause (storage also with ``rollout="rolling"``: one
  replica at a time, so the others keep serving);
* the load plan (``load_plan``): the same scheme pushing with the workers' load plans on
  (the pause replays one batched copy) and off (the model's loader, as before plans:
  ``TORCHRL_VLLM_LOAD_PLAN=0``), alternating which goes first each round, per transport
  and rollout: push and pause medians, every phase, the replayed share, and the pause
  over a memcpy of the same bytes (with ``parallel`` rollout every replica copies the
  bytes at once, so on 2 cores the pause shares the memory bandwidth: ``rolling`` shows
  one replica's, and ``pause_over_memcpy_together`` sets the parallel pause beside that
  many single-threaded copies of the bytes at once);
* (a) memcpy bandwidth of the same bytes (``torch`` copy into a preallocated buffer), and
  ``memcpy_together_s``: one single-threaded copy per replica, all at once (threads), what
  replicas of one CPU each do in a parallel pause;
* (b) one RPC plus one broadcast per parameter, the pattern of TorchRL's older updater:
  each worker receives, verifies and loads the parameter as it arrives, like a push;
* (c) ``torch.save`` + ``torch.load`` of the state dict through tmpfs;
* the value check (``verify``): push time with it on and off, same scheme, alternating
  which goes first each round, per transport (``verify_cost``: median on / median off).

    python benchmarks/bench_sync.py [--repeats 5] [--verify-only [--served-dtype bfloat16]]

On a machine with CUDA (:func:`gpu_main`, ``--gpu``; default model: Qwen2 layout, hidden
2048, 16 layers, bf16, ~1.2 GB; one replica on the trainer's GPU): the colocated push
(``auto``: CUDA IPC) and the storage push (staged on the GPU before the pause), each with
the load plans on and off, alternating the order each round, beside a device-to-device copy
and a pinned host-to-device copy of the same bytes (synchronised); every phase, the
replayed share, where storage staged, the pause over one device copy; whether the pushes
leave the replica with bitwise the same log-probs; and the targets below (``targets``).

Prints one JSON object. Targets: storage_vs_memcpy >= 0.25, broadcast_vs_per_param >= 10,
storage pause <= half its push time, verify on by default only if it costs < 10% of a push;
the CPU storage pause (plans on) <= 2x the memcpy and its push not slower than plans off;
on GPU (1.21 GB bf16, one H100/H200), colocated pause <= 5 ms and push <= 25 ms, storage
pause <= 10 ms, log-probs bitwise equal across transports and plans.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import tempfile
import time

import torch

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


RUNS = (  # (name, transport, rollout)
    ("storage", "storage", "parallel"),
    ("storage_rolling", "storage", "rolling"),
    ("broadcast", "broadcast", "parallel"),
)


COLOCATED = "auto"
"""The GPU figures' colocated system: ``auto`` routes a replica on the trainer's GPU by CUDA IPC."""
STORAGE = "storage"


def warm_up(scheme, trainer, label: str) -> None:
    """Push once per storage slot before timing: the first write into a fresh slot pays
    its page faults (a new tmpfs file), which is set-up, not the steady push measured
    here; also forms the group, the plans, the value check's reference."""
    from torchrl_vllm_ext.weight_sync.transports.storage.slots import SLOTS

    for slot in SLOTS:  # the storage double buffer (a second push elsewhere warms no more)
        scheme.push(trainer, version=f"{label}-warm-{slot}")


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def together_copy_s(flat: torch.Tensor, copies: int, repeats: int) -> float:
    """Median seconds of ``copies`` single-threaded copies of ``flat`` at once, one per
    thread (``copy_`` releases the GIL): the memory traffic of a parallel pause on
    replicas of one CPU each."""
    from concurrent.futures import ThreadPoolExecutor

    pairs = [(flat if i == 0 else flat.clone(), torch.empty_like(flat)) for i in range(copies)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each replica: one CPU, one intra-op thread
    try:
        with ThreadPoolExecutor(copies) as pool:

            def run():
                list(pool.map(lambda pair: pair[1].copy_(pair[0]), pairs))

            run()
            return median_time(run, repeats)
    finally:
        torch.set_num_threads(threads)


def per_param_pattern(scheme, tensors: dict[str, torch.Tensor]) -> None:
    """One header RPC to every replica plus one broadcast, per parameter; each is loaded."""
    import ray

    from torchrl_vllm_ext.extensions import WorkerMethods
    from torchrl_vllm_ext.weight_sync.specs import to_json
    from torchrl_vllm_ext.weight_sync.transports.packing import pack

    transport = scheme.transport_impl
    replicas = list(scheme.service.replicas())
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    scheme.service.run(transport._ensure_group(replicas, transport.deadline.for_bytes(nbytes)))
    for name, t in tensors.items():
        header, buffers = pack({name: t}, "per-param")
        refs = [
            r.handle.collective_rpc.remote(WorkerMethods.RECEIVE_BROADCAST, (to_json(header),))
            for r in replicas
        ]
        transport.group.send(buffers)
        ray.get(refs)


def verify_cost(svc, trainer, transport: str, repeats: int) -> dict:
    """Push time with the value check on vs off, alternating which goes first each round."""
    from torchrl_vllm_ext import WeightSyncScheme

    times: dict[bool, list[float]] = {True: [], False: []}
    phases: dict[str, list[float]] = {}
    checks: list[tuple[float, float]] = []  # (worst probe gap, limit) of each checked push
    with WeightSyncScheme(svc, transport=transport, verify="always") as scheme:
        warm_up(scheme, trainer, f"verify-{transport}")
        for i in range(repeats):
            for verify in (True, False) if i % 2 == 0 else (False, True):
                scheme.verify = "always" if verify else "never"
                report = scheme.push(trainer, version=f"verify-{transport}-{i}-{verify}")
                times[verify].append(report.seconds)
                if verify:
                    assert max(report.probe_gap.values()) <= report.probe_limit
                    checks.append((max(report.probe_gap.values()), report.probe_limit))
                    for k, v in report.phases.items():
                        phases.setdefault(k, []).append(v)
    on, off = statistics.median(times[True]), statistics.median(times[False])
    return {
        "probe_gap_max": max(g for g, _ in checks),
        "probe_limit_min": min(limit for _, limit in checks),
        "push_s_verify_on": round(on, 3),
        "push_s_verify_off": round(off, 3),
        "verify_cost_s": round(on - off, 3),
        "verify_cost": round(on / off, 3),
        "phases_s_verify_on": {k: round(statistics.median(v), 3) for k, v in phases.items()},
    }


def set_load_plan(svc, enabled: bool) -> None:
    """Switch every replica's workers' load plans on or off (``use_load_plan``)."""
    import ray

    from torchrl_vllm_ext.testing.worker import TestingMethods

    ray.get(
        [
            v.handle.collective_rpc.remote(TestingMethods.LOAD_PLAN, (enabled,))
            for v in svc.replicas()
        ]
    )


def figures(reports, copy_s: float | None = None, copy_name: str = "memcpy") -> dict:
    """Medians of a set of pushes: push, pause (the longest replica's), every phase, the
    replayed share, and the pause over ``copy_s`` (a copy of the same bytes)."""
    push = statistics.median(r.seconds for r in reports)
    pause = statistics.median(max(r.pause_s.values()) for r in reports)
    phases = sorted({k for r in reports for k in r.phases})
    out = {
        "transport": reports[-1].transport,
        "push_s": round(push, 4),
        "pause_s": round(pause, 4),
        "gb_per_s": round(reports[-1].nbytes / push / 1e9, 2),
        "phases_s": {
            k: round(statistics.median(r.phases.get(k, 0.0) for r in reports), 4) for k in phases
        },
        "replayed_share": reports[-1].replayed_share,
        "load_paths": sorted({w["path"] for ws in reports[-1].loads.values() for w in ws}),
    }
    if reports[-1].staged_in:
        out["staged_in"] = sorted(set(reports[-1].staged_in.values()))
    if copy_s:
        out[f"pause_over_{copy_name}"] = round(pause / copy_s, 2)
    return out


def load_plan_cost(
    svc,
    trainer,
    transport: str,
    repeats: int,
    memcpy_s: float,
    rollout: str = "parallel",
    together_s: float | None = None,
) -> dict:
    """Push and pause with the load plans on vs off, same scheme, alternating which goes
    first each round (plans off = the loader in the pause, as before plans); with
    ``together_s`` (a parallel rollout), each pause also over the replicas' copies at once."""
    from torchrl_vllm_ext import WeightSyncScheme

    runs: dict[bool, list] = {True: [], False: []}
    with WeightSyncScheme(svc, transport=transport, verify="never", rollout=rollout) as scheme:
        warm_up(scheme, trainer, f"plan-{transport}")  # the load plans' trace too
        try:
            for i in range(repeats):
                for on in (True, False) if i % 2 == 0 else (False, True):
                    set_load_plan(svc, on)
                    runs[on].append(scheme.push(trainer, version=f"plan-{transport}-{i}-{on}"))
        finally:
            set_load_plan(svc, True)
    on, off = figures(runs[True], memcpy_s), figures(runs[False], memcpy_s)
    if together_s:
        for fig in (on, off):
            fig["pause_over_memcpy_together"] = round(fig["pause_s"] / together_s, 2)
    return {
        "plans_on": on,
        "plans_off": off,
        "pause_off_over_on": round(off["pause_s"] / on["pause_s"], 2),
        "push_off_over_on": round(off["push_s"] / on["push_s"], 2),
    }


def cuda_copy_s(src: torch.Tensor, dst: torch.Tensor, repeats: int) -> float:
    """Median seconds of ``dst.copy_(src)``, synchronised (the first copy warms up)."""
    dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def served_logprobs(svc, ids: list[int]) -> list[list[float]]:
    data = svc.generate_request_data(
        [ids] * svc.num_replicas, {"max_tokens": 1, "prompt_logprobs": 0}, routing="round_robin"
    )
    return [list(d.prompt_logprobs[1:]) for d in sorted(data, key=lambda d: d.replica_id)]


def gpu_main(args) -> dict:
    """The GPU figures (see the module docstring)."""
    from transformers import AutoModelForCausalLM

    from torchrl_vllm_ext import VLLMService, WeightSyncScheme
    from torchrl_vllm_ext.testing import make_tiny_model
    from torchrl_vllm_ext.testing.worker import TESTING_WORKER_EXTENSION
    from torchrl_vllm_ext.weight_sync.params import expected_specs, named_tensors, validate

    model_dir = make_tiny_model(
        hidden_size=args.hidden, num_layers=args.layers, seed=0, dtype=args.dtype
    )
    dtype = getattr(torch, args.dtype)
    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda().eval()
    tensors = validate(named_tensors(trainer), expected_specs(model_dir))
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors.values()])
    d2d_s = cuda_copy_s(flat, torch.empty_like(flat), args.repeats)
    h2d_s = cuda_copy_s(torch.empty_like(flat, device="cpu").pin_memory(), flat, args.repeats)
    del flat
    probe = list(range(5, 69))
    systems = [(name, plans) for name in (COLOCATED, STORAGE) for plans in (True, False)]
    runs: dict[tuple, list] = {system: [] for system in systems}
    logprobs: dict[tuple, list] = {}
    with VLLMService.launch(
        model_dir,
        num_replicas=args.replicas,
        gpus_per_replica=1.0 / args.replicas,
        dtype=args.dtype,
        max_model_len=256,
        health_check_interval=0,
        worker_extension_cls=TESTING_WORKER_EXTENSION,  # load plans off and on
    ) as svc:
        schemes = {
            t: WeightSyncScheme(svc, transport=t, verify="never") for t in (COLOCATED, STORAGE)
        }
        try:
            for name, scheme in schemes.items():
                warm_up(scheme, trainer, name)  # slots, buffers, handles, plans
            for i in range(args.repeats):
                order = systems if i % 2 == 0 else systems[::-1]
                for name, plans in order:
                    set_load_plan(svc, plans)
                    report = schemes[name].push(trainer, version=f"{name}-{plans}-{i}")
                    runs[(name, plans)].append(report)
                    logprobs[(name, plans)] = served_logprobs(svc, probe)
            set_load_plan(svc, True)
            reasons = {name: scheme.reason for name, scheme in schemes.items()}
        finally:
            for scheme in schemes.values():
                scheme.close()

    colocated, storage = (
        figures(runs[(COLOCATED, True)], d2d_s, "d2d"),
        figures(runs[(STORAGE, True)], d2d_s, "d2d"),
    )
    bitwise = all(lp == logprobs[systems[0]] for lp in logprobs.values())
    return {
        "benchmark": "weight_sync_gpu",
        "device": torch.cuda.get_device_name(0),
        "model_mb": round(nbytes / 1e6, 1),
        "dtype": args.dtype,
        "replicas": args.replicas,
        "d2d_copy_s": round(d2d_s, 5),
        "pinned_h2d_copy_s": round(h2d_s, 5),
        "colocated": colocated,
        "colocated_plans_off": figures(runs[(COLOCATED, False)], d2d_s, "d2d"),
        "storage": storage,
        "storage_plans_off": figures(runs[(STORAGE, False)], d2d_s, "d2d"),
        "plan": reasons[COLOCATED],
        "logprobs_bitwise_equal": bitwise,
        "targets": {
            "colocated_pause_le_5ms": colocated["pause_s"] <= 0.005,
            "colocated_push_le_25ms": colocated["push_s"] <= 0.025,
            "storage_pause_le_10ms": storage["pause_s"] <= 0.010,
            "logprobs_bitwise_equal": bitwise,
        },
    }


def main(args) -> dict:
    from transformers import AutoModelForCausalLM

    from torchrl_vllm_ext import VLLMService, WeightSyncScheme
    from torchrl_vllm_ext.testing import make_tiny_model
    from torchrl_vllm_ext.testing.worker import TESTING_WORKER_EXTENSION
    from torchrl_vllm_ext.weight_sync.params import expected_specs, named_tensors, validate
    from torchrl_vllm_ext.weight_sync.transports import registry

    model_dir = make_tiny_model(
        hidden_size=args.hidden, num_layers=args.layers, seed=0, dtype=args.dtype
    )
    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype))
    if torch.cuda.is_available():
        trainer = trainer.cuda()  # NCCL sends from the trainer's GPU
    tensors = validate(named_tensors(trainer), expected_specs(model_dir))
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())

    # (a) memcpy
    flat = torch.cat([t.view(-1) for t in tensors.values()])
    dst = torch.empty_like(flat)
    dst.copy_(flat)
    memcpy_s = median_time(lambda: dst.copy_(flat), args.repeats)
    together_s = together_copy_s(flat, args.replicas, args.repeats)
    # (c) torch.save + torch.load through tmpfs
    tmpdir = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(dir=tmpdir) as d:
        path = os.path.join(d, "sd.pt")
        save_load_s = median_time(
            lambda: (torch.save(tensors, path), torch.load(path)), args.repeats
        )

    results: dict = {}
    verify: dict = {}
    with VLLMService.launch(
        model_dir,
        num_replicas=args.replicas,
        cpus_per_replica=1.0,
        dtype=args.served_dtype or args.dtype,
        max_model_len=256,
        enforce_eager=True,
        health_check_interval=0,
        worker_extension_cls=TESTING_WORKER_EXTENSION,  # load plans off and on
    ) as svc:
        plans: dict = {}
        if not args.verify_only:
            for name, transport, rollout in RUNS:
                plans[name] = load_plan_cost(
                    svc,
                    trainer,
                    transport,
                    args.repeats,
                    memcpy_s,
                    rollout,
                    together_s if rollout == "parallel" else None,
                )
        for transport in registry.names(cpu=True, composite=False):
            verify[transport] = verify_cost(svc, trainer, transport, args.repeats)
        if args.verify_only:
            return {
                "benchmark": "weight_sync_verify",
                "model_mb": round(nbytes / 1e6, 1),
                "trainer_dtype": args.dtype,
                "served_dtype": args.served_dtype or args.dtype,
                **verify,
            }
        for name, transport, rollout in RUNS:
            with WeightSyncScheme(svc, transport=transport, rollout=rollout) as scheme:
                warm_up(scheme, trainer, name)
                reports = [scheme.push(trainer, version=f"{name}-{i}") for i in range(args.repeats)]
                push_s = statistics.median(r.seconds for r in reports)
                pause_s = statistics.median(max(r.pause_s.values()) for r in reports)
                phases = {
                    k: round(statistics.median(r.phases[k] for r in reports), 3)
                    for k in reports[0].phases
                }
                results[name] = {
                    "push_s": push_s,
                    "pause_s": pause_s,
                    "gb_per_s": nbytes / push_s / 1e9,
                    "phases": phases,
                }
                if name == "broadcast":
                    per_param_pattern(scheme, tensors)  # warm-up
                    results["per_param_s"] = median_time(
                        lambda s=scheme: per_param_pattern(s, tensors), max(1, args.repeats // 2)
                    )

    memcpy_gbps = nbytes / memcpy_s / 1e9
    return {
        "benchmark": "weight_sync",
        "model_mb": round(nbytes / 1e6, 1),
        "tensors": len(tensors),
        "replicas": args.replicas,
        "memcpy_gb_per_s": round(memcpy_gbps, 2),
        "torch_save_load_s": round(save_load_s, 3),
        "torch_save_load_gb_per_s": round(nbytes / save_load_s / 1e9, 2),
        "per_param_rpc_broadcast_s": round(results["per_param_s"], 3),
        "storage_push_s": round(results["storage"]["push_s"], 3),
        "storage_gb_per_s": round(results["storage"]["gb_per_s"], 2),
        "storage_pause_s": round(results["storage"]["pause_s"], 3),
        "storage_rolling_push_s": round(results["storage_rolling"]["push_s"], 3),
        "storage_rolling_pause_s": round(results["storage_rolling"]["pause_s"], 3),
        "storage_rolling_pause_over_push": round(
            results["storage_rolling"]["pause_s"] / results["storage_rolling"]["push_s"], 3
        ),
        "broadcast_push_s": round(results["broadcast"]["push_s"], 3),
        "broadcast_gb_per_s": round(results["broadcast"]["gb_per_s"], 2),
        "broadcast_pause_s": round(results["broadcast"]["pause_s"], 3),
        "storage_vs_memcpy": round(results["storage"]["gb_per_s"] / memcpy_gbps, 3),
        "broadcast_vs_per_param": round(results["per_param_s"] / results["broadcast"]["push_s"], 2),
        "storage_pause_over_push": round(
            results["storage"]["pause_s"] / results["storage"]["push_s"], 3
        ),
        "storage_vs_torch_save_load": round(save_load_s / results["storage"]["push_s"], 2),
        "storage_phases_s": results["storage"]["phases"],
        "broadcast_phases_s": results["broadcast"]["phases"],
        "memcpy_s": round(memcpy_s, 4),
        "memcpy_together_s": round(together_s, 4),
        "load_plan": plans,
        "targets": {
            "storage_pause_le_2x_memcpy": plans["storage"]["plans_on"]["pause_s"] <= 2 * memcpy_s,
            "storage_rolling_pause_le_2x_memcpy": plans["storage_rolling"]["plans_on"]["pause_s"]
            <= 2 * memcpy_s,
            "storage_pause_le_2x_memcpy_together": plans["storage"]["plans_on"]["pause_s"]
            <= 2 * together_s,
            "storage_push_not_slower": plans["storage"]["push_off_over_on"] >= 1.0,
        },
        "verify": verify,
    }


if __name__ == "__main__":
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2048 if cuda else 640)
    parser.add_argument("--layers", type=int, default=16 if cuda else 24)
    parser.add_argument("--replicas", type=int, default=1 if cuda else 2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="bfloat16" if cuda else "float32")
    parser.add_argument(
        "--served-dtype",
        help="the replicas' dtype when not --dtype (the trainer's and checkpoint's)",
    )
    parser.add_argument(
        "--verify-only", action="store_true", help="only the value check's cost (on vs off)"
    )
    parser.add_argument(
        "--cpu-figures", action="store_true", help="on a GPU machine, the CPU benchmark instead"
    )
    logging.basicConfig(level=logging.WARNING)
    args = parser.parse_args()
    run = gpu_main if cuda and not args.cpu_figures and not args.verify_only else main
    print(json.dumps(run(args), indent=2))

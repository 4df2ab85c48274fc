"""Fault figures: replicas SIGKILLed under traffic and during weight sync, storage writers
SIGKILLed mid-publish, and a concurrent load phase, on two replicas of a tiny model.

* kills: a random replica's actor or engine-core process is SIGKILLed at a random moment
  of client traffic (and, for ``sync_kills``, of a storage push); every batch must come
  back whole or raise a typed error. ``requests_lost`` counts prompts that did neither
  (must be 0); ``recovery_s`` is, per kill, the time until the replica serves again.
  After each push under a kill, every replica's log-probs are compared with the trainer's
  (``inconsistent_replicas`` must be 0).
* writer kills: ``SlotWriter.write`` SIGKILLed at each step of a publish and at random
  moments; ``torn_loads`` counts reads that returned a slot not holding exactly one
  published version (must be 0).
* load: ~1,300 concurrent requests through ``agenerate_request_data`` and ``VLLMPolicy.aforward``;
  requests/s and the resident memory of driver + replicas at the start and the end.

    python benchmarks/bench_faults.py [--quick] [--json out.json]

Prints one JSON object, on the last line of stdout (the killed replicas' logs come
before it through Ray); ``--json`` also writes it to a file.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import logging
import multiprocessing
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ENGINE_KWARGS = {
    "dtype": "float32",
    "max_model_len": 256,
    "enforce_eager": True,
    "kv_cache_memory_bytes": 64 << 20,
}
SEQUENCE = list(range(5, 45))


# ---------------------------------------------------------------------------- processes
def replica_pids(svc, rid: int) -> tuple[int, int | None]:
    import psutil

    actor = svc.replica_info(rid).pid
    for p in psutil.Process(actor).children(recursive=True):
        try:
            if "EngineCore" in p.name() + " ".join(p.cmdline()):
                return actor, p.pid
        except psutil.Error:
            pass
    return actor, None


def rss_by_role(svc) -> dict[str, int]:
    """Resident bytes of the driver, the replica actors and their engine processes."""
    import psutil

    roles = {"driver": [psutil.Process()], "actors": [], "engines": []}
    for rid in svc.replica_ids:
        actor = psutil.Process(svc.replica_info(rid).pid)
        roles["actors"].append(actor)
        roles["engines"] += actor.children(recursive=True)
    out = {}
    for role, procs in roles.items():
        out[role] = 0
        for p in procs:
            try:
                out[role] += p.memory_info().rss
            except psutil.Error:
                pass
    return out


def rss_bytes(svc) -> int:
    return sum(rss_by_role(svc).values())


def wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def kill_and_time(svc, rng: random.Random) -> float | None:
    """SIGKILL one replica's actor or engine; seconds until it serves again (None: never)."""
    wait_for(lambda: svc.num_replicas >= 2, 600)
    rid = rng.choice(svc.replica_ids)
    actor, engine = replica_pids(svc, rid)
    target = engine if engine is not None and rng.random() < 0.5 else actor
    os.kill(target, signal.SIGKILL)
    t0 = time.monotonic()
    back = wait_for(
        lambda: any(r.replica_id == rid and r.info.pid != actor for r in svc.replicas()), 600
    )
    return time.monotonic() - t0 if back else None


class Traffic:
    """Client threads sending batches until stopped; counts prompts by outcome."""

    def __init__(self, svc, threads: int = 3, batch: int = 12):
        from torchrl_vllm_ext.errors import TorchRLVLLMError

        self.typed = TorchRLVLLMError
        self.svc, self.batch = svc, batch
        self.sent = self.answered = self.failed_typed = self.failed_untyped = 0
        self.lock, self.stop_event = threading.Lock(), threading.Event()
        self.threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)
        ]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        k = 0
        while not self.stop_event.is_set():
            batch = [[7 + (i * 31 + k) % 50, 8, 9, 10 + j, 11 + j] for j in range(self.batch)]
            k += 1
            with self.lock:
                self.sent += len(batch)
            try:
                data = self.svc.generate_request_data(batch, {"max_tokens": 24, "ignore_eos": True})
                whole = [d.prompt_token_ids.tolist() for d in data] == batch
                with self.lock:
                    self.answered += len(batch) if whole else 0
            except self.typed:
                with self.lock:
                    self.failed_typed += len(batch)
            except Exception:
                with self.lock:
                    self.failed_untyped += len(batch)

    def stop(self) -> dict:
        self.stop_event.set()
        for t in self.threads:
            t.join(1200)
        accounted = self.answered + self.failed_typed
        return {
            "sent": self.sent,
            "answered": self.answered,
            "failed_typed": self.failed_typed,
            "lost": self.sent - accounted,
        }


# ---------------------------------------------------------------------------- phases
def replicas_match(svc, trainer, version: str) -> int:
    """Replicas whose version or log-probs differ from the trainer's."""
    x = torch.tensor([SEQUENCE])
    with torch.no_grad():
        logp = torch.log_softmax(trainer(x).logits[0, :-1].float(), -1)
    ref = logp.gather(-1, x[0, 1:, None])[:, 0]
    data = svc.generate_request_data(
        [SEQUENCE] * svc.num_replicas,
        {"max_tokens": 1, "prompt_logprobs": 0},
        routing="round_robin",
    )
    bad = 0
    for d in data:
        diff = (torch.tensor(d.prompt_logprobs[1:]) - ref).abs().max().item()
        bad += d.weight_version_end != version or diff > 1e-4
    return bad


def perturb(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


def sync_kills(svc, trainer, kills: int, rng: random.Random) -> dict:
    from torchrl_vllm_ext import WeightSyncError, WeightSyncScheme

    out = {"kills": 0, "pushes_ok": 0, "pushes_rejected": 0, "inconsistent_replicas": 0}
    recovery = []
    pool = concurrent.futures.ThreadPoolExecutor(1)
    with pool, WeightSyncScheme(svc, transport="storage") as scheme:
        push_s = scheme.push(trainer, version="bench-base").seconds
        for k in range(kills):
            wait_for(lambda: svc.num_replicas >= 2, 600)
            before = {n: t.clone() for n, t in trainer.state_dict().items()}
            perturb(trainer, seed=k)
            fut = pool.submit(_try_push, scheme, trainer, f"bench-{k}", WeightSyncError)
            time.sleep(rng.uniform(0.0, 1.2 * push_s))
            recovery.append(kill_and_time(svc, rng))
            out["kills"] += 1
            if fut.result(timeout=1200) == "ok":
                out["pushes_ok"] += 1
            else:
                out["pushes_rejected"] += 1
                trainer.load_state_dict(before)
            out["inconsistent_replicas"] += replicas_match(svc, trainer, svc.weight_version)
    return out | {"recovery_s": recovery}


def _try_push(scheme, trainer, version, error_type) -> str:
    try:
        scheme.push(trainer, version=version)
        return "ok"
    except error_type:
        return "rejected"


def writer_kills(rounds: int) -> dict:
    """Writers killed at every step of a publish, ``rounds`` times; torn loads counted."""
    # The kill points live with the test that runs them in reduced form.
    from tests.reliability.test_storage_writer_kills import (
        KILL_POINTS,
        PUBLISHED_POINTS,
        weights,
        write_and_die,
    )
    from torchrl_vllm_ext.weight_sync.transports.storage.slots import SlotReader, SlotWriter

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "tensordict", "torchrl_vllm_ext.weight_sync.storage"])
    kills = torn = 0
    with tempfile.TemporaryDirectory() as d:
        root = os.path.join(d, "slots")
        SlotWriter(root).write(weights(0), "0")
        published = 0
        rng = random.Random(0)
        for _ in range(rounds):
            for point in rng.sample(KILL_POINTS, len(KILL_POINTS)):
                proc = ctx.Process(target=write_and_die, args=(root, published + 1, point))
                proc.start()
                proc.join(120)
                kills += proc.exitcode == -signal.SIGKILL
                if point in PUBLISHED_POINTS:
                    published += 1
                manifest, tensors = SlotReader(root).read()
                v = int(manifest.version)
                torn += v != published or any(
                    not torch.all(t == float(v)) for t in tensors.values()
                )
    return {"writer_kills": kills, "torn_loads": torn}


async def _load(svc, policy, seconds: float) -> int:
    from tensordict import TensorDict

    loop = asyncio.get_running_loop()
    stop_at = loop.time() + seconds
    params = {"max_tokens": 4, "ignore_eos": True}
    done = [0]

    async def service_client(i):
        k = 0
        while loop.time() < stop_at:
            batch = [[7 + (i + k) % 50, 8, 9, 10 + j % 100] for j in range(32)]
            k += 1
            data = await svc.agenerate_request_data(batch, params)
            done[0] += len(data)

    async def policy_client(i):
        k = 0
        while loop.time() < stop_at:
            ids = torch.tensor([[5 + (i + k) % 50, 6, 7, 8 + j % 100] for j in range(16)])
            k += 1
            out = await policy.aforward(TensorDict({("tokens", "prompt"): ids}, batch_size=[16]))
            done[0] += out.batch_size[0]

    await asyncio.gather(
        *(service_client(i) for i in range(32)), *(policy_client(i) for i in range(16))
    )
    return done[0]


def main(args) -> dict:
    from transformers import AutoModelForCausalLM

    from torchrl_vllm_ext import VLLMPolicy, VLLMService
    from torchrl_vllm_ext.testing import make_tiny_model

    rng = random.Random(args.seed)
    model_dir = make_tiny_model(seed=0)
    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    result: dict = {"benchmark": "faults", "replicas": 2}
    with VLLMService.launch(
        model_dir, num_replicas=2, cpus_per_replica=0.5, health_check_interval=1.0, **ENGINE_KWARGS
    ) as svc:
        # 1) kills under generation traffic
        traffic = Traffic(svc)
        recovery = [kill_and_time(svc, rng) for _ in range(args.kills)]
        counts = traffic.stop()
        # 2) kills during weight sync (with traffic)
        traffic = Traffic(svc, threads=2)
        sync = sync_kills(svc, trainer, args.sync_kills, rng)
        sync_counts = traffic.stop()
        recovery += sync.pop("recovery_s")
        survived = [r for r in recovery if r is not None]
        result.update(
            kills=len(recovery),
            kills_survived=len(survived),
            requests_sent=counts["sent"] + sync_counts["sent"],
            requests_answered=counts["answered"] + sync_counts["answered"],
            requests_failed_typed=counts["failed_typed"] + sync_counts["failed_typed"],
            requests_lost=counts["lost"] + sync_counts["lost"],
            recovery_s=[round(r, 2) for r in survived],
            recovery_s_median=round(statistics.median(survived), 2) if survived else None,
            sync=sync,
        )
        # 3) load
        policy = VLLMPolicy(
            svc, input_mode="tokens", sampling_params={"max_tokens": 4, "ignore_eos": True}
        )
        asyncio.run(_load(svc, policy, 2.0))  # warm-up
        roles_start = rss_by_role(svc)
        rss_start = sum(roles_start.values())
        samples, sampling = [], threading.Event()

        def sample_rss():  # the trend over the run, not only its two ends
            while not sampling.wait(args.load_seconds / 10):
                samples.append(round(rss_bytes(svc) / 1e6))

        sampler = threading.Thread(target=sample_rss, daemon=True)
        sampler.start()
        t0 = time.perf_counter()
        n = asyncio.run(_load(svc, policy, args.load_seconds))
        elapsed = time.perf_counter() - t0
        sampling.set()
        sampler.join()
        roles_end = rss_by_role(svc)
        rss_end = sum(roles_end.values())
        result["load"] = {
            "seconds": round(elapsed, 1),
            "requests": n,
            "requests_per_s": round(n / elapsed, 1),
            "concurrent_requests": 32 * 32 + 16 * 16,
            "rss_mb_start": round(rss_start / 1e6),
            "rss_mb_end": round(rss_end / 1e6),
            "rss_mb_during": samples,
            "rss_mb_by_role": {
                k: [round(roles_start[k] / 1e6), round(roles_end[k] / 1e6)] for k in roles_start
            },
        }
    # 4) storage writers killed mid-publish (no vLLM)
    result.update(writer_kills(args.writer_rounds))
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 kills, 1 sync kill, 15 s of load")
    parser.add_argument("--kills", type=int, default=6)
    parser.add_argument("--sync-kills", type=int, default=4)
    parser.add_argument("--writer-rounds", type=int, default=10)
    parser.add_argument("--load-seconds", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the JSON object to this file")
    args = parser.parse_args()
    if args.quick:
        args.kills, args.sync_kills, args.writer_rounds, args.load_seconds = 2, 1, 2, 15.0
    logging.basicConfig(level=logging.ERROR)
    result = main(args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    # One line, last: the killed replicas' logs reach this process's stdout through Ray.
    print(json.dumps(result), flush=True)

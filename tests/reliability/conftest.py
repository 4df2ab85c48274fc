"""One service for the fault, load, bad-input and security tests of this directory.

The fixtures are package-scoped: the service (2 replicas, the integration tests'
engine settings) lives while these modules run and is shut down when they are done.
The tiny model and Ray (``cluster.ensure_ray``, loopback only) are the session fixtures
of ``tests/conftest.py``, shared with the integration tests.
"""

from __future__ import annotations

import os
import random
import signal
import threading
from dataclasses import dataclass, field

import psutil
import pytest
import torch

from torchrl_vllm_ext import VLLMService, WeightSyncScheme
from torchrl_vllm_ext.errors import TorchRLVLLMError

from ..integration.conftest import (  # noqa: F401 (shared checks, re-exported to the tests)
    CPUS_PER_REPLICA,
    ENGINE_KWARGS,
    assert_replicas_match,
    perturb,
    replica_logprobs,
    wait_until,
)

NUM_REPLICAS = 2
RESTART_TIMEOUT = 300.0  # generous: a restart is ~30 s on 2 shared cores


@pytest.fixture(scope="package")
def service(tiny_model, ray_cluster):
    svc = VLLMService.launch(
        tiny_model,
        num_replicas=NUM_REPLICAS,
        cpus_per_replica=CPUS_PER_REPLICA,
        health_check_interval=1.0,
        **ENGINE_KWARGS,
    )
    yield svc
    svc.shutdown()


@pytest.fixture(scope="package")
def trainer(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


@pytest.fixture(scope="package")
def scheme(service):
    """The storage scheme whose pushes are live (restarted replicas load its version)."""
    s = WeightSyncScheme(service, transport="storage")
    yield s
    s.close()


# ---------------------------------------------------------------------------- helpers
def wait_ready(service, n: int = NUM_REPLICAS) -> None:
    """Wait until ``n`` replicas serve (a killed one is back)."""
    wait_until(
        lambda: service.num_replicas >= n,
        RESTART_TIMEOUT,
        interval=0.5,
        what=f"{n} ready replicas",
    )


def replica_pids(service, rid: int) -> tuple[int, int | None]:
    """(actor pid, engine-core pid) of a replica."""
    actor = service.replica_info(rid).pid
    children = psutil.Process(actor).children(recursive=True)
    engine = next((p.pid for p in children if "EngineCore" in _name(p)), None)
    return actor, engine


def _name(p: psutil.Process) -> str:
    try:
        return p.name() + " " + " ".join(p.cmdline())
    except psutil.Error:
        return ""


def kill_replica(service, rid: int, rng: random.Random) -> tuple[int, str]:
    """SIGKILL the actor or the engine-core process of replica ``rid``; returns (old actor pid, what)."""
    actor, engine = replica_pids(service, rid)
    what = rng.choice(["actor", "engine"]) if engine is not None else "actor"
    os.kill(actor if what == "actor" else engine, signal.SIGKILL)
    return actor, what


def wait_restarted(service, rid: int, old_pid: int) -> None:
    wait_until(
        lambda: rid in service.replica_ids and service.replica_info(rid).pid != old_pid,
        RESTART_TIMEOUT,
        interval=0.2,
        what=f"replica {rid} to restart",
    )


def service_rss(service) -> int:
    """Resident bytes of the driver plus every replica actor and its engine processes."""
    procs = [psutil.Process()]
    for rid in service.replica_ids:
        actor = psutil.Process(service.replica_info(rid).pid)
        procs += [actor, *actor.children(recursive=True)]
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    return [[7 + seed % 50, 8, 9, 10 + i % 100, 11 + i % 100] for i in range(n)]


@dataclass
class Traffic:
    """Client threads that keep sending batches until stopped, recording every outcome.

    Every call returns (a full answer, checked by :meth:`check`) or raises; a call that
    never returns would hang :meth:`stop`, which turns a lost request into a failure.
    """

    service: object
    threads: int = 3
    batch: int = 12
    params: dict = field(default_factory=lambda: {"max_tokens": 24, "ignore_eos": True})
    outcomes: list = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _workers: list = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    sent: int = 0

    def start(self) -> Traffic:
        for i in range(self.threads):
            t = threading.Thread(target=self._run, args=(i,), daemon=True)
            t.start()
            self._workers.append(t)
        return self

    def _run(self, i: int) -> None:
        k = 0
        while not self._stop.is_set():
            batch = prompts(self.batch, seed=31 * i + k)
            k += 1
            with self._lock:
                self.sent += 1
            try:
                self.outcomes.append((batch, self.service.generate_batch(batch, self.params)))
            except BaseException as e:
                self.outcomes.append((batch, e))

    def stop(self, timeout: float = RESTART_TIMEOUT * 2) -> None:
        self._stop.set()
        for t in self._workers:
            t.join(timeout)
            assert not t.is_alive(), "a client call never returned (a request was lost)"

    def check(self, full_length: bool = True) -> tuple[int, int]:
        """Every call answered every prompt in order, or raised a typed error; (ok, errors)."""
        assert len(self.outcomes) == self.sent, "every sent batch has an outcome"
        ok = errors = 0
        for batch, out in self.outcomes:
            if isinstance(out, BaseException):
                assert isinstance(out, TorchRLVLLMError), f"untyped error: {out!r}"
                errors += 1
                continue
            assert [d.prompt_token_ids.tolist() for d in out] == batch
            for d in out:
                s = d.samples[0]
                if full_length:
                    assert len(s.token_ids) == self.params["max_tokens"], s.finish_reason
                else:  # a sync with pause_mode="abort" may end requests early
                    assert s.finish_reason in ("length", "abort"), s.finish_reason
            ok += 1
        return ok, errors

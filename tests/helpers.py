"""Helpers shared by the test tiers: engine settings, exactness checks, fault and traffic
tools, adapters and cluster launches. One module, imported by the conftests and tests;
no test file imports another."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import psutil
import torch

from torchrl_vllm_ext import VLLMService
from torchrl_vllm_ext.batches import RequestBatch
from torchrl_vllm_ext.errors import TorchRLVLLMError
from torchrl_vllm_ext.jobs.check_model import perturb  # noqa: F401 (the tests' training step)
from torchrl_vllm_ext.messages import ReplicaInfo, RequestData, SampleData
from torchrl_vllm_ext.weight_sync.transports import registry

# Small and exact: fp32 so replica log-probs can be compared with transformers'.
ENGINE_KWARGS = {
    "dtype": "float32",
    "max_model_len": 256,
    "enforce_eager": True,
    "kv_cache_memory_bytes": 64 << 20,
}
CPUS_PER_REPLICA = 0.5
CPU_TRANSPORTS = registry.names(cpu=True, composite=False)
"""The transports CPU replicas push with, from the registry (storage, broadcast over gloo)."""
ONE_GPU_TRANSPORTS = tuple(n for n in registry.names() if n != "broadcast")
"""What reaches replicas on the trainer's own GPU (NCCL refuses two ranks on one GPU)."""
NUM_REPLICAS = 2
RESTART_TIMEOUT = 300.0  # generous: a restart is ~30 s on 2 shared cores
WORKERS = ("127.0.0.2", "127.0.0.3")
"""The worker nodes of the loopback cluster (tests/cluster)."""
ON_WORKERS = {"rollout": 0.01}
LORA_KWARGS = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 2}


def local_ray():
    """Ray through the package's own start-up (loopback only) for one test directory: each
    tier's conftest yields it from a package-scoped ``ray_cluster`` fixture, so tiers run
    alone or in any order (tests/cluster needs a process without Ray). Logical CPUs
    beyond the 2 physical cores let fractional replicas scale in tests. Its CPU replicas
    run without torch.compile, as the demo's (:func:`replicas_without_torch_compile`)."""
    import ray

    from torchrl_vllm_ext.engine.driver import cluster

    with replicas_without_torch_compile():
        owns = cluster.ensure_ray(num_cpus=4)
    yield
    if owns:
        ray.shutdown()


def replicas_without_torch_compile():
    """While a test tier starts its Ray cluster: the CPU replicas Ray then starts skip the
    one op vLLM-CPU compiles with inductor at a replica's first request, even under
    ``enforce_eager`` (~2 s of every replica start with a warm inductor cache, ~12 s
    without), as the demo's replicas do. Replicas on a GPU machine compile as users' do;
    the child processes of tests/integration/test_user_runs.py and TRAINER_RUN start
    their own clusters, as users do."""
    from torchrl_vllm_ext.grpo.run import replicas_without_torch_compile as without

    return without(gpu=torch.cuda.is_available())


def launch(model, num_replicas: int = NUM_REPLICAS, **kwargs) -> VLLMService:
    """A service with the tests' engine settings (fp32 unless ``dtype=``, small KV cache,
    fractional CPUs)."""
    options = {"cpus_per_replica": CPUS_PER_REPLICA, **ENGINE_KWARGS, **kwargs}
    return VLLMService.launch(model, num_replicas=num_replicas, **options)


def load_trainer(model_dir, dtype=torch.float32):
    """The model in transformers, fp32 unless ``dtype``, eval, with the attention vLLM
    computes (eager where sdpa would drop Gemma 2's soft-capping)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from torchrl_vllm_ext.weight_sync.verify import reference_attention

    config = AutoConfig.from_pretrained(model_dir)
    return AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, **reference_attention(config)
    ).eval()


def hf_token_logprobs(model, ids: list[int]) -> torch.Tensor:
    """Log-prob the transformers model gives each of ``ids[1:]`` after the tokens before it."""
    x = torch.tensor([ids])
    with torch.no_grad():
        logits = model(x).logits.float()
    logp = torch.log_softmax(logits[0, :-1], dim=-1)
    return logp.gather(-1, x[0, 1:, None])[:, 0]


def grpo_backward(model, tokenizer, data, pad_output: bool) -> None:
    """TorchRL's GRPOLoss with a transformers actor on ``data`` (which carries "advantage"):
    loss and backward; the engine held the trainer's exact fp32 weights, so importance
    weights are 1 (ESS 1, KL 0) and the gradients are finite."""
    from torchrl.modules.llm import TransformersWrapper
    from torchrl.objectives.llm import GRPOLoss

    actor = TransformersWrapper(
        model, tokenizer=tokenizer, input_mode="tokens", generate=False, pad_output=pad_output
    )
    loss_fn = GRPOLoss(actor, masking_strategy="sft")
    model.zero_grad()
    out = loss_fn(data)
    out.loss_objective.backward()
    assert abs(float(out.ESS) - 1.0) < 1e-3 and abs(float(out.kl_approx)) < 1e-3
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    model.zero_grad()


SEQUENCE = list(range(5, 45))  # the fixed sequence the exactness checks score


def rl_step(masters: dict[str, torch.Tensor], lr: float, seed: int, only=None) -> dict:
    """fp32 masters after one Adam-like step at ``lr`` (Adam's first step moves every value
    by ~lr: far below a bf16 ulp at RL learning rates); ``only``: the names that move."""
    g = torch.Generator().manual_seed(seed)
    return {
        n: t + lr * torch.randn(t.shape, generator=g).sign() if only is None or n in only else t
        for n, t in masters.items()
    }


def worker_calls(service, method: str, *args) -> dict[int, list]:
    """Call a worker-extension ``method`` on every replica's workers: {replica: [per worker]}."""
    import ray

    return {
        v.replica_id: ray.get(v.handle.collective_rpc.remote(method, args))
        for v in service.replicas()
    }


def replica_logprobs(service, ids=SEQUENCE) -> dict[int, tuple[torch.Tensor, str]]:
    """Score ``ids`` on every replica; {replica_id: (log-probs of ids[1:], weight version)}."""
    n = service.num_replicas
    data = service.generate_request_data(
        [ids] * n, {"max_tokens": 1, "prompt_logprobs": 0}, routing="round_robin"
    )
    assert {d.replica_id for d in data} == set(service.replica_ids)
    return {d.replica_id: (torch.tensor(d.prompt_logprobs[1:]), d.weight_version_end) for d in data}


# ---------------------------------------------------------------------- GPU tier
GPU_ENGINE_KWARGS = {"dtype": "bfloat16", "max_model_len": 256}  # CUDA graphs on: no enforce_eager


def served_prompt_logprobs(service, ids=SEQUENCE) -> dict[int, torch.Tensor]:
    """{replica_id: log-probs of ``ids[1:]``} as each replica serves them (prompt log-probs)."""
    return {rid: lp for rid, (lp, _) in replica_logprobs(service, ids).items()}


def served_decode(service, prompt: list[int], max_tokens: int = 24) -> dict[int, tuple]:
    """{replica_id: (greedy token ids, their log-probs)}: one request per replica, the same
    batch shape every call (so CUDA-graph decode is comparable bitwise from call to call)."""
    data = service.generate_request_data(
        [prompt] * service.num_replicas,
        {"max_tokens": max_tokens, "temperature": 0.0, "logprobs": 0},
        routing="round_robin",
    )
    assert {d.replica_id for d in data} == set(service.replica_ids)
    return {
        d.replica_id: (
            tuple(int(t) for t in d.samples[0].token_ids),
            torch.tensor(np.asarray(d.samples[0].logprobs)),
        )
        for d in data
    }


def cuda_trainer_logprobs(model, ids=SEQUENCE) -> torch.Tensor:
    """``hf_token_logprobs`` for a model on its own device, log-softmax in float32, on CPU."""
    device = next(model.parameters()).device
    x = torch.tensor([ids], device=device)
    with torch.no_grad():
        logp = torch.log_softmax(model(x).logits.float()[0, :-1], dim=-1)
    return logp.gather(-1, x[0, 1:, None])[:, 0].cpu()


def assert_replicas_match(
    service, model, version: str, tol: float = 1e-4, dtype: str = "float32"
) -> float:
    """Every replica serves ``version`` and its log-probs equal ``model``'s; returns the worst
    gap: max |gap| < ``tol`` for float32 replicas; for 16-bit ones (``dtype``) the value
    check's rule, mean |gap| to ``model`` in float32 within its limit (3x the rounding noise
    ``model`` itself shows in ``dtype``)."""
    from torchrl_vllm_ext.weight_sync.verify import reference

    if dtype == "float32":
        ref, limit = hf_token_logprobs(model, SEQUENCE), None
    else:
        expected = reference(model, SEQUENCE, dtype)
        ref, limit = torch.tensor(expected.logprobs), expected.limit
    worst = 0.0
    for rid, (got, served) in replica_logprobs(service).items():
        assert served == version, f"replica {rid} serves version {served}, expected {version}"
        if limit is None:
            gap = (got - ref).abs().max().item()
            assert gap < tol, f"replica {rid}: max |replica - trainer| log-prob = {gap:.2e}"
        else:
            gap = (got - ref).abs().mean().item()
            assert gap <= limit, f"replica {rid}: mean |gap| {gap:.3g} > limit {limit:.3g}"
        worst = max(worst, gap)
    assert set(service.weight_versions().values()) == {version}
    return worst


def wait_until(predicate, timeout: float, interval: float = 0.05, what: str = "condition"):
    """Poll ``predicate`` until it returns a truthy value; fail the test after ``timeout``."""

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


LLAMA_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(model_dir, out_dir, seed: int, rank: int = 8, targets=None):
    """A PEFT LoRA on every linear layer of the tiny model with random (non-zero) A and B,
    saved to ``out_dir``; returns the PEFT model (fp32, eval). ``targets``: PEFT's
    ``target_modules`` (default: Llama's projection names; ``"all-linear"`` for any family)."""
    from peft import LoraConfig, get_peft_model

    base = load_trainer(model_dir)
    config = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        target_modules=LLAMA_LINEARS if targets is None else targets,
        lora_dropout=0.0,
    )
    model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    model.save_pretrained(out_dir)
    return model.eval()


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
        lambda: any(r.replica_id == rid and r.info.pid != old_pid for r in service.replicas()),
        RESTART_TIMEOUT,
        interval=0.2,
        what=f"replica {rid} to restart",
    )


def replica_actor(service, rid: int):
    """The Ray actor of replica ``rid`` in any state (a held one is in no snapshot of ready
    replicas), by the name the pool gave it."""
    import ray

    prefix = f"{service.name}-r{rid}-"
    (name,) = [n for n in ray.util.list_named_actors() if n.startswith(prefix)]
    return ray.get_actor(name)


def sample_logprob_gap(model, data: RequestData) -> float:
    """max |log-prob the replica gave each generated token - ``model``'s| over the first
    sample of ``data`` (the tokens scored after the prompt, teacher-forced)."""
    prompt = [int(t) for t in data.prompt_token_ids]
    sample = data.samples[0]
    ids = prompt + [int(t) for t in sample.token_ids]
    expected = hf_token_logprobs(model, ids)[len(prompt) - 1 :]
    return (torch.tensor(np.asarray(sample.logprobs)) - expected).abs().max().item()


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
                self.outcomes.append(
                    (batch, self.service.generate_request_data(batch, self.params))
                )
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


def launch_on_workers(cluster, model, **kwargs) -> VLLMService:
    """A service on ``cluster`` whose replicas go to the worker nodes only."""
    return VLLMService.launch(
        model,
        ray_address=cluster.address,
        replica_resources=ON_WORKERS,
        **{"health_check_interval": 0, **kwargs},
        **ENGINE_KWARGS,
    )


def nodes_of(service) -> dict[int, str]:
    return {rid: service.replica_info(rid).node_ip for rid in service.replica_ids}


# ---------------------------------------------------------------------------- stand-ins
# For unit tests of the policy's logic without engines (tests/unit).
def sample(ids, finish="length", text=""):
    ids = np.asarray(ids, dtype=np.int64)
    return SampleData(
        token_ids=ids,
        logprobs=-(np.arange(len(ids), dtype=np.float32) + 1) / 10,
        finish_reason=finish,
        stop_reason=None,
        text=text,
    )


def request(prompt, responses, prompt_lp=False, version="3"):
    prompt = np.asarray(prompt, dtype=np.int64)
    plp = None
    if prompt_lp:
        plp = -np.arange(len(prompt), dtype=np.float32) - 0.5
        plp[0] = np.nan
    return RequestData(
        prompt_token_ids=prompt,
        prompt_logprobs=plp,
        samples=[sample(r) for r in responses],
        replica_id=0,
        weight_version_start=version,
        weight_version_end=version,
    )


class FakeService:
    """generate_request_data like VLLMService: response = max_tokens ids counting up from the last id."""

    replica_ids: ClassVar[list[int]] = [0]

    def __init__(self, max_token_id=499):
        self.calls = []
        self.max_token_id = max_token_id

    def replica_info(self, rid):
        return ReplicaInfo(rid, 0, "127.0.0.1", 256, self.max_token_id, 1000)

    def generate_request_data(self, prompts, params, timeout=None, routing=None):
        self.calls.append((prompts, params))
        per = params if isinstance(params, list) else [params] * len(prompts)
        out = []
        for p, sp in zip(prompts, per, strict=True):
            p = np.asarray(p)
            n, m = sp.get("n", 1), sp.get("max_tokens", 4)
            if sp.get("prompt_logprobs") == 0:
                out.append(request(p, [[1]], prompt_lp=True))
                continue
            out.append(request(p, [(p[-1] + 1 + k + np.arange(m)) % 400 for k in range(n)]))
        return out

    def generate_request_batch(
        self,
        prompts,
        params,
        timeout=None,
        routing=None,
        lora=None,
        return_log_probs=True,
        seeds=None,
    ):
        self.log_probs_asked = return_log_probs
        if seeds is not None:  # what the replicas make of one params and a seeds array
            params = [{**params, "seed": int(s)} for s in seeds]
        return RequestBatch.from_requests(
            self.generate_request_data(prompts, params, timeout=timeout)
        )

    async def agenerate_request_batch(self, prompts, params, **kwargs):
        await asyncio.sleep(0)
        return self.generate_request_batch(prompts, params, **kwargs)


# ---------------------------------------------------------------------- leftovers
TRAINER_RUN = """
import json, os, sys, time
import torch
from transformers import AutoModelForCausalLM
from torchrl_vllm_ext import AdapterSync, VLLMService, WeightSyncScheme
from tests.helpers import ENGINE_KWARGS, LORA_KWARGS, make_adapter, perturb

model, out, mode = sys.argv[1:]
# Its own Ray cluster, owned (and shut down) by the service.
svc = VLLMService.launch(model, num_replicas=1, cpus_per_replica=0.5,
                         health_check_interval=0, **LORA_KWARGS, **ENGINE_KWARGS)
import ray
from ray._private import worker
info = {"driver": os.getpid(), "replicas": [r.info.pid for r in svc.replicas()],
        "temps": [r.info.temp_dir for r in svc.replicas()],
        "session": worker._global_node.get_session_dir_path()}
scheme = WeightSyncScheme(svc, transport="storage")
trainer = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
for v in (1, 2):
    perturb(trainer, seed=v)
    scheme.push(trainer, version=v)
info["slots"] = str(scheme.storage_dir)
if mode == "kill":  # the test SIGKILLs this trainer now
    print(json.dumps(info), flush=True)
    time.sleep(3600)
if mode == "ray-first":  # TorchRL's GRPO scripts: ray.shutdown(), the engine never closed
    print(json.dumps(info), flush=True)
    ray.shutdown()
    sys.exit(0)
adapter = make_adapter(model, os.path.join(out, "adapter"), seed=3)
with AdapterSync(svc, "policy", keep=1) as sync:
    sync.push(adapter, 3)
    sync.push(adapter, 4)  # retires version 3
    info["adapter_versions"] = sync.live_versions
scheme.close()
svc.shutdown()
print(json.dumps(info), flush=True)
"""
"""A trainer that launches its own service (and Ray), pushes twice through storage, then
(mode ``close``) pushes two adapter versions and closes everything, (mode ``kill``)
prints what it made and waits to be SIGKILLed, or (mode ``ray-first``) shuts Ray down and
exits without closing the service or the scheme. Last stdout line: JSON of its pids, Ray
session directory, its replicas' temporary directories and the directories it made."""


def trainer_env(tag: str) -> dict:
    """The environment of a :data:`TRAINER_RUN` child: its markers carry ``tag``."""
    from torchrl_vllm_ext.leftovers import TAG_ENV

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return {**env, TAG_ENV: tag, "PYTHONPATH": os.getcwd()}


def ours_tagged(tag: str) -> list[str]:
    """Our directories in /dev/shm whose marker carries ``tag``."""
    from torchrl_vllm_ext import leftovers

    return [
        str(item.path)
        for item in leftovers.leftovers()
        if item.owner is not None and item.owner.tag == tag
    ]


def processes_of(session_dir: str, pids=()) -> list[str]:
    """Live processes of a Ray session (its session directory on their command line) or
    among ``pids``."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            cmd = " ".join(p.info["cmdline"] or ())
        except psutil.Error:
            continue
        if p.info["pid"] in pids or os.path.basename(session_dir) in cmd:
            found.append(f"{p.info['pid']}: {cmd[:120]}")
    return found


def tagged_processes(tag: str) -> list[str]:
    """Live processes whose environment carries ``tag`` (a child started with
    :func:`trainer_env` and everything it spawned: Ray's processes, replicas, vLLM's)."""
    from torchrl_vllm_ext.leftovers import TAG_ENV

    found = []
    for p in psutil.process_iter(["pid", "status", "name"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and p.environ().get(TAG_ENV) == tag:
                found.append(f"{p.info['pid']}: {p.info['name']}")
        except psutil.Error:  # gone meanwhile, or another user's
            continue
    return found


SHM = "/dev/shm"


def shm_names() -> set[str]:
    return set(os.listdir(SHM)) if os.path.isdir(SHM) else set()


def wait_no_new_semaphores(before: set[str], timeout: float = 30) -> None:
    """Wait until /dev/shm holds no named semaphore that it did not hold ``before``.

    A process that dies unlinks nothing itself: its multiprocessing resource tracker (a
    child that outlives it) unlinks its semaphores once it sees it gone, a moment later.
    """

    def new() -> list[str]:
        return sorted(n for n in shm_names() - before if n.startswith("sem."))

    try:
        wait_until(lambda: not new(), timeout, interval=0.2, what="new named semaphores to go")
    except AssertionError as e:
        raise AssertionError(f"{e}; still there: {new()}") from None


def shm_leaks(before: set[str], tag: str) -> tuple[list[str], list[str]]:
    """What /dev/shm holds now that it did not hold ``before``: (this run's, others').

    This run's: our directories whose owner marker carries ``tag`` (every directory the
    package makes is marked). Others': every other new name; on a shared machine other
    programs' segments come and go (multiprocessing's ``sem.mp-*``, other runs'
    directories), so they are reported, not attributed.
    """
    from torchrl_vllm_ext import leftovers

    mine, others = [], []
    for name in sorted(shm_names() - before):
        path = os.path.join(SHM, name)
        owner = leftovers.read_owner(path) if os.path.isdir(path) else None
        if owner is not None and owner.tag == tag:
            mine.append(f"{path} (owner pid {owner.pid})")
        else:
            others.append(path)
    return mine, others


# ---------------------------------------------------------------------- model families
@dataclass(frozen=True)
class FamilyRow:
    """One row of the family matrix (tests/integration/test_families.py, docs/models.md)."""

    arch: str
    """A key of ``torchrl_vllm_ext.testing.FAMILIES``."""
    tie: bool
    """Tied input embedding and LM head."""
    default: bool = False
    """In the default suite (otherwise ``--runslow`` only)."""
    bf16_default: bool = False
    """Its bfloat16 replica too (otherwise ``--runslow`` only)."""
    lora_refused: str = ""
    """Regex of vLLM's start-up error where it has no LoRA for the architecture (the
    replica then starts without LoRA)."""
    layout: str = "transformers"
    """Checkpoint layout (``make_tiny_model(layout=...)``): ``"hub"`` for the published one."""
    engine_refuses: str = ""
    """Regex of vLLM's own start-up error where vLLM-CPU cannot serve the family."""
    replays: bool = True
    """Pushes load by the worker's load plan (one batched copy); False: vLLM's layerwise
    reload on every push (MoE: the experts' kernel layout is re-derived after a load)."""
    note: str = ""
    """What the row exercises."""


FAMILY_MATRIX = {
    "qwen2": FamilyRow("qwen2", True, note="q/k/v biases, tied"),
    # bf16 with --runslow: the phi3 row's bfloat16 cells run the same checks by default,
    # the qwen3 row's float32 ones its structure, test_check_model's bfloat16 case a qwen3
    # bfloat16 replica.
    "qwen3": FamilyRow("qwen3", True, default=True, note="q/k norms per head, tied"),
    "llama": FamilyRow("llama", True, note="tied"),
    "llama3": FamilyRow("llama3", True, note="llama3 rope scaling, tied (Llama 3.2 1B/3B)"),
    "llama3_untied": FamilyRow("llama3", False, note="llama3 rope scaling, untied (8B/70B)"),
    "mistral": FamilyRow("mistral", False, note="untied"),
    "gemma2": FamilyRow(
        "gemma2", True, default=True, note="norm offset (1 + w), soft-capping, sliding window"
    ),
    "gemma3_text": FamilyRow(
        "gemma3_text", True, note="norm offset, q/k norms, sliding + full attention"
    ),
    # float32 with --runslow: test_check_model's served family is this Phi-3 in float32
    # (serve, storage, broadcast, LoRA), the bfloat16 row runs every cell on its fused
    # tensors by default.
    "phi3": FamilyRow(
        "phi3",
        False,
        bf16_default=True,
        note="qkv_proj and gate_up_proj fused in the checkpoint",
    ),
    "olmo2": FamilyRow("olmo2", False, note="q/k norms over all heads, post-norm"),
    "granite": FamilyRow("granite", False, note="embedding/residual/attention/logit multipliers"),
    "gpt2": FamilyRow(
        "gpt2",
        True,
        lora_refused="does not support LoRA",
        note="Conv1D (transposed) weights, learned positions, biases",
    ),
    "gpt2_hub": FamilyRow(
        "gpt2",
        True,
        default=True,
        layout="hub",
        lora_refused="does not support LoRA",
        note="published layout: no transformer. prefix, attention-mask buffers saved",
    ),
    "opt": FamilyRow("opt", True, note="learned positions (offset 2), biases, ReLU"),
    "opt_hub": FamilyRow("opt", True, layout="hub", note="published layout: decoder.* names"),
    # vLLM's LoRA for MoE layers is a Triton kernel: no LoRA on vLLM-CPU.
    "mixtral": FamilyRow(
        "mixtral", True, lora_refused="triton", replays=False, note="MoE: 4 experts, top-2"
    ),
    "qwen3_moe": FamilyRow(
        "qwen3_moe",
        True,
        lora_refused="triton",
        replays=False,
        note="MoE: 4 experts, top-2, q/k norms",
    ),
}
"""Every family the matrix checks, by row name (the docs' table rows)."""


def child_pids(service, replica_id: int) -> list[int]:
    """The processes a replica's engine runs in (its actor's children, on this machine)."""
    import psutil

    actor = psutil.Process(service.replica_info(replica_id).pid)
    return [p.pid for p in actor.children(recursive=True)]


# ---------------------------------------------------------------------- sharded trainers
@contextlib.contextmanager
def sharded_world(model_dir, steps: list[dict], world: int = 2):
    """This process as rank 0 of a gloo world whose other ranks run
    :func:`torchrl_vllm_ext.testing.sharded.follow` over ``steps`` in spawned processes;
    yields (the queue of their results, their processes). Gone afterwards: the ranks
    joined (killed if stuck), the process group destroyed."""
    import multiprocessing

    import torch.distributed as dist

    from torchrl_vllm_ext.listening import free_port
    from torchrl_vllm_ext.testing.sharded import follow, init_gloo

    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port("127.0.0.1")
    procs = [
        ctx.Process(target=follow, args=(rank, world, port, str(model_dir), steps, results))
        for rank in range(1, world)
    ]
    for p in procs:
        p.start()
    try:
        init_gloo(0, world, port)
        yield results, procs
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
                p.join()
        if dist.is_initialized():
            dist.destroy_process_group()


# ---------------------------------------------------------------------- asynchronous GRPO
ASYNC_PROMPTS, ASYNC_GROUP = 2, 4
"""The asynchronous fault tests' batch: 2 prompts x 4 samples (8 rows of 4 tokens)."""


def async_grpo_loop(service, scheme, model_dir, out_dir, *, steps: int, lag: int, trainer=None):
    """The demo's asynchronous loop (:class:`~torchrl_vllm_ext.grpo.async_loop.AsyncLoop`,
    in-flight pushes, the ``wait`` policy) over a running ``service`` and ``scheme``, wired as
    ``run_grpo`` wires it; ``trainer(trainer)``, if given, wraps the job's trainer. Returns
    (the loop, the trainer model)."""
    from torchrl_vllm_ext.grpo import GRPOConfig
    from torchrl_vllm_ext.grpo.async_loop import AsyncLoop
    from torchrl_vllm_ext.grpo.rollouts import RolloutRecorder
    from torchrl_vllm_ext.grpo.run import _collector, _task  # the job's own wiring
    from torchrl_vllm_ext.grpo.trainer_model import build_trainer, load_trainer_model

    cfg = GRPOConfig(
        model=str(model_dir),
        output=out_dir,
        steps=steps,
        prompts_per_step=ASYNC_PROMPTS,
        group_size=ASYNC_GROUP,
        async_mode=True,
        max_policy_lag=lag,
        in_flight_updates=True,
        rollout_correction="token_truncate",  # what run_grpo picks in async mode
    )
    _, tokenizer, model = load_trainer_model(cfg)
    model, env, _ = _task(cfg, model)
    job_trainer = build_trainer(cfg, model, tokenizer)
    recorder = RolloutRecorder(
        out_dir / "rollouts",
        steps=steps,
        rows=cfg.rows_per_step,
        prompt_len=cfg.prompt_len,
        response_len=cfg.answer_len,
    )
    loop = AsyncLoop(
        cfg, job_trainer if trainer is None else trainer(job_trainer), recorder, model, scheme
    )
    loop.collector, loop.updater, loop.reference = _collector(
        cfg, env, service, None, scheme, tokenizer, scheme
    )
    return loop, model


def recorded_spans(row) -> list:
    """A RolloutRecorder row's exact version spans (its per-token versions), checked
    against its three per-sample keys: the first span starts at its admitted version and
    none is newer than its end version."""
    from torchrl_vllm_ext.collectors import exact_spans

    spans = exact_spans(row["token_weight_version"])
    if spans:
        assert spans[0].first_version >= int(row["weight_version"]), (row, spans)
        assert spans[-1].last_version <= int(row["weight_version_end"]), (row, spans)
    return spans


def assert_spans_within_bound(rollouts, steps: int, lag: int) -> None:
    """No trained token of the first ``steps`` recorded steps (a RolloutRecorder's
    TensorDict) was made by weights older than the version it was consumed at - ``lag``,
    read from the recorded exact version spans; every row of those steps was recorded."""
    done = rollouts[:steps].reshape(-1)
    assert (done["consumed_version"] >= 0).all() and (done["step"] >= 0).all()
    assert (done["weight_version_end"] >= done["weight_version"]).all()
    for row in done:
        spans = recorded_spans(row)
        trained = [sp for sp in spans if sp.token_to > int(row["stale_tokens"])]
        consumed = int(row["consumed_version"])
        assert all(sp.first_version >= consumed - lag for sp in trained), (row, spans)


def producer_threads() -> list[threading.Thread]:
    """The rollout producers (RolloutQueue threads) alive in this process."""
    return [t for t in threading.enumerate() if t.name == "rollout-queue" and t.is_alive()]

"""Security: nothing of ours listens beyond loopback, no pickle across vLLM processes, private
weight slots.

- A Ray cluster the package starts listens on loopback only (checked on every listening
  socket of every process it started, in a fresh interpreter).
- vLLM's insecure-serialization switch is off in every replica process, and a call that
  would need it (a Python callable sent to the workers) is refused.
- Weight slots are readable by their owner only; the broadcast group's rendezvous store
  listens on the node address (loopback on one machine), not on every interface.
- A manifest cannot send readers outside the storage directory.
- During a storage, a broadcast, a sharded (2 ranks) and an adapter push, no process of
  ours listens beyond loopback (the test prints every listener it saw, by push).
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import psutil
import pytest
import ray
import torch

from torchrl_vllm_ext import WeightSyncError, WeightSyncScheme
from torchrl_vllm_ext.weight_sync.transports.storage.slots import CURRENT, SlotReader, SlotWriter

from ..helpers import assert_replicas_match, perturb, wait_ready

LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}

LISTENERS = """
import json, psutil, ray
from torchrl_vllm_ext.engine.driver import cluster

assert cluster.ensure_ray(num_cpus=1), "a fresh interpreter starts its own cluster"

@ray.remote
def ping():
    return 1

ray.get(ping.remote())  # a worker process is up and listening too
me = psutil.Process()
listening = []
for p in [me, *me.children(recursive=True)]:
    try:
        conns = p.net_connections(kind="inet")
    except psutil.Error:
        continue
    listening += [[p.name(), c.laddr.ip, c.laddr.port] for c in conns if c.status == psutil.CONN_LISTEN]
print(json.dumps({
    "listening": listening,
    "gcs": ray.get_runtime_context().gcs_address,
    "node_ip": ray.util.get_node_ip_address(),
}))
ray.shutdown()
"""


def test_ray_started_by_the_package_listens_on_loopback_only():
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    out = subprocess.run(
        [sys.executable, "-c", LISTENERS], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["node_ip"] == "127.0.0.1"
    assert report["gcs"].startswith("127.0.0.1:")
    names = {name for name, _, _ in report["listening"]}
    assert {"gcs_server", "raylet"} <= names, report["listening"]
    exposed = [row for row in report["listening"] if row[1] not in LOOPBACK]
    assert not exposed, f"listening beyond loopback: {exposed}"


def test_replicas_keep_insecure_serialization_off(service):
    wait_ready(service)
    for rid in service.replica_ids:
        actor = psutil.Process(service.replica_info(rid).pid)
        procs = [actor, *actor.children(recursive=True)]
        for p in procs:
            value = p.environ().get("VLLM_ALLOW_INSECURE_SERIALIZATION", "0")
            assert value in ("", "0"), f"{p.name()} (pid {p.pid}) has it set to {value!r}"
        # A callable never reaches vLLM's workers: the replica refuses it (an in-process
        # engine would run it as is; vLLM's engine-core channel refuses to encode it).
        handle = service.replica_handle(rid)
        with pytest.raises(Exception, match="VLLM_ALLOW_INSECURE_SERIALIZATION"):
            ray.get(handle.collective_rpc.remote(len, ()))
    out = service.generate_request_data([[1, 2, 3]], {"max_tokens": 2, "ignore_eos": True})
    assert len(out[0].samples[0].token_ids) == 2


def test_live_weight_slots_are_owner_only(service, scheme, trainer):
    wait_ready(service)
    perturb(trainer, seed=3000)
    scheme.push(trainer, version="security-1")
    scheme.push(trainer, version="security-2")  # both slots written
    assert_replicas_match(service, trainer, "security-2")
    root = scheme.storage_dir
    paths = [root, *root.rglob("*")]
    assert any(p.name == CURRENT for p in paths) and any(p.name == "slot-B" for p in paths)
    for p in paths:
        mode = stat.S_IMODE(os.stat(p).st_mode)
        assert mode == (0o700 if p.is_dir() else 0o600), f"{p}: {oct(mode)}"


def test_manifest_cannot_point_outside_the_storage_dir(tmp_path):
    outside = tmp_path / "outside"
    SlotWriter(outside).write({"w": torch.ones(4)}, "evil")
    root = tmp_path / "slots"
    SlotWriter(root).write({"w": torch.zeros(4)}, "1")
    manifest = json.loads((root / CURRENT).read_text())
    for slot in ("../outside/slot-A", "/etc", "A/../../outside/slot-A"):
        manifest["slot"] = slot
        (root / CURRENT).write_text(json.dumps(manifest))
        with pytest.raises(WeightSyncError, match="names slot"):
            SlotReader(root).read()


def _listening() -> set[tuple[str, int]]:
    conns = psutil.Process().net_connections(kind="inet")
    return {(c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN}


def test_broadcast_rendezvous_listens_on_the_node_address_only(service, scheme, trainer):
    wait_ready(service)
    before = _listening()
    with WeightSyncScheme(service, transport="broadcast") as broadcast:
        broadcast.push(trainer, version="security-broadcast")
        opened = _listening() - before
        assert opened, "the group's rendezvous store listens while the group lives"
        # The node address is loopback when the package started Ray; a cluster started
        # otherwise may have a routable one. Never every interface.
        allowed = LOOPBACK | {ray.util.get_node_ip_address()}
        assert {ip for ip, _ in opened} <= allowed, f"listening beyond {allowed}: {opened}"
    scheme.push(trainer, version="security-storage")  # the storage scheme is live again
    assert_replicas_match(service, trainer, "security-storage")


PUSHES = """
import json, sys, threading, time
import psutil, torch
from transformers import AutoModelForCausalLM
from torchrl_vllm_ext import AdapterSync, ShardedWeightSync, VLLMService, WeightSyncScheme
from torchrl_vllm_ext.testing.sharded import load, shard
from tests.helpers import ENGINE_KWARGS, LORA_KWARGS, make_adapter, perturb, sharded_world

model, out = sys.argv[1:]
phase = ["launch"]
seen = {}
stop = threading.Event()

def sample():  # every listening socket of this process and every process it started
    me = psutil.Process()
    while not stop.is_set():
        for p in [me, *me.children(recursive=True)]:
            try:
                name, conns = p.name(), p.net_connections(kind="inet")
            except psutil.Error:
                continue
            for c in conns:
                if c.status == psutil.CONN_LISTEN:
                    seen.setdefault(f"{c.laddr.ip} {c.laddr.port}", [name, phase[0]])
        time.sleep(0.02)

sampler = threading.Thread(target=sample, daemon=True)
sampler.start()
svc = VLLMService.launch(model, num_replicas=1, cpus_per_replica=0.5,
                         health_check_interval=0, **LORA_KWARGS, **ENGINE_KWARGS)
trainer = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
phase[0] = "storage push"
with WeightSyncScheme(svc, transport="storage") as scheme:
    perturb(trainer, seed=1)
    scheme.push(trainer, version=1)
phase[0] = "broadcast push"
with WeightSyncScheme(svc, transport="broadcast") as scheme:
    perturb(trainer, seed=2)
    scheme.push(trainer, version=2)
phase[0] = "sharded push (2 ranks)"
with sharded_world(model, [{"seed": 3}]) as (results, _):
    with WeightSyncScheme(svc, transport="storage") as scheme, ShardedWeightSync(scheme) as sync:
        sync.push(shard(load(model, 3)))
        assert results.get(timeout=120)[0] == "ok"
phase[0] = "adapter push"
with AdapterSync(svc, "policy", keep=1) as adapters:
    adapters.push(make_adapter(model, out, seed=4), 4)
phase[0] = "done"
time.sleep(0.2)
stop.set()
sampler.join()
svc.shutdown()
print(json.dumps(seen), flush=True)
"""


def test_nothing_of_ours_listens_beyond_loopback_during_every_kind_of_push(tiny_model, tmp_path):
    """A storage, a broadcast, a sharded (2 ranks) and an adapter push in a fresh process
    that starts its own Ray: every socket that process or any it started listens on
    while they run (Ray's, the replica's and vLLM's processes, gloo's pairs, the stores of
    the broadcast group and of the sharded push, the trainer's own group) is on loopback."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PYTHONPATH"] = os.getcwd()
    out = subprocess.run(
        [sys.executable, "-c", PUSHES, str(tiny_model), str(tmp_path / "adapter")],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    listeners = [(name, *key.split(" "), phase) for key, (name, phase) in seen.items()]
    print("listeners (process, address, port, first seen during):")
    for row in sorted(listeners, key=lambda r: (r[3], r[0])):
        print("  ", *row)
    # The sampler saw the stores these two pushes open (so it was looking).
    assert {"broadcast push", "sharded push (2 ranks)"} <= {row[3] for row in listeners}
    exposed = [row for row in listeners if row[1] not in LOOPBACK]
    assert not exposed, f"listening beyond loopback: {exposed}"

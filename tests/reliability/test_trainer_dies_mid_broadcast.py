"""The trainer (rank 0 of the gloo broadcast group) dies after sending part of an update.

The trainer runs in a subprocess that joins the group the replicas' workers joined, sends
``k`` of the update's ``n`` buckets and SIGKILLs itself (or, under ``--runslow``, also
hangs: SIGSTOP, so the replicas' receive times out). Every replica then reports a
typed error for that version, keeps serving its previous weights (log-probs unchanged)
and takes the next push, from a new trainer, exactly.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys

import pytest
import ray

from torchrl_vllm_ext import WeightSyncError, WeightSyncScheme
from torchrl_vllm_ext.listening import free_port
from torchrl_vllm_ext.weight_sync.params import expected_specs, named_tensors, validate
from torchrl_vllm_ext.weight_sync.specs import to_json
from torchrl_vllm_ext.weight_sync.transports.packing import pack

from ..helpers import assert_replicas_match, perturb, replica_logprobs, wait_ready, wait_until

BUCKET_BYTES = 64 << 10
TIMEOUT_S = 60.0  # the group's timeout: a trainer that stalls instead of dying is caught by it
STALL_TIMEOUT_S = 10.0  # the group's timeout when the trainer hangs (SIGSTOP) instead

TRAINER = """
import os, signal, sys
from safetensors.torch import load_file
from torchrl_vllm_ext.weight_sync.transports.broadcast.collective import BroadcastGroup
from torchrl_vllm_ext.weight_sync.transports.packing import pack

host, port, world, timeout, sent, path, bucket_bytes, mode = sys.argv[1:]
tensors = load_file(path)
_, buffers = pack(tensors, "doomed", int(bucket_bytes))
group = BroadcastGroup("gloo", host, int(port), int(world), float(timeout))
group.send(buffers[: int(sent)])
# The trainer dies mid-broadcast, or hangs (then the group's timeout catches it).
os.kill(os.getpid(), signal.SIGKILL if mode == "kill" else signal.SIGSTOP)
"""


def staged_outcome(handle, version: str):
    """None while the replica is still receiving; then True or the exception it raised."""
    try:
        ready = ray.get(handle.collective_rpc.remote("staged_weights_ready", (version,)))
    except Exception as e:
        return e
    return True if all(ready) else None


@pytest.mark.parametrize(
    ("mode", "seed"), [("kill", 0), pytest.param("stall", 1, marks=pytest.mark.slow)]
)
def test_trainer_dies_mid_broadcast(service, trainer, scheme, tiny_model, tmp_path, mode, seed):
    from safetensors.torch import save_file

    wait_ready(service)
    before_version = service.weight_version
    before = replica_logprobs(service)
    doomed = {k: v.clone() for k, v in trainer.state_dict().items()}
    perturb_weights(doomed, seed)
    tensors = validate(named_tensors(doomed), expected_specs(tiny_model))
    header, buffers = pack(tensors, "doomed", BUCKET_BYTES)
    n = len(buffers)
    assert n >= 3, "the update spans several buckets"
    sent = random.Random(seed).randint(1, n - 1)
    path = tmp_path / "doomed.safetensors"
    save_file({k: t.contiguous() for k, t in tensors.items()}, str(path))

    timeout = TIMEOUT_S if mode == "kill" else STALL_TIMEOUT_S
    handles = [service.replica_handle(rid) for rid in service.replica_ids]
    host, port, world = "127.0.0.1", free_port("127.0.0.1"), 1 + len(handles)
    joins = [
        h.collective_rpc.remote(
            "init_weight_broadcast", (host, port, world, 1 + i, "gloo", timeout)
        )
        for i, h in enumerate(handles)
    ]
    args = [host, port, world, timeout, sent, path, BUCKET_BYTES, mode]
    proc = subprocess.Popen([sys.executable, "-c", TRAINER, *map(str, args)])
    try:
        ray.get(joins)
        ray.get(
            [h.collective_rpc.remote("stage_weight_broadcast", (to_json(header),)) for h in handles]
        )
        if mode == "kill":
            assert proc.wait(timeout=300) == -signal.SIGKILL
        errors = [
            wait_until(
                lambda h=h: staged_outcome(h, "doomed"),
                TIMEOUT_S * 3,
                interval=0.2,
                what="the replica to give up the cut-off update",
            )
            for h in handles
        ]
    finally:
        if proc.poll() is None:  # the stalled trainer
            proc.kill()
            proc.wait()
    for error in errors:
        assert isinstance(error, WeightSyncError), f"expected a typed error, got {error!r}"
        assert "cut off after" in str(error) and f"of {n} buckets" in str(error), str(error)

    # Nothing of the cut-off update was loaded: same version, same log-probs, still serving.
    assert set(service.weight_versions().values()) == {before_version}
    after = replica_logprobs(service)
    for rid, (lp, version) in after.items():
        assert version == before_version
        assert (lp - before[rid][0]).abs().max().item() == 0.0

    # A new trainer's push forms a new group and lands exactly.
    perturb(trainer, seed=2000 + seed)
    with WeightSyncScheme(service, transport="broadcast", timeout=TIMEOUT_S) as fresh:
        fresh.push(trainer, version=f"after-trainer-death-{seed}")
        assert_replicas_match(service, trainer, f"after-trainer-death-{seed}")
    # Hand the live weights back to the package's storage scheme (restarts follow it).
    scheme.push(trainer, version=f"after-trainer-death-{seed}-storage")
    assert_replicas_match(service, trainer, f"after-trainer-death-{seed}-storage")


def perturb_weights(sd, seed: int) -> None:
    import torch

    g = torch.Generator().manual_seed(10_000 + seed)
    for t in sd.values():
        t.add_(torch.randn(t.shape, generator=g) * 0.05)

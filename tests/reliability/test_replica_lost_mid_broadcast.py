"""A replica SIGKILLed, or frozen with SIGSTOP, in the middle of a broadcast push.

The fault is injected between two buckets of the trainer's send (the first bucket has
gone out). Either way the push fails with a :class:`WeightSyncError` naming the replica
within the push's deadline (``fixed_s + bytes / min_bytes_per_s``; a frozen replica is
found by the receive polls going unanswered for ``fixed_s``), no replica loads the
update, the lost replica is killed and restarted at the live version, and every replica
then serves that version with log-probs equal to the trainer's.
"""

from __future__ import annotations

import logging
import signal
import time

import psutil
import pytest

from torchrl_vllm_ext import Deadline, WeightSyncError, WeightSyncScheme
from torchrl_vllm_ext.weight_sync.transports.broadcast.collective import BroadcastGroup

from ..helpers import assert_replicas_match, perturb, wait_ready, wait_restarted, wait_until

logger = logging.getLogger(__name__)

BUCKET_BYTES = 64 << 10  # several buckets: the fault falls between two of them
DEADLINE = Deadline(fixed_s=10.0)  # short for the test; healthy polls answer in ms


def end_process(proc: psutil.Process) -> bool:
    """Leave nothing frozen behind: resume and kill the victim if it still runs; whether
    it still ran."""
    try:
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        return True
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("fault", ["kill", "freeze"])
def test_a_replica_lost_mid_broadcast_is_named_within_the_deadline(
    service, trainer, scheme, fault, monkeypatch
):
    wait_ready(service)
    seed = 3000 if fault == "kill" else 3100
    perturb(trainer, seed=seed)
    live = f"mid-broadcast-{fault}-live"
    scheme.push(trainer, version=live)  # the live weights; restarts load them (storage)
    served = {k: v.clone() for k, v in trainer.state_dict().items()}
    nbytes = sum(v.numel() * v.element_size() for v in served.values())

    victim = service.replica_ids[-1]
    proc = psutil.Process(service.replica_info(victim).pid)
    fault_at = {}
    send = BroadcastGroup.send

    def send_with_fault(group, buffers):
        assert len(buffers) >= 3, "the update spans several buckets"
        send(group, buffers[:1])
        fault_at["t"] = time.monotonic()
        proc.send_signal(signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        send(group, buffers[1:])

    monkeypatch.setattr(BroadcastGroup, "send", send_with_fault)
    perturb(trainer, seed=seed + 1)
    try:
        with WeightSyncScheme(
            service, transport="broadcast", bucket_bytes=BUCKET_BYTES, deadline=DEADLINE
        ) as broadcast:
            with pytest.raises(WeightSyncError, match=rf"replica\(s\) \[{victim}\]") as error:
                broadcast.push(trainer, version=f"mid-broadcast-{fault}-lost")
            elapsed = time.monotonic() - fault_at["t"]
        # The pool killed it (Ray's kill reaches a stopped process too).
        wait_until(lambda: not proc.is_running(), 60, interval=0.2, what="the victim to be killed")
    finally:
        monkeypatch.undo()
        end_process(proc)
    limit = DEADLINE.for_bytes(nbytes)
    logger.info(
        "%s mid-broadcast: typed error after %.2fs (deadline %.1fs): %s",
        fault,
        elapsed,
        limit,
        error.value,
    )
    assert elapsed < limit, f"the error came {elapsed:.1f}s after the fault; deadline {limit:.1f}s"

    # The lost replica is back at the live version; nobody loaded the failed push.
    wait_restarted(service, victim, proc.pid)
    wait_ready(service)
    trainer.load_state_dict(served)
    assert_replicas_match(service, trainer, live)

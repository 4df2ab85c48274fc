"""The pool's one death policy, seen from every kind of call.

A replica is SIGKILLed and the next call that reaches it (a push, ``pause()``,
``stats()``, ``add_lora``) is the first to notice: health checks are off and no batch is
sent, so only that call's fan-out can record the death and restart the replica. Each
call must return a typed error or succeed on the other replica, and the killed replica
must come back at the live weights by itself. (``sleep()`` is refused on CPU before any
replica is called; ``wake_up()`` reaches every replica through the same fan-out, and each
live CPU engine refuses it, so it stands in for the sleep family here; tests/gpu sleeps.) Meanwhile 4 threads read the service's
sync accessors, which must never raise.
"""

from __future__ import annotations

import os
import signal
import threading

import psutil
import pytest

from torchrl_vllm_ext import WeightSyncScheme
from torchrl_vllm_ext.errors import TorchRLVLLMError

from ..helpers import (
    LORA_KWARGS,
    assert_replicas_match,
    launch,
    make_adapter,
    perturb,
    wait_restarted,
    wait_until,
)


@pytest.fixture(scope="module")
def quiet_service(tiny_model, ray_cluster):
    """Two replicas, no health checks: a death is noticed only by the call under test."""
    svc = launch(tiny_model, health_check_interval=0, **LORA_KWARGS)
    yield svc
    svc.shutdown()


def kill(service) -> tuple[int, int]:
    """SIGKILL the actor of the first ready replica; (its id, its old pid) once it is gone."""
    rid = service.replica_ids[0]
    pid = service.replica_info(rid).pid
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not _alive(pid), 30, what=f"replica {rid}'s actor to exit")
    return rid, pid


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def outcome(fn):
    """``fn()``'s result, or the error it raised, which must be one of ours."""
    try:
        return fn()
    except Exception as e:
        assert isinstance(e, TorchRLVLLMError), f"untyped error: {e!r}"
        return e


class Hammer:
    """4 threads reading every sync accessor in a loop; keeps whatever they raise."""

    def __init__(self, service):
        self.service, self.errors, self.reads = service, [], 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(4)]

    def _run(self) -> None:
        svc = self.service
        while not self._stop.is_set():
            try:
                _ = svc.replica_ids, svc.num_replicas
                views = svc.replicas()
                assert [v.replica_id for v in views] == sorted(v.replica_id for v in views)
                _ = {v.replica_id: v.info.pid for v in views}
                _ = svc.replica_states(), svc.deaths(), svc.weight_version
                _ = svc.max_token_id, svc.max_model_len, svc.list_loras(), svc.routing
                _ = svc.weight_versions(), svc.is_sleeping()
                self.reads += 1
            except Exception as e:
                if not isinstance(e, TorchRLVLLMError):  # a typed error is an answer
                    self.errors.append(e)

    def __enter__(self) -> Hammer:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)


def test_stats_notices_a_death_while_four_threads_read_the_accessors(quiet_service):
    svc = quiet_service
    with Hammer(svc) as hammer:
        rid, pid = kill(svc)
        stats = outcome(svc.stats)
        if not isinstance(stats, Exception):
            assert [s.replica_id for s in stats] == [r for r in svc.replica_ids if r != rid]
        # Noticed by stats() or by a reader's weight_versions(): a call, not a health check.
        assert [d.replica_id for d in svc.deaths()][-1:] == [rid]
        wait_restarted(svc, rid, pid)
    assert not hammer.errors, hammer.errors[:3]
    assert hammer.reads > 0
    assert svc.weight_versions()[rid] == svc.weight_version


def test_pause_succeeds_on_the_others_and_the_dead_replica_restarts(quiet_service):
    svc = quiet_service
    rid, pid = kill(svc)
    paused = outcome(lambda: svc.pause("abort"))
    outcome(svc.resume)
    assert not isinstance(paused, Exception) or "died" in str(paused)
    wait_restarted(svc, rid, pid)
    assert all(not s.paused for s in svc.stats()), "every replica serves after resume()"


def test_wake_up_during_a_death_is_a_typed_error_and_the_replica_restarts(quiet_service):
    svc = quiet_service
    rid, pid = kill(svc)
    woke = outcome(svc.wake_up)
    assert isinstance(woke, TorchRLVLLMError), "vLLM-CPU replicas have no sleep mode"
    assert [d.replica_id for d in svc.deaths()][-1:] == [rid], "noticed by wake_up()"
    wait_restarted(svc, rid, pid)
    assert svc.weight_versions()[rid] == svc.weight_version


def test_a_push_during_a_death_completes_on_the_others_and_the_restart_gets_it(
    quiet_service, trainer
):
    svc = quiet_service
    with WeightSyncScheme(svc, transport="storage") as scheme:
        perturb(trainer, seed=11)
        rid, pid = kill(svc)
        report = outcome(lambda: scheme.push(trainer, version=3))
        if not isinstance(report, Exception):
            assert rid not in report.pause_s, "the dead replica took no part"
        wait_restarted(svc, rid, pid)
        assert assert_replicas_match(svc, trainer, "3") < 1e-4, "the restart loaded version 3"


def test_a_lora_add_during_a_death_reaches_the_restarted_replica(
    quiet_service, tiny_model, trainer, tmp_path
):
    svc = quiet_service
    make_adapter(tiny_model, tmp_path / "a", seed=1)
    # The last test pushed and closed its scheme: a restart now would be held out of
    # traffic (it could not be brought to the live weights). A scheme open, as in use.
    with WeightSyncScheme(svc, transport="storage") as scheme:
        scheme.push(trainer, version=4)
        rid, pid = kill(svc)
        lora_id = outcome(lambda: svc.add_lora("a", tmp_path / "a"))
        if isinstance(lora_id, Exception):
            lora_id = svc.add_lora("a", tmp_path / "a")  # on the survivor, now noticed dead
        wait_restarted(svc, rid, pid)
        loaded = svc.run(svc.pool.call_all("list_loras"))
        assert all(lora_id in ids for ids in loaded.results.values()), loaded
        assert set(loaded.results) == set(svc.replica_ids)
        svc.remove_lora("a")

"""The in-process engine's thread protocol, on a stand-in for vLLM's ``LLMEngine``.

Logic only: holding requests while paused, the three pause modes, and what callers
see when a step fails. The real engine runs behind every integration test.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import pytest

from torchrl_vllm_ext.engine.replica.inproc import InprocEngine


@dataclass
class Out:
    request_id: str
    finished: bool = True


class FakeScheduler:
    def __init__(self, engine):
        self.engine = engine

    def get_request_counts(self):
        return len(self.engine.left), 0

    def get_kv_cache_usage(self):
        return 0.0


class FakeCore:
    """Stands for vLLM's ``InprocClient`` and the ``EngineCore`` inside it."""

    def __init__(self, engine):
        self.engine_core = self
        self.scheduler = FakeScheduler(engine)

    def shutdown(self):
        pass


class FakeEngine:
    """Each request finishes after ``steps`` engine steps of ``delay`` s; ``fail`` makes a step raise."""

    def __init__(self, steps: int = 3, delay: float = 0.0):
        self.steps = steps
        self.delay = delay
        self.left: dict[str, int] = {}
        self.stepped = 0
        self.fail = False
        self.engine_core = FakeCore(self)

    def has_unfinished_requests(self) -> bool:
        return bool(self.left)

    def add_request(self, rid, prompt, params):
        if prompt == "bad":
            raise ValueError(f"bad prompt for {rid}")
        self.left[rid] = self.steps

    def abort_request(self, rids):
        for rid in rids:
            self.left.pop(rid, None)

    def step(self):
        time.sleep(self.delay)
        if self.fail:
            raise RuntimeError("kernel crashed")
        self.stepped += 1
        for rid in self.left:
            self.left[rid] -= 1
        done = [rid for rid, n in self.left.items() if n == 0]
        for rid in done:
            del self.left[rid]
        return [Out(rid) for rid in done]

    def reset_prefix_cache(self, reset_running_requests=False):
        return True

    def reset_mm_cache(self):
        pass


def run(coro_fn, engine=None):
    """Run ``coro_fn(inproc, fake)`` against an InprocEngine driving ``engine``."""
    fake = engine or FakeEngine()

    async def main():
        inproc = InprocEngine.driving(fake, asyncio.get_running_loop())
        try:
            return await asyncio.wait_for(coro_fn(inproc, fake), 30)
        finally:
            inproc.shutdown()

    return asyncio.run(main())


def test_batch_is_added_at_once_and_outputs_come_back_in_order():
    async def body(inproc, fake):
        outs = await inproc.generate(["a", "b", "c"], [None] * 3, ["r0", "r1", "r2"])
        assert [o.request_id for o in outs] == ["r0", "r1", "r2"]
        assert fake.stepped == fake.steps, "one batch: the three requests stepped together"

    run(body)


def test_a_rejected_request_rejects_its_batch_and_the_engine_goes_on():
    async def body(inproc, fake):
        with pytest.raises(ValueError, match="bad prompt for r1"):
            await inproc.generate(["a", "bad"], [None] * 2, ["r0", "r1"])
        assert not fake.left, "the accepted part of the batch was taken back"
        assert not inproc.errored
        assert len(await inproc.generate(["a"], [None], ["r2"])) == 1

    run(body)


def test_requests_sent_while_paused_start_on_resume():
    async def body(inproc, fake):
        await inproc.pause(mode="keep")
        task = asyncio.create_task(inproc.generate(["a"], [None], ["r0"]))
        await asyncio.sleep(0.2)
        assert not task.done() and fake.stepped == 0
        assert inproc.load().waiting == 1, "a held request counts as waiting"
        await inproc.resume()
        assert len(await task) == 1

    run(body)


def test_keep_freezes_in_flight_requests():
    async def body(inproc, fake):
        fake.steps, fake.delay = 50, 0.005
        task = asyncio.create_task(inproc.generate(["a"], [None], ["r0"]))
        await asyncio.sleep(0.05)
        await inproc.pause(mode="keep", clear_cache=False)
        frozen_at = fake.stepped
        await asyncio.sleep(0.2)
        assert 0 < frozen_at < 50 and fake.stepped == frozen_at and not task.done()
        await inproc.resume()
        await task
        assert fake.stepped == 50

    run(body)


def test_wait_returns_once_in_flight_requests_finished():
    async def body(inproc, fake):
        fake.steps, fake.delay = 20, 0.005
        task = asyncio.create_task(inproc.generate(["a", "b"], [None] * 2, ["r0", "r1"]))
        await asyncio.sleep(0.05)
        await inproc.pause(mode="wait")
        assert task.done() and not fake.left
        await inproc.resume()

    run(body)


def test_a_failed_step_fails_every_caller_and_marks_the_engine_dead():
    from vllm.v1.engine.exceptions import EngineDeadError

    async def body(inproc, fake):
        fake.fail = True
        with pytest.raises(EngineDeadError, match="kernel crashed"):
            await inproc.generate(["a"], [None], ["r0"])
        assert inproc.errored
        with pytest.raises(EngineDeadError):
            await inproc.check_health()

    run(body)


@pytest.mark.parametrize(
    ("use_gpu", "workers", "engine_process", "expected"),
    [
        (False, 1, False, True),  # CPU, one worker: LLMEngine in the actor
        (False, 2, False, False),  # tensor parallel: AsyncLLM
        (True, 1, False, False),  # GPU: AsyncLLM
        (False, 1, True, False),  # the user asked for engine processes
    ],
)
def test_which_replicas_run_their_engine_in_process(use_gpu, workers, engine_process, expected):
    from types import SimpleNamespace

    from torchrl_vllm_ext.engine.driver.cluster import ReplicaResources, in_process_engine

    res = ReplicaResources(use_gpu=use_gpu, num_workers=workers, cpus=1.0)
    assert in_process_engine(res, SimpleNamespace(engine_process=engine_process)) is expected


@pytest.mark.parametrize(("env", "expected"), [(None, False), ("1", True), ("0", False)])
def test_engine_process_env_var_sets_the_config_default(monkeypatch, tmp_path, env, expected):
    from torchrl_vllm_ext.engine.config import ENGINE_PROCESS_ENV, ServiceConfig

    (tmp_path / "config.json").write_text("{}")
    if env is None:
        monkeypatch.delenv(ENGINE_PROCESS_ENV, raising=False)
    else:
        monkeypatch.setenv(ENGINE_PROCESS_ENV, env)
    assert ServiceConfig(model=str(tmp_path)).engine_process is expected
    assert ServiceConfig(model=str(tmp_path), engine_process=not expected).engine_process is (
        not expected
    )

"""A weight update in the pause is two calls to the engine: pause + load, then label + resume
(``Engine.update_call`` / ``finish_update``), on the in-process engine's thread and, for
``AsyncLLM``, as engine-core requests sent back to back (one round trip each)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from torchrl_vllm_ext._compat import pause_then
from torchrl_vllm_ext.engine.replica.async_engine import in_order
from torchrl_vllm_ext.engine.replica.inproc import InprocEngine

from .test_inproc_engine import FakeEngine


class LoadingEngine(FakeEngine):
    """The stand-in engine with the worker call and the label an update uses."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.events: list[tuple] = []
        self.version = "0"
        self.output_processor = SimpleNamespace(request_states={})  # nothing to abort there

    def collective_rpc(self, method, args=(), kwargs=None):
        self.events.append(("rpc", method, tuple(self.left)))
        return [args[0]]

    def set_weight_version(self, version):
        self.events.append(("label", version))
        self.version = version

    def reset_prefix_cache(self, reset_running_requests=False):
        self.events.append(("reset",))
        return True


def run(body, engine):
    async def main():
        inproc = InprocEngine.driving(engine, asyncio.get_running_loop())
        calls = []
        original = inproc.thread.call

        async def counted(fn, *args):
            calls.append(fn)
            return await original(fn, *args)

        inproc.thread.call = counted
        try:
            return await asyncio.wait_for(body(inproc, calls), 30)
        finally:
            inproc.shutdown()

    return asyncio.run(main())


@pytest.mark.parametrize("mode", ["abort", "keep"])
def test_the_in_process_engine_pauses_loads_and_resumes_in_two_thread_calls(mode):
    engine = LoadingEngine(steps=10**6, delay=0.001)

    async def body(inproc, calls):
        running = None
        if mode == "keep":  # a frozen request stays in the engine through the load
            running = asyncio.ensure_future(inproc.generate(["a"], [None], ["r0"]))
            while not engine.stepped:
                await asyncio.sleep(0.001)
        calls.clear()
        loaded = await inproc.update_call("load_staged_weights", ("7",), mode, mode == "abort")
        assert loaded == ["7"]
        stepped = engine.stepped
        held = asyncio.ensure_future(inproc.generate(["b"], [None], ["r1"]))  # held: paused
        await asyncio.sleep(0.02)
        assert engine.stepped == stepped, "nothing steps between the load and the resume"
        await inproc.finish_update("7", reset_cache=mode == "keep", resume=True)
        assert len(calls) == 3  # pause + load, the held batch's add, label + resume
        await asyncio.sleep(0.02)
        assert engine.stepped > stepped and engine.version == "7"
        engine.left.clear()  # finish nothing more; the fake cannot abort through vLLM
        held.cancel()
        if running is not None:
            running.cancel()
        await asyncio.gather(held, *([running] if running else []), return_exceptions=True)

    run(body, engine)
    rpc = next(e for e in engine.events if e[0] == "rpc")
    assert rpc[2] == (() if mode == "abort" else ("r0",))
    label = engine.events.index(("label", "7"))
    assert (("reset",) in engine.events[label:]) is (mode == "keep")


def test_a_wait_pause_drains_before_the_load():
    engine = LoadingEngine(steps=5, delay=0.001)

    async def body(inproc, calls):
        running = asyncio.ensure_future(inproc.generate(["a"], [None], ["r0"]))
        while not engine.stepped:
            await asyncio.sleep(0.001)
        await inproc.update_call("load_staged_weights", ("8",), "wait", True)
        await inproc.finish_update("8", reset_cache=False, resume=True)
        assert (await running)[0].request_id == "r0"

    run(body, engine)
    rpc = next(e for e in engine.events if e[0] == "rpc")
    assert rpc[2] == (), "the request finished before the load"


def test_no_pause_mode_loads_without_pausing_or_resuming():
    engine = LoadingEngine()

    async def body(inproc, calls):
        await inproc.update_call("load_staged_weights", ("9",), None, False)
        await inproc.finish_update("9", reset_cache=True, resume=False)
        assert not inproc.thread.paused

    run(body, engine)
    assert engine.version == "9"


# ---------------------------------------------------------------------- AsyncLLM (pipelined)
class Wire:
    """A fake engine-core channel: a request is sent when its coroutine starts (as vLLM's
    core client sends before its first suspension); answers arrive when released."""

    def __init__(self):
        self.sent: list[str] = []
        self.answers: dict[str, asyncio.Future] = {}

    async def request(self, name: str, result=None):
        self.sent.append(name)
        future = self.answers.setdefault(name, asyncio.get_running_loop().create_future())
        await future
        return result

    def answer_all(self):
        for f in self.answers.values():
            if not f.done():
                f.set_result(None)


def test_pause_then_sends_the_load_before_the_pause_is_answered():
    async def main():
        wire = Wire()
        core = SimpleNamespace(
            pause_scheduler_async=lambda mode, clear_cache: wire.request(f"pause-{mode}")
        )

        async def clear_mm():
            wire.sent.append("clear-mm")

        llm = SimpleNamespace(
            engine_core=core, renderer=SimpleNamespace(clear_mm_cache_async=clear_mm)
        )
        task = asyncio.ensure_future(
            pause_then(llm, "abort", True, lambda: wire.request("load", [1]))
        )
        for _ in range(5):
            await asyncio.sleep(0)
        assert wire.sent == ["clear-mm", "pause-abort", "load"], "both requests are in flight"
        assert not task.done()
        wire.answer_all()
        assert await task == [1]

    asyncio.run(main())


def test_pause_then_refuses_a_wait_pause():
    with pytest.raises(ValueError, match="wait"):
        asyncio.run(pause_then(SimpleNamespace(), "wait", True, None))


def test_in_order_sends_every_request_before_awaiting_any_answer():
    async def main():
        wire = Wire()
        task = asyncio.ensure_future(
            in_order([lambda n=n: wire.request(n, n) for n in ("label", "reset", "resume")])
        )
        for _ in range(6):
            await asyncio.sleep(0)
        assert wire.sent == ["label", "reset", "resume"]
        wire.answer_all()
        assert await task == ["label", "reset", "resume"]

    asyncio.run(main())

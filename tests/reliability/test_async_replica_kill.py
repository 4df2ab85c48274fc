"""A replica SIGKILLed mid-generation while the asynchronous loop runs (in-flight pushes,
two replicas) loses no sample and breaks no bound.

The generations it held are sent again to the other replica (admitted there at the version
it serves then), the loop trains every step on full batches, pushes land on the survivor,
and the killed replica comes back at the version live when its restart finishes (the scheme
stays open until then: a replica restarted after its scheme closed holds the checkpoint
and takes no requests until the next push).
"""

from __future__ import annotations

import logging
import os
import signal

from tensordict import TensorDict

from torchrl_vllm_ext import WeightSyncScheme

from ..helpers import (
    ASYNC_GROUP,
    ASYNC_PROMPTS,
    assert_replicas_match,
    assert_spans_within_bound,
    async_grpo_loop,
    load_trainer,
    producer_threads,
    wait_ready,
    wait_restarted,
    wait_until,
)

STEPS, LAG = 6, 1
KILL_AFTER = 1
"""The step after which replica :data:`VICTIM` is killed, once it holds generations."""
VICTIM = 0


def test_a_replica_killed_mid_generation_in_async_mode_loses_no_sample(
    service, scheme, tiny_model, tmp_path, caplog
):
    wait_ready(service)
    caplog.set_level(logging.WARNING, logger="torchrl_vllm_ext.engine.driver.generation")
    deaths_before = len(service.deaths())
    killed: dict[str, int] = {}
    with WeightSyncScheme(service, transport="storage", pause_mode="keep") as keep:
        loop, model = async_grpo_loop(service, keep, tiny_model, tmp_path, steps=STEPS, lag=LAG)
        keep.push(load_trainer(tiny_model), version="0")  # the loop's versions count from 0

        def kill_mid_generation(metrics: dict) -> None:
            if metrics["step"] != KILL_AFTER:
                return
            # The producer is generating the next batch: kill the victim while it holds a share.
            wait_until(
                lambda: service.pool.inflight(VICTIM) > 0, 60, interval=0.002,
                what=f"replica {VICTIM} to hold generations",
            )  # fmt: skip
            killed["pid"] = service.replica_info(VICTIM).pid
            os.kill(killed["pid"], signal.SIGKILL)

        steps = loop.run(progress=False, on_step=kill_mid_generation)
        assert producer_threads() == []
        assert [s["batch_index"] for s in steps] == list(range(STEPS))  # none lost, in order
        assert all(s["staleness_max"] <= LAG for s in steps)
        assert [d.replica_id for d in service.deaths()[deaths_before:]] == [VICTIM]
        assert "lost a replica; retrying on the others" in caplog.text  # it died mid-generation

        # Every prompt of every batch came back with its whole answer, within the bound.
        rollouts = TensorDict.load_memmap(tmp_path / "rollouts")
        assert rollouts.batch_size == (STEPS, ASYNC_PROMPTS * ASYNC_GROUP)
        assert (rollouts["response"] >= 0).all()
        assert_spans_within_bound(rollouts, STEPS, LAG)

        # Restarted while the scheme is open: it serves the live version, exactly.
        wait_restarted(service, VICTIM, killed["pid"])
        served = load_trainer(tiny_model)
        served.load_state_dict(model.state_dict())
        assert_replicas_match(service, served, str(STEPS))
    # The package's scheme takes the live weights back (later restarts follow it).
    scheme.push(served, version=f"after-async-kill-{STEPS}")

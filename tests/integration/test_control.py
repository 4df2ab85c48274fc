"""Pause / resume with vLLM's modes, weight versions, health."""

from __future__ import annotations

import concurrent.futures
import time

import pytest

from torchrl_vllm_ext import ConfigurationError

from ..helpers import wait_until

LONG = {"max_tokens": 48, "ignore_eos": True}


def batch(n=8, seed=0):
    return [[5 + seed, 6, 7, 8 + i] for i in range(n)]


def start_batch(pool, service, params=LONG, n=8):
    fut = pool.submit(service.generate_request_data, batch(n), params, routing="round_robin")
    wait_until(
        lambda: any(s.running > 0 for s in service.stats()) or fut.done(),
        60,
        what="requests running in vLLM",
    )
    return fut


@pytest.fixture
def pool():
    with concurrent.futures.ThreadPoolExecutor(2) as p:
        yield p


def test_keep_freezes_and_resumes_in_flight_requests(service, pool):
    fut = start_batch(pool, service)
    service.pause("keep")
    try:
        assert all(s.paused for s in service.stats())
        time.sleep(0.5)
        assert not fut.done(), "frozen requests do not finish while paused"
    finally:
        service.resume()
    data = fut.result(timeout=120)
    assert all(
        len(d.samples[0].token_ids) == 48 and d.samples[0].finish_reason == "length" for d in data
    )


def test_abort_ends_in_flight_requests_with_partial_tokens(service, pool):
    fut = start_batch(pool, service, {"max_tokens": 200, "ignore_eos": True})
    service.pause("abort")
    service.resume()
    data = fut.result(timeout=120)
    reasons = {d.samples[0].finish_reason for d in data}
    assert "abort" in reasons
    assert all(
        len(d.samples[0].token_ids) < 200 for d in data if d.samples[0].finish_reason == "abort"
    )


def test_wait_drains_in_flight_requests_before_returning(service, pool):
    fut = start_batch(pool, service)
    service.pause("wait")
    try:
        assert fut.result(timeout=1), "pause('wait') returns only after in-flight requests finished"
    finally:
        service.resume()
    assert all(d.samples[0].finish_reason == "length" for d in fut.result())


def test_requests_submitted_while_paused_wait_for_resume(service, pool):
    service.pause("keep")
    try:
        fut = pool.submit(service.generate_request_data, batch(2, seed=1), {"max_tokens": 2})
        time.sleep(1.0)
        assert not fut.done()
    finally:
        service.resume()
    assert len(fut.result(timeout=60)) == 2


def test_weight_version_round_trip(service):
    service.set_weight_version("v9")
    try:
        assert set(service.weight_versions().values()) == {"v9"}
        assert service.weight_version == "v9"
        assert {s.weight_version for s in service.stats()} == {"v9"}
    finally:
        service.set_weight_version("0")


def test_health_check_and_bad_pause_mode(service):
    assert service.check_health() == {rid: True for rid in service.replica_ids}
    with pytest.raises(ConfigurationError, match="'freeze'"):
        service.pause("freeze")


def test_a_new_label_keeps_the_prefix_cache_and_new_weights_drop_it(service):
    # An adapter push only relabels the replicas (AdapterSync -> set_weight_version): the
    # base model's cached prefixes stay valid. A weight load drops them.
    long = [list(range(5, 205))] * service.num_replicas  # > one 128-token CPU block each

    def cached() -> list[int]:
        data = service.generate_request_data(long, {"max_tokens": 1}, routing="round_robin")
        assert {d.replica_id for d in data} == set(service.replica_ids)
        return [d.cached_tokens for d in data]

    cached()  # fills every replica's cache
    assert min(cached()) >= 128
    service.set_weight_version("relabelled")
    try:
        assert min(cached()) >= 128, "a label alone keeps the prefix cache"
        service.reset_prefix_cache()  # what every weight load does
        assert max(cached()) == 0, "cached with other weights: never served"
    finally:
        service.set_weight_version("0")

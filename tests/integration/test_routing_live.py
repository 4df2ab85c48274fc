"""Each routing strategy, on the live two-replica service."""

from __future__ import annotations

from collections import Counter

PARAMS = {"max_tokens": 2}


def replicas_of(data):
    return [d.replica_id for d in data]


def test_prefix_keeps_a_shared_prefix_on_one_replica(service):
    system = list(range(10, 50))  # a 40-token "system prompt", longer than the hashed prefix
    batch = [[*system, 100 + i] for i in range(4)] + [[200 + i] * 40 for i in range(12)]
    first = replicas_of(service.generate_request_data(batch, PARAMS, routing="prefix"))
    again = replicas_of(service.generate_request_data(batch, PARAMS, routing="prefix"))
    assert len(set(first[:4])) == 1, "the shared prefix lands on one replica"
    assert first == again, "prefix routing is deterministic"
    assert len(set(first)) == 2, "distinct prefixes spread over both replicas"


def test_least_outstanding_splits_a_batch_evenly(service):
    counts = Counter(
        replicas_of(
            service.generate_request_data(
                [[5, 6, 7, i] for i in range(20)], PARAMS, routing="least_outstanding"
            )
        )
    )
    assert sorted(counts.values()) == [10, 10]


def test_round_robin_alternates(service):
    ids = replicas_of(
        service.generate_request_data([[9, i] for i in range(6)], PARAMS, routing="round_robin")
    )
    assert ids[0::2] == [ids[0]] * 3 and ids[1::2] == [ids[1]] * 3 and ids[0] != ids[1]


def test_kv_cache_uses_reported_usage(service):
    ids = replicas_of(
        service.generate_request_data(
            [[3, 4, i] for i in range(16)], {"max_tokens": 4}, routing="kv_cache"
        )
    )
    # Both caches report (near) zero usage when the batch arrives, so the projected
    # usage of this batch's own tokens balances it.
    assert sorted(Counter(ids).values()) == [8, 8]


def test_fallback_chain_routes_short_prompts_by_load(service):
    ids = replicas_of(
        service.generate_request_data(
            [[1], [2], [3], [4]], PARAMS, routing=["prefix", "least_outstanding"]
        )
    )
    assert sorted(Counter(ids).values()) == [2, 2]


def test_session_sends_each_next_turn_to_the_replica_that_served_the_last(service):
    # 9 chats (odd: round robin would alternate their replicas from turn to turn).
    params = {"max_tokens": 8, "ignore_eos": True}
    prompts = [[300 + i] * 20 for i in range(9)]
    last = None
    for _turn in range(3):
        out = service.generate_request_data(
            prompts, params, routing=["session", "least_outstanding"]
        )
        served = replicas_of(out)
        if last is not None:
            assert served == last, "every turn went where its chat's previous turn ran"
        assert len(set(served)) == 2, "the chats are spread over both replicas"
        last = served
        prompts = [
            [*p, *d.samples[0].token_ids.tolist(), 7, 7] for p, d in zip(prompts, out, strict=True)
        ]

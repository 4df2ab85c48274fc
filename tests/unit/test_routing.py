import subprocess
import sys

import pytest

from torchrl_vllm_ext.engine.routing import (
    ReplicaLoad,
    RouterState,
    RoutingRequest,
    prefix_hash,
    route,
    validate_strategies,
)
from torchrl_vllm_ext.errors import UnknownRoutingStrategyError


def loads(*outstanding, usage=None, capacity=None):
    return [
        ReplicaLoad(
            i,
            o,
            kv_cache_usage=None if usage is None else usage[i],
            kv_capacity_tokens=None if capacity is None else capacity,
        )
        for i, o in enumerate(outstanding)
    ]


def prompts(n, length=8, offset=0):
    return [[offset + i] * length for i in range(n)]


def test_prefix_hash_is_stable_across_processes():
    tokens = list(range(100))
    code = (
        "from torchrl_vllm_ext.engine.routing import prefix_hash;"
        "print(prefix_hash(list(range(100))).hex())"
    )
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert other.stdout.strip() == prefix_hash(tokens).hex()
    # Only the prefix matters.
    assert prefix_hash(tokens) == prefix_hash([*tokens[:32], 999])
    assert prefix_hash(tokens) != prefix_hash([1, *tokens])


def test_prefix_routes_same_prefix_to_same_replica():
    shared = [7] * 40  # longer than the hashed prefix
    batch = [[*shared, i] for i in range(6)] + prompts(6, offset=100)
    out = route(RoutingRequest(batch), loads(0, 0, 0), ["prefix"], RouterState())
    assert len(set(out[:6])) == 1
    again = route(RoutingRequest(batch), loads(0, 0, 0), ["prefix"], RouterState())
    assert out[:6] == again[:6]


def test_prefix_spreads_distinct_prefixes_and_keeps_them_when_a_replica_is_added():
    batch = prompts(200)
    two = route(RoutingRequest(batch), loads(0, 0), ["prefix"], RouterState())
    assert 60 < two.count(0) < 140
    three = route(RoutingRequest(batch), loads(0, 0, 0), ["prefix"], RouterState())
    moved = [i for i in range(200) if three[i] != 2 and three[i] != two[i]]
    assert not moved, "rendezvous hashing moves only prefixes that go to the new replica"


def test_short_prompts_fall_back_to_next_strategy():
    batch = [[1], [2], [3], [4]]
    out = route(RoutingRequest(batch), loads(10, 0), ["prefix", "least_outstanding"], RouterState())
    assert out == [1, 1, 1, 1]


def test_prefix_yields_when_a_replica_would_be_overloaded():
    same = [[5] * 8 for _ in range(40)]
    out = route(RoutingRequest(same), loads(0, 0), ["prefix", "least_outstanding"], RouterState())
    assert min(out.count(0), out.count(1)) >= 8


def test_least_outstanding_balances_the_batch():
    out = route(RoutingRequest(prompts(64)), loads(0, 0), ["least_outstanding"], RouterState())
    assert out.count(0) == out.count(1) == 32
    out = route(RoutingRequest(prompts(10)), loads(6, 0), ["least_outstanding"], RouterState())
    assert out.count(1) == 8 and out.count(0) == 2


def test_kv_cache_prefers_emptier_cache_and_defers_when_unknown():
    req = RoutingRequest(prompts(10), expected_tokens=[100] * 10)
    out = route(req, loads(0, 0, usage=[0.5, 0.0], capacity=1000), ["kv_cache"], RouterState())
    # Replica 1 takes 5 prompts (0.5 projected) before replica 0 becomes equally attractive.
    assert out.count(1) >= 5 and out.count(0) >= 1
    unknown = route(req, loads(0, 3), ["kv_cache", "least_outstanding"], RouterState())
    assert unknown == route(req, loads(0, 3), ["least_outstanding"], RouterState())


def test_round_robin_continues_across_batches():
    state = RouterState()
    a = route(RoutingRequest(prompts(3)), loads(0, 0, 0), ["round_robin"], state)
    b = route(RoutingRequest(prompts(3)), loads(0, 0, 0), ["round_robin"], state)
    assert a + b == [0, 1, 2, 0, 1, 2]


def test_unknown_strategy_is_a_typed_error_naming_the_value():
    with pytest.raises(UnknownRoutingStrategyError, match=r"'fastest'.*least_outstanding"):
        validate_strategies(["prefix", "fastest"])
    with pytest.raises(UnknownRoutingStrategyError):
        validate_strategies([])
    assert validate_strategies("kv_cache") == ("kv_cache",)


def test_session_map_finds_the_longest_served_prefix_and_forgets_a_replica():
    from torchrl_vllm_ext.engine.sessions import SessionMap

    sessions = SessionMap(block=4, capacity=100)
    sessions.record(list(range(12)), replica_id=0)
    sessions.record([*range(8), 50, 51, 52, 53], replica_id=1)  # shares 2 blocks, then its own
    assert sessions.lookup([*range(12), 99]) == 0
    assert sessions.lookup([*range(8), 50, 51, 52, 53, 99]) == 1
    assert sessions.lookup([*range(8), 77, 77, 77, 77]) == 1  # the last to serve the prefix
    assert sessions.lookup([1, 2, 3]) is None  # not one full block
    sessions.forget(1)
    assert sessions.lookup([*range(8), 50, 51, 52, 53]) is None
    small = SessionMap(block=4, capacity=2)
    small.record(list(range(16)), replica_id=0)  # 4 digests: the 2 oldest go
    assert len(small) == 2 and small.lookup(list(range(16))) is None


def test_session_strategy_yields_to_the_cap_and_to_unknown_prompts():
    from torchrl_vllm_ext.engine.sessions import SessionMap

    state = RouterState(sessions=SessionMap(block=2))
    for i in range(10):
        state.sessions.record([i, i, i, i], replica_id=0)  # every chat ran on replica 0
    prompts = [[i, i, i, i, 9] for i in range(10)] + [[42, 43, 44]]
    out = route(RoutingRequest(prompts), loads(0, 0), ["session", "least_outstanding"], state)
    # The cap is 1.5 x the mean load + 1 = 9.25 prompts: 9 chats stay, the rest move.
    assert out[:10].count(0) == 9
    assert out[10] == 1, "an unknown prompt goes by the next strategy"

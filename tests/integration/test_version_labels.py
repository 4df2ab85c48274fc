"""A replica never serves under a version whose weights it does not hold (issue 49), on real
replicas: a push, the scheme closed, a replica killed; what each replica serves is checked
by value against the model its label names, and so are the samples, token by token.

The default run holds a restarted replica out of traffic and brings it back with a push on
the shared service, which then gets the checkpoint's weights back at version "0" (one push,
``restore_checkpoint``). With ``--runslow`` the same goes on until both replicas restarted
(the checkpoint becomes the live version again), and a service of its own lets mixed versions
serve side by side; tests/unit/test_labels.py proves the pool's rule for both by default.
"""

from __future__ import annotations

import os
import signal

import pytest
import ray
import torch

from torchrl_vllm_ext import WeightSyncScheme

from ..helpers import (
    RESTART_TIMEOUT,
    SEQUENCE,
    assert_replicas_match,
    hf_token_logprobs,
    launch,
    perturb,
    replica_actor,
    sample_logprob_gap,
    wait_ready,
    wait_restarted,
    wait_until,
)

GREEDY = {"max_tokens": 8, "temperature": 0.0, "logprobs": 0, "ignore_eos": True}
PROMPTS = [[7 + i, 8, 9, 10 + i] for i in range(8)]


def push_and_close(service, trainer, version: str) -> None:
    with WeightSyncScheme(service, transport="storage") as scheme:
        scheme.push(trainer, version=version)
    assert_replicas_match(service, trainer, version)


def kill(service, rid: int) -> int:
    old = service.replica_info(rid).pid
    os.kill(old, signal.SIGKILL)
    return old


def probe_gap(actor, model) -> float:
    """max |log-probs ``actor`` serves for the fixed sequence - ``model``'s|."""
    served = torch.tensor(ray.get(actor.probe_logprobs.remote(SEQUENCE), timeout=120))
    return (served - hf_token_logprobs(model, SEQUENCE)).abs().max().item()


def held_then_brought_up(service, trainer, hf_model) -> tuple[int, int]:
    """A replica restarted after the scheme closed is held at the checkpoint's label; a
    push with a new scheme brings it to the pushed version. (victim, survivor)."""
    wait_ready(service)
    perturb(trainer, seed=49)
    push_and_close(service, trainer, "pushed-49")
    victim, survivor = service.replica_ids
    kill(service, victim)
    wait_held(service, victim)
    # The held replica holds the checkpoint, and says so; it takes no request.
    held = replica_actor(service, victim)
    assert ray.get(held.get_weight_version.remote()) == "0"
    assert probe_gap(held, hf_model) < 1e-4, "it serves the checkpoint's weights"
    assert probe_gap(held, trainer) > 1e-2, "the probe tells the two models apart"
    assert service.replica_ids == [survivor] and service.weight_version == "pushed-49"
    assert_replicas_match(service, trainer, "pushed-49")
    data = service.generate_request_data(PROMPTS, GREEDY)
    assert {d.replica_id for d in data} == {survivor}
    for d in data:  # every token came from the pushed weights, and says so
        assert d.weight_version_start == d.weight_version_end == "pushed-49"
        assert sample_logprob_gap(trainer, d) < 1e-3

    # A push with a new scheme brings the held replica to its version (after the push,
    # while the scheme is open).
    perturb(trainer, seed=50)
    with WeightSyncScheme(service, transport="storage") as scheme:
        assert list(scheme.push(trainer, version="pushed-50").pause_s) == [survivor]
        wait_ready(service)
        assert_replicas_match(service, trainer, "pushed-50")
    return victim, survivor


def test_a_replica_restarted_after_the_scheme_closed_is_held_at_the_checkpoints_label(
    service, trainer, hf_model, restore_checkpoint
):
    held_then_brought_up(service, trainer, hf_model)


@pytest.mark.slow(
    reason="two more restarts (~20 s); by default tests/unit/test_labels.py::"
    "test_once_no_replica_serves_the_live_version_the_checkpoint_is_live proves the pool's "
    "fall-back, and the test above real restarts after the scheme closed"
)
def test_once_both_replicas_restarted_the_checkpoint_is_the_live_version_again(
    service, trainer, hf_model
):
    victim, survivor = held_then_brought_up(service, trainer, hf_model)
    # Once no replica serves the live version (both restarted since the scheme closed),
    # the live label follows what they hold: the checkpoint, under "0".
    kill(service, victim)
    wait_held(service, victim)
    kill(service, survivor)
    wait_until(
        lambda: service.replica_states() == dict.fromkeys((victim, survivor), "ready"),
        RESTART_TIMEOUT,
        interval=0.5,
        what="both replicas serving the checkpoint",
    )
    assert service.weight_version == "0"
    assert_replicas_match(service, hf_model, "0")  # the shared service, as found


def wait_held(service, rid: int) -> None:
    wait_until(
        lambda: service.replica_states().get(rid) == "held",
        RESTART_TIMEOUT,
        interval=0.5,
        what=f"replica {rid} restarted and held",
    )


@pytest.fixture(scope="module")
def mixed_service(tiny_model, ray_cluster):
    svc = launch(tiny_model, allow_mixed_versions=True)
    yield svc
    svc.shutdown()


@pytest.mark.slow(
    reason="a service of its own (~40 s with its restart); by default tests/unit/"
    "test_labels.py::test_mixed_versions_serve_under_the_checkpoints_label_when_allowed "
    "proves the pool's admission, and the held-replica test above that a real restarted "
    "replica is labelled with what it holds and its samples with their version"
)
def test_with_mixed_versions_allowed_each_sample_carries_the_version_that_made_it(
    mixed_service, trainer, hf_model
):
    service = mixed_service
    perturb(trainer, seed=490)
    push_and_close(service, trainer, "pushed-490")
    victim, survivor = service.replica_ids
    wait_restarted(service, victim, kill(service, victim))
    versions = service.weight_versions()
    assert versions == {victim: "0", survivor: "pushed-490"}, versions
    data = service.generate_request_data(PROMPTS, GREEDY, routing="round_robin")
    assert {d.replica_id for d in data} == {victim, survivor}
    models = {"0": hf_model, "pushed-490": trainer}
    for d in data:
        version = d.weight_version_end
        assert d.weight_version_start == version == versions[d.replica_id]
        assert sample_logprob_gap(models[version], d) < 1e-3, "the label names its weights"
        other = trainer if version == "0" else hf_model
        assert sample_logprob_gap(other, d) > 1e-2

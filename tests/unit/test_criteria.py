"""The GPU tier's criteria (torchrl_vllm_ext.testing.criteria), on CPU tensors."""

from __future__ import annotations

import pytest
import torch

from torchrl_vllm_ext.testing.criteria import (
    FRESH_GAP_FACTOR,
    Snapshot,
    assert_can_tell,
    assert_within,
    differing,
    gap_bound,
    max_gap,
)


def test_max_gap_is_the_largest_per_token_difference():
    assert max_gap(torch.tensor([0.0, -1.0, 2.0]), torch.tensor([0.5, -1.0, 1.0])) == 1.0
    assert max_gap(torch.tensor([]), torch.tensor([])) == 0.0
    with pytest.raises(ValueError, match="shapes differ"):
        max_gap(torch.zeros(3), torch.zeros(4))


def test_the_bound_scales_with_the_fresh_gap_and_never_reaches_zero():
    assert gap_bound(0.1325) == pytest.approx(FRESH_GAP_FACTOR * 0.1325)
    assert gap_bound(0.0) > 0  # fp32 kernels that agree exactly still round
    with pytest.raises(ValueError):
        gap_bound(-1.0)
    assert_within(0.177, 0.1325, "one step, as measured on an H200")
    with pytest.raises(AssertionError, match=r"3 x the fresh replica's 0.1325"):
        assert_within(0.5, 0.1325, "stale weights")


def test_a_perturbation_smaller_than_the_bound_cannot_prove_a_push():
    assert_can_tell(2.0, 0.4)
    with pytest.raises(AssertionError, match="cannot see a missed push"):
        assert_can_tell(0.3, 0.4)


def test_differing_compares_bitwise_and_names_the_replicas():
    a = {0: torch.tensor([1.0, 2.0]), 1: torch.tensor([1.0, 2.0])}
    b = {0: a[0].clone(), 1: torch.nextafter(a[1], torch.tensor(3.0))}  # one ulp
    assert differing(a, a) == []
    assert differing(a, b) == [1]
    assert differing(a, {0: a[0]}) == [1], "a replica missing from one reading differs"
    assert differing({0: a[0]}, {0: a[0].double()}) == [0], "a dtype change differs"
    decode = {0: ((3, 4), torch.tensor([-0.5, -0.25]))}
    assert differing(decode, {0: ((3, 4), torch.tensor([-0.5, -0.25]))}) == []
    assert differing(decode, {0: ((3, 5), torch.tensor([-0.5, -0.25]))}) == [0]


def test_a_snapshot_restores_in_place_and_perturbs_from_w0_whatever_ran_before():
    model = torch.nn.Linear(4, 3)
    weight = model.weight  # a colocated push shares these tensors: they must stay the same
    w0 = Snapshot(model)
    original = {k: p.detach().clone() for k, p in model.named_parameters()}
    w0.perturbed(model, seed=1)
    once = {k: p.detach().clone() for k, p in model.named_parameters()}
    assert not torch.equal(once["weight"], original["weight"])
    w0.perturbed(model, seed=2)
    w0.perturbed(model, seed=1)  # not cumulative: seed 1 again is the same W1
    assert all(torch.equal(p, once[k]) for k, p in model.named_parameters())
    w0.restore(model)
    assert all(torch.equal(p, original[k]) for k, p in model.named_parameters())
    assert model.weight is weight

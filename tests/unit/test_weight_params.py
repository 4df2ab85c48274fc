"""Push validation and bucket packing, without vLLM."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from torchrl_vllm_ext.errors import WeightSyncError
from torchrl_vllm_ext.testing import make_tiny_model
from torchrl_vllm_ext.weight_sync.params import checksum, expected_specs, named_tensors, validate
from torchrl_vllm_ext.weight_sync.specs import UpdateHeader, from_json, to_json
from torchrl_vllm_ext.weight_sync.transports.packing import pack, unpack


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("m") / "q", seed=0)
    return path, AutoModelForCausalLM.from_pretrained(path)


def test_module_state_dict_and_tensordict_inputs_agree(tiny):
    from tensordict import TensorDict

    path, model = tiny
    expected = expected_specs(path)
    a = validate(named_tensors(model), expected)
    b = validate(named_tensors(model.state_dict()), expected)
    c = validate(
        named_tensors(TensorDict(dict(model.state_dict()), []).unflatten_keys(".")), expected
    )
    assert list(a) == list(b) == list(c) == list(expected)
    assert "lm_head.weight" not in a, "the tied LM head travels as the embedding"


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda sd: sd.pop("model.norm.weight"), "'model.norm.weight' is missing"),
        (
            lambda sd: sd.__setitem__("model.extra.weight", torch.zeros(2)),
            "'model.extra.weight' is not in the served",
        ),
        (
            lambda sd: sd.__setitem__("model.norm.weight", torch.zeros(7)),
            r"'model.norm.weight' has shape \(7,\)",
        ),
        (
            lambda sd: sd["model.layers.1.mlp.up_proj.weight"].__setitem__((0, 0), float("inf")),
            "contains NaN or inf",
        ),
        (lambda sd: sd.__setitem__("model.norm.weight", "x"), "is a str, not a tensor"),
    ],
)
def test_bad_pushes_name_the_parameter(tiny, mutate, match):
    path, model = tiny
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    mutate(sd)
    with pytest.raises(WeightSyncError, match=match):
        validate(named_tensors(sd), expected_specs(path))


def test_pack_unpack_round_trip_with_mixed_dtypes():
    tensors = {
        "a": torch.randn(100, 10),
        "b": torch.randn(7).to(torch.bfloat16),
        "c": torch.randn(3, 3),
        "d": torch.randn(5).to(torch.bfloat16),
    }
    header, buffers = pack(tensors, "v3", bucket_bytes=4000)
    header = from_json(to_json(header), UpdateHeader)
    assert header.version == "v3" and len(header.buckets) == len(buffers) == 3
    got = {}
    for spec, buf in zip(header.buckets, buffers, strict=True):
        assert checksum(buf) == spec.checksum
        got.update(dict(unpack(spec, buf)))
    assert set(got) == set(tensors)
    for k, t in tensors.items():
        assert got[k].dtype == t.dtype and torch.equal(got[k], t)


def test_checksum_sees_any_change():
    t = torch.randn(1001)
    c = checksum(t)
    t2 = t.clone()
    t2[500] += 1e-3
    assert checksum(t2) != c and checksum(t.clone()) == c


@pytest.mark.parametrize("nbytes", [0, 1, 7, 8, 9, 4096 + 5])
def test_the_checksum_follows_its_definition_and_wraps(nbytes):
    """Buckets are summed where they live (torch), host tensors by numpy: both give the
    definition's value (the storage slots', the trainer's), sums that wrap past 2**64 too."""
    from torchrl_vllm_ext.weight_sync.params import checksum, device_checksums

    g = torch.Generator().manual_seed(nbytes)
    t = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    full = torch.full((1024,), 255, dtype=torch.uint8)  # every word 2**64 - 1: wraps
    bf16 = torch.randn(3, 5, generator=g).to(torch.bfloat16)
    assert device_checksums([t, full, bf16]) == [checksum(x) for x in (t, full, bf16)]
    # The definition: uint64 words, the tail zero-padded, plus the byte count, mod 2**64.
    assert checksum(full) == (128 * (2**64 - 1) + 1024) % 2**64
    assert checksum(torch.tensor([1, 0, 0, 0, 0, 0, 0, 0, 2], dtype=torch.uint8)) == 1 + 2 + 9

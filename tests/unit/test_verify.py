"""The value check's trainer side on a real tiny transformers model (no vLLM): the float32
reference and the rounding noise of the served dtype."""

from __future__ import annotations

import pytest
import torch

from torchrl_vllm_ext.errors import WeightSyncError
from torchrl_vllm_ext.testing import make_tiny_model
from torchrl_vllm_ext.weight_sync.verify import (
    NOISE_MARGIN,
    TOLERANCE,
    model_logprobs,
    plain_causal_lm,
    probe_ids,
    reference,
    served_dtype,
)

from ..helpers import load_trainer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("verify") / "qwen3", arch="qwen3", seed=1)


def test_float32_replicas_get_the_fixed_limit_and_no_second_pass(tiny):
    model = load_trainer(tiny)
    ids = probe_ids(tiny)
    ref = reference(model, ids, "float32")
    assert ref.logprobs == model_logprobs(model, ids)
    assert (ref.noise, ref.limit) == (0.0, TOLERANCE)


def test_a_16_bit_limit_is_a_margin_over_the_rounding_noise_of_these_weights(tiny):
    model = load_trainer(tiny)
    ids = probe_ids(tiny)
    ref = reference(model, ids, "bfloat16")
    assert ref.logprobs == model_logprobs(model, ids)  # the float32 reference
    assert ref.noise > TOLERANCE and ref.limit == NOISE_MARGIN * ref.noise
    assert all(p.dtype == torch.float32 for p in model.parameters())  # model untouched


def test_a_bfloat16_trainer_is_scored_in_float32(tiny):
    model16 = load_trainer(tiny, dtype=torch.bfloat16)
    ids = probe_ids(tiny)
    ref = reference(model16, ids, "bfloat16")
    # Exactly the float32 model holding the same (rounded) weights.
    model32 = load_trainer(tiny)
    with torch.no_grad():
        for p32, p16 in zip(model32.parameters(), model16.parameters(), strict=True):
            p32.copy_(p16)
    assert ref.logprobs == pytest.approx(model_logprobs(model32, ids), abs=1e-6)
    assert ref.noise > 0 and all(p.dtype == torch.bfloat16 for p in model16.parameters())
    assert plain_causal_lm(model16)  # its rotary tables are float32
    assert not plain_causal_lm(load_trainer(tiny).to(torch.bfloat16))  # .to() rounded them


def test_an_unknown_served_dtype_names_the_fix():
    with pytest.raises(WeightSyncError, match=r"'int8'.*verify='never'"):
        served_dtype("int8")

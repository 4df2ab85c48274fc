"""The replica's RequestOutput -> plain data conversion, on vLLM-shaped stand-ins (no vLLM)."""

from dataclasses import dataclass, field

import numpy as np

from torchrl_vllm_ext.engine.replica import _flat_first, to_request_data


@dataclass
class Flat:  # the fields of vllm.logprobs.FlatLogprobs that the conversion reads
    start_indices: list = field(default_factory=list)
    end_indices: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)


@dataclass
class Completion:
    token_ids: list
    logprobs: Flat | None
    finish_reason: str = "length"
    stop_reason: object = None
    text: str = "abc"


@dataclass
class Output:
    prompt_token_ids: list
    prompt_logprobs: Flat | None
    outputs: list


def test_flat_first_takes_the_chosen_token_of_each_position():
    # Position 0 has no entry (first prompt token); positions carry top-k after the chosen one.
    flat = Flat([0, 0, 2], [0, 2, 3], [-1.0, -0.5, -2.0])
    out = _flat_first(flat, 3)
    assert np.isnan(out[0]) and out[1:].tolist() == [-1.0, -2.0]


def test_to_request_data_is_plain_numpy():
    out = Output(
        prompt_token_ids=[4, 5],
        prompt_logprobs=Flat([0, 0], [0, 1], [-3.0]),
        outputs=[Completion([7, 8, 9], Flat([0, 1, 2], [1, 2, 3], [-0.1, -0.2, -0.3]))],
    )
    data = to_request_data(out, replica_id=1, version_start="3", version_end="4")
    assert data.prompt_token_ids.dtype == np.int64
    assert np.isnan(data.prompt_logprobs[0]) and data.prompt_logprobs[1] == -3.0
    s = data.samples[0]
    assert s.token_ids.tolist() == [7, 8, 9]
    np.testing.assert_allclose(s.logprobs, [-0.1, -0.2, -0.3], rtol=1e-6)
    assert (data.replica_id, data.weight_version_start, data.weight_version_end) == (1, "3", "4")

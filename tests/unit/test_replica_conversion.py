"""The replica's RequestOutput -> RequestBatch conversion, on vLLM-shaped stand-ins (no vLLM)."""

from dataclasses import dataclass, field

import numpy as np

from torchrl_vllm_ext.engine.outputs import _chosen_logprobs, pack_outputs


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
    out = _chosen_logprobs(flat, 3)
    assert np.isnan(out[0]) and out[1:].tolist() == [-1.0, -2.0]


def test_pack_outputs_is_plain_numpy():
    out = Output(
        prompt_token_ids=[4, 5],
        prompt_logprobs=Flat([0, 0], [0, 1], [-3.0]),
        outputs=[Completion([7, 8, 9], Flat([0, 1, 2], [1, 2, 3], [-0.1, -0.2, -0.3]))],
    )
    batch = pack_outputs([out], replica_id=1, start="3", end="4")
    assert batch.token_ids.dtype == np.int64 and batch.logprobs.dtype == np.float32
    (data,) = batch.unpack()
    assert data.prompt_token_ids.dtype == np.int64
    assert np.isnan(data.prompt_logprobs[0]) and data.prompt_logprobs[1] == -3.0
    s = data.samples[0]
    assert s.token_ids.tolist() == [7, 8, 9]
    np.testing.assert_allclose(s.logprobs, [-0.1, -0.2, -0.3], rtol=1e-6)
    assert (data.replica_id, data.weight_version_start, data.weight_version_end) == (1, "3", "4")


def test_pack_outputs_of_several_requests_and_samples():
    outs = [
        Output([1, 2, 3], None, [Completion([4], Flat([0], [1], [-0.4])), Completion([], None)]),
        Output([5], None, [Completion([6, 7], None, finish_reason="stop", text="x")]),
    ]
    batch = pack_outputs(outs, replica_id=2, start="1", end="1")
    assert batch.samples_per_request.tolist() == [2, 1]
    assert batch.sample_lengths.tolist() == [1, 0, 2]
    assert batch.has_logprobs.tolist() == [True, False, False]
    assert not batch.has_prompt_logprobs.any()
    assert batch.finish_reasons == ["length", "length", "stop"]
    assert batch.replica_ids.tolist() == [2, 2] and batch.versions_end == ["1", "1"]

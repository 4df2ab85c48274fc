"""RequestBatch: results in flat arrays, unpacked to the same RequestData, merged in input order."""

import numpy as np

from torchrl_vllm_ext.batches import RequestBatch
from torchrl_vllm_ext.messages import RequestData, SampleData


def sample(ids, lps=True, reason="length"):
    ids = np.asarray(ids, dtype=np.int64)
    lp = -np.arange(1, ids.size + 1, dtype=np.float32) if lps else None
    return SampleData(token_ids=ids, logprobs=lp, finish_reason=reason, stop_reason=None, text="t")


def request(prompt, samples, prompt_lp, replica=1, start="3", end="4"):
    prompt = np.asarray(prompt, dtype=np.int64)
    plp = None
    if prompt_lp:
        plp = -np.arange(prompt.size, dtype=np.float32)
        plp[0] = np.nan
    return RequestData(prompt, plp, samples, replica, start, end)


def test_pack_unpack_round_trip_with_missing_logprobs_and_empty_samples():
    data = [
        request([1, 2, 3], [sample([4, 5]), sample([], reason="abort")], prompt_lp=True),
        request([6], [sample([7, 8, 9], lps=False, reason="stop")], prompt_lp=False),
    ]
    batch = RequestBatch.from_requests(data)
    assert batch.token_ids.tolist() == [4, 5, 7, 8, 9] and batch.prompt_lengths.tolist() == [3, 1]
    back = batch.unpack()
    assert len(back) == 2
    for a, b in zip(data, back, strict=True):
        np.testing.assert_array_equal(a.prompt_token_ids, b.prompt_token_ids)
        if a.prompt_logprobs is None:
            assert b.prompt_logprobs is None
        else:
            np.testing.assert_array_equal(a.prompt_logprobs, b.prompt_logprobs)
        assert (a.replica_id, a.weight_version_start, a.weight_version_end) == (
            b.replica_id,
            b.weight_version_start,
            b.weight_version_end,
        )
        assert len(a.samples) == len(b.samples)
        for s, t in zip(a.samples, b.samples, strict=True):
            np.testing.assert_array_equal(s.token_ids, t.token_ids)
            assert t.token_ids.dtype == np.int64
            assert (s.finish_reason, s.stop_reason, s.text) == (
                t.finish_reason,
                t.stop_reason,
                t.text,
            )
            if s.logprobs is None:
                assert t.logprobs is None
            else:
                np.testing.assert_array_equal(s.logprobs, t.logprobs)


def test_empty_batch():
    assert RequestBatch.from_requests([]).unpack() == []


def test_merge_puts_the_replicas_parts_back_in_input_order():
    def req(i, replica):
        n = 1 + i % 3  # samples of different counts and lengths
        samples = [sample(list(range(i, i + k + 1)), lps=bool(k % 2)) for k in range(n)]
        return request(
            [i] * (1 + i % 2),
            samples,
            prompt_lp=i % 2 == 0,
            replica=replica,
            start=f"s{i}",
            end=f"e{i}",
        )

    data = [req(i, replica=i % 2) for i in range(7)]
    parts = [
        ([1, 3, 5], RequestBatch.from_requests([data[i] for i in (1, 3, 5)])),
        ([0, 2, 4, 6], RequestBatch.from_requests([data[i] for i in (0, 2, 4, 6)])),
    ]
    merged = RequestBatch.merge(parts, 7).unpack()
    expected = RequestBatch.from_requests(data).unpack()
    for a, b in zip(expected, merged, strict=True):
        np.testing.assert_array_equal(a.prompt_token_ids, b.prompt_token_ids)
        assert (a.replica_id, a.weight_version_start, a.weight_version_end) == (
            b.replica_id,
            b.weight_version_start,
            b.weight_version_end,
        )
        assert [s.token_ids.tolist() for s in a.samples] == [
            s.token_ids.tolist() for s in b.samples
        ]
        assert [s.logprobs is None for s in a.samples] == [s.logprobs is None for s in b.samples]
        if a.prompt_logprobs is not None:
            np.testing.assert_array_equal(a.prompt_logprobs, b.prompt_logprobs)

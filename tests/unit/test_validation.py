import numpy as np
import pytest
import torch

from torchrl_vllm_ext.engine.validation import check_prompts, normalize_prompts
from torchrl_vllm_ext.errors import InvalidRequestError


def test_normalize_accepts_lists_arrays_and_tensors():
    out = normalize_prompts([[1, 2], np.array([3], dtype=np.int32), torch.tensor([4, 5])])
    assert [p.tolist() for p in out] == [[1, 2], [3], [4, 5]]
    assert all(p.dtype == np.int64 for p in out)


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ("hello", "list of token-id sequences"),
        (np.zeros((2, 3), dtype=np.int64), "2-D array"),
        (["hello"], "prompt 0 is a string"),
        ([[1.5, 2.0]], "dtype float64"),
        ([[[1, 2]]], "shape"),
    ],
)
def test_normalize_rejects_bad_shapes_and_types(bad, match):
    with pytest.raises(InvalidRequestError, match=match):
        normalize_prompts(bad)


@pytest.mark.parametrize(
    ("prompts", "match"),
    [
        ([], "batch is empty"),
        ([[1], []], "prompt 1 is empty"),
        ([[1, 600]], "token id 600, outside the vocabulary \\[0, 511\\]"),
        ([[-1, 2]], "token id -1"),
        ([list(range(10))], "10 tokens but max_model_len is 10"),
    ],
)
def test_check_prompts_names_the_value_and_the_fix(prompts, match):
    with pytest.raises(InvalidRequestError, match=match):
        check_prompts(normalize_prompts(prompts), max_token_id=511, max_model_len=10)


def test_check_prompts_accepts_valid_batch():
    check_prompts(normalize_prompts([[0, 511], list(range(9))]), max_token_id=511, max_model_len=10)

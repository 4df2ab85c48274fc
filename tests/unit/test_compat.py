"""_compat's copies of vLLM names agree with the installed vLLM."""

from typing import get_args

from torchrl_vllm_ext import _compat


def test_pause_modes_are_vllms():
    from vllm.v1.engine import PauseMode

    assert _compat.PAUSE_MODES == get_args(PauseMode)


def test_sampling_param_fields_include_the_usual_ones():
    fields = _compat.sampling_param_fields()
    assert {"max_tokens", "temperature", "n", "seed", "logprobs"} <= set(fields)

"""Bad input gets a typed error naming the value and the fix; the service keeps serving."""

from __future__ import annotations

import pytest

from torchrl_vllm_ext import (
    ConfigurationError,
    InsufficientResourcesError,
    InvalidRequestError,
    UnknownRoutingStrategyError,
    VLLMService,
)

OK = {"max_tokens": 2, "ignore_eos": True}  # exactly 2 tokens, even if EOS is drawn

CASES = [
    ("empty prompt", [[1, 2], []], OK, {}, InvalidRequestError, "prompt 1 is empty"),
    ("token outside vocabulary", [[1, 99999]], OK, {}, InvalidRequestError, "token id 99999"),
    ("negative token id", [[-5, 1]], OK, {}, InvalidRequestError, "token id -5"),
    (
        "prompt too long",
        [[1] * 300],
        OK,
        {},
        InvalidRequestError,
        "300 tokens but max_model_len is 256",
    ),
    ("negative max_tokens", [[1, 2]], {"max_tokens": -3}, {}, InvalidRequestError, "max_tokens=-3"),
    ("zero samples", [[1, 2]], {"max_tokens": 2, "n": 0}, {}, InvalidRequestError, "n=0"),
    (
        "unknown sampling field",
        [[1, 2]],
        {"max_tokens": 2, "temprature": 1.0},
        {},
        InvalidRequestError,
        "temprature",
    ),
    (
        "a dict prompt with both forms",
        [{"prompt": "a", "prompt_token_ids": [1]}],
        OK,
        {},
        InvalidRequestError,
        "with one of them",
    ),
    ("float ids", [[1.0, 2.0]], OK, {}, InvalidRequestError, "must be integers"),
    (
        "params per prompt mismatch",
        [[1], [2]],
        [OK],
        {},
        InvalidRequestError,
        "1 sampling params for 2 prompts",
    ),
    (
        "unknown routing",
        [[1, 2]],
        OK,
        {"routing": "fastest"},
        UnknownRoutingStrategyError,
        "'fastest'",
    ),
]


@pytest.mark.parametrize(
    ("name", "prompts", "params", "kwargs", "error", "match"), CASES, ids=[c[0] for c in CASES]
)
def test_bad_request_is_rejected_and_service_keeps_serving(
    service, name, prompts, params, kwargs, error, match
):
    with pytest.raises(error, match=match):
        service.generate(prompts, params, **kwargs)
    out = service.generate([[1, 2, 3]], OK)
    assert len(out[0].outputs[0].token_ids) == 2


def test_more_replicas_than_resources(service, tiny_model):
    with pytest.raises(InsufficientResourcesError, match="cpus_per_replica"):
        service.add_replicas(100)
    with pytest.raises(InsufficientResourcesError, match="100 more replica"):
        VLLMService.launch(tiny_model, num_replicas=100, cpus_per_replica=0.5)
    with pytest.raises(InsufficientResourcesError, match="custom resource 'rollout'"):
        VLLMService.launch(tiny_model, cpus_per_replica=0.5, replica_resources={"rollout": 1})
    assert service.num_replicas == 2
    assert len(service.generate([[1, 2]], OK)) == 1


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_replicas": 0}, "num_replicas=0"),
        ({"tensor_parallel_size": -1}, "tensor_parallel_size=-1"),
        ({"cpus_per_replica": 0}, "cpus_per_replica=0"),
        ({"routing": ["nope"]}, "'nope'"),
        ({"placement": "scatter"}, "placement='scatter'"),
        ({"gpus_per_replica": 1.5}, "gpus_per_replica=1.5"),
        ({"replica_resources": {"rollout": 0}}, r"replica_resources\['rollout'\]"),
    ],
)
def test_bad_launch_arguments(tiny_model, kwargs, match):
    with pytest.raises(ConfigurationError, match=match):
        VLLMService.launch(tiny_model, **kwargs)


def test_model_path_must_be_a_local_directory(tmp_path):
    with pytest.raises(ConfigurationError, match="not a local directory"):
        VLLMService.launch(tmp_path / "missing")


def test_sleep_on_cpu_replicas_is_refused_with_the_reason(service):
    with pytest.raises(ConfigurationError, match="enable_sleep_mode"):
        service.sleep(level=1)
    with pytest.raises(ConfigurationError, match="level must be 1 or 2"):
        service.sleep(level=3)
    with pytest.raises(ConfigurationError, match="'weights', 'kv_cache'"):
        service.wake_up(["everything"])
    assert not any(service.is_sleeping().values())
    assert len(service.generate([[1, 2]], OK)) == 1

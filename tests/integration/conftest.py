"""Shared engines: starting vLLM costs ~20 s per replica, so tests share one service."""

from __future__ import annotations

import pytest
import torch

from torchrl_vllm_ext import VLLMService

# Small and exact: fp32 so replica log-probs can be compared with transformers'.
ENGINE_KWARGS = {
    "dtype": "float32",
    "max_model_len": 256,
    "enforce_eager": True,
    "kv_cache_memory_bytes": 64 << 20,
}
CPUS_PER_REPLICA = 0.5


# Package scope: the engines are gone before tests/reliability launches its own.
@pytest.fixture(scope="package")
def service(tiny_model, ray_cluster):
    svc = VLLMService.launch(
        tiny_model,
        num_replicas=2,
        cpus_per_replica=CPUS_PER_REPLICA,
        health_check_interval=2.0,
        **ENGINE_KWARGS,
    )
    yield svc
    svc.shutdown()


@pytest.fixture(scope="session")
def hf_model(tiny_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    return model.eval()


def hf_token_logprobs(model, ids: list[int]) -> torch.Tensor:
    """Log-prob the transformers model gives each of ``ids[1:]`` after the tokens before it."""
    x = torch.tensor([ids])
    with torch.no_grad():
        logits = model(x).logits.float()
    logp = torch.log_softmax(logits[0, :-1], dim=-1)
    return logp.gather(-1, x[0, 1:, None])[:, 0]


def grpo_backward(model, tokenizer, data, pad_output: bool) -> None:
    """TorchRL's GRPOLoss with a transformers actor on ``data`` (which carries "advantage"):
    loss and backward; the engine held the trainer's exact fp32 weights, so importance
    weights are 1 (ESS 1, KL 0) and the gradients are finite."""
    from torchrl.modules.llm import TransformersWrapper
    from torchrl.objectives.llm import GRPOLoss

    actor = TransformersWrapper(
        model, tokenizer=tokenizer, input_mode="tokens", generate=False, pad_output=pad_output
    )
    loss_fn = GRPOLoss(actor, masking_strategy="sft")
    model.zero_grad()
    out = loss_fn(data)
    out.loss_objective.backward()
    assert abs(float(out.ESS) - 1.0) < 1e-3 and abs(float(out.kl_approx)) < 1e-3
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    model.zero_grad()


SEQUENCE = list(range(5, 45))  # the fixed sequence the exactness checks score


def replica_logprobs(service, ids=SEQUENCE) -> dict[int, tuple[torch.Tensor, str]]:
    """Score ``ids`` on every replica; {replica_id: (log-probs of ids[1:], weight version)}."""
    n = service.num_replicas
    data = service.generate_batch(
        [ids] * n, {"max_tokens": 1, "prompt_logprobs": 0}, routing="round_robin"
    )
    assert {d.replica_id for d in data} == set(service.replica_ids)
    return {d.replica_id: (torch.tensor(d.prompt_logprobs[1:]), d.weight_version_end) for d in data}


def perturb(model, seed: int) -> None:
    """Add seeded noise to every parameter (a stand-in for a training step)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


def assert_replicas_match(service, model, version: str, tol: float = 1e-4) -> float:
    """Every replica serves ``version`` and its log-probs equal ``model``'s; returns the worst gap."""
    ref = hf_token_logprobs(model, SEQUENCE)
    worst = 0.0
    for rid, (got, served) in replica_logprobs(service).items():
        assert served == version, f"replica {rid} serves version {served}, expected {version}"
        gap = (got - ref).abs().max().item()
        assert gap < tol, f"replica {rid}: max |replica - trainer| log-prob = {gap:.2e}"
        worst = max(worst, gap)
    assert set(service.weight_versions().values()) == {version}
    return worst


def wait_until(predicate, timeout: float, interval: float = 0.05, what: str = "condition"):
    """Poll ``predicate`` until it returns a truthy value; fail the test after ``timeout``."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")

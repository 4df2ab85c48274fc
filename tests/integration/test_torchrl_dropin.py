"""TorchRL's own engine seams take our objects: ``vLLMWrapper(service)`` generates through
the service, ``vLLMUpdaterV2(service)`` and TorchRL's collectors push through our verified
scheme, a ``TransformersWrapper`` and a PEFT model are pushed as what they compute, and
``service.generate`` takes every prompt form ``vllm.LLM.generate`` takes. Shipped into Ray
processes (TorchRL's ``RayLLMCollector``, Ray tasks), the service is a handle to the same
replicas: same tokens and log-probs, the owner's versions and deaths, pushes forwarded.

The package's shared service (two replicas), which gets the checkpoint back at version "0"
at the module's end (``restore_checkpoint``: the module pushes into it).
"""

from __future__ import annotations

import copy
import functools
import pickle

import pytest
import ray
import torch
from tensordict import TensorDict, lazy_stack
from torchrl.collectors import Collector
from torchrl.collectors.llm import LLMCollector, RayLLMCollector, vLLMUpdaterV2
from torchrl.data.llm import History
from torchrl.modules.llm import TransformersWrapper, vLLMWrapper
from torchrl.modules.llm.backends.vllm import RLvLLMEngine
from torchrl.modules.llm.policies import ChatHistory
from torchrl.weight_update import WeightSyncScheme as TorchRLWeightSyncScheme
from vllm import SamplingParams
from vllm.inputs import TextPrompt, TokensPrompt

from torchrl_vllm_ext import (
    ServiceSyncScheme,
    TokenCountEnv,
    VLLMPolicy,
    WeightSyncError,
    WeightSyncScheme,
    WeightSyncUpdater,
)

from ..helpers import (
    assert_replicas_match,
    hf_token_logprobs,
    make_adapter,
    perturb,
    wait_ready,
    wait_until,
)

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)
CHATS = [[{"role": "user", "content": "hello"}], [{"role": "user", "content": "red green blue"}]]


@pytest.fixture(scope="module")
def engine(service, restore_checkpoint):
    return service


@pytest.fixture(scope="module")
def tokenizer(engine):
    return engine.get_tokenizer()


def chat_td() -> TensorDict:
    return lazy_stack(
        [TensorDict({"history": ChatHistory(prompt=History.from_chats([c])[0])}) for c in CHATS]
    )


def tokens_of(outputs) -> list[tuple[list[int], list[int]]]:
    return [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in outputs]


def test_generate_takes_every_vllm_prompt_form(engine, tokenizer):
    ids = [tokenizer("one two three")["input_ids"], tokenizer("red")["input_ids"]]
    by_ids = tokens_of(engine.generate(ids, GREEDY))
    forms = {
        "one string": ("one two three", by_ids[:1]),
        "strings": (["one two three", "red"], by_ids),
        "one token list": (ids[0], by_ids[:1]),
        "token lists": (ids, by_ids),
        "TokensPrompt": (TokensPrompt(prompt_token_ids=ids[1]), by_ids[1:]),
        "TextPrompt": (TextPrompt(prompt="red"), by_ids[1:]),
        "mixed dicts and strings": (
            [{"prompt": "one two three"}, {"prompt_token_ids": ids[1]}],
            by_ids,
        ),
        "1-D tensor": (torch.tensor(ids[0]), by_ids[:1]),
    }
    for name, (prompts, expected) in forms.items():
        outs = engine.generate(prompts, GREEDY)
        assert tokens_of(outs) == expected, name
    texts = [o.prompt for o in engine.generate(["one two three", ids[1]], GREEDY)]
    assert texts == ["one two three", None]  # as vLLM: the text of text prompts only
    # One SamplingParams per prompt, in order; vLLM's default log-prob form (dicts).
    outs = engine.generate(
        ["red", "one"], [SamplingParams(max_tokens=2), SamplingParams(max_tokens=3)]
    )
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 3]
    sample = outs[1].outputs[0]
    assert isinstance(sample.logprobs[0], dict)
    assert set(sample.logprobs[0]) == {sample.token_ids[0]}
    flat = engine.generate("red", SamplingParams(max_tokens=2, flat_logprobs=True))
    assert type(flat[0].outputs[0].logprobs).__name__ == "FlatLogprobs"
    # Ray-actor style, as TorchRL calls a Ray engine.
    ref = engine.generate.remote(ids, GREEDY)
    assert isinstance(ref, ray.ObjectRef) and tokens_of(ray.get(ref)) == by_ids


def test_torchrl_vllm_wrapper_generates_through_the_service(engine, tokenizer, hf_model):
    assert isinstance(engine, RLvLLMEngine)
    wrapper = vLLMWrapper(engine, input_mode="history", generate_kwargs={"max_tokens": 6})
    out = wrapper(chat_td())
    full = out.get(("tokens", "full"), as_list=True)
    response = out.get(("log_probs", "response"), as_list=True)
    for ids, lps in zip(full, response, strict=True):
        expected = hf_token_logprobs(hf_model, ids.tolist())[-len(lps) :]
        torch.testing.assert_close(lps.float(), expected, atol=1e-4, rtol=0)
    # GRPO groups: n samples per prompt in one request.
    grouped = vLLMWrapper(
        engine, input_mode="tokens", num_samples=3, generate_kwargs={"max_tokens": 3}
    )(TensorDict({("tokens", "prompt"): torch.tensor([[5, 6, 7]])}, batch_size=[1]))
    assert grouped.batch_size == (1, 3)
    assert grouped.get(("tokens", "response"), as_padded_tensor=True).shape == (1, 3, 3)
    # Scoring (TorchRL's reference / old-policy log-probs: vLLM's prompt log-probs).
    scorer = vLLMWrapper(engine, input_mode="tokens", generate=False)
    ids = full[0].tolist()
    scored = scorer(TensorDict({("tokens", "full"): torch.tensor([ids])}, batch_size=[1]))
    got = scored.get(("log_probs", "full"), as_list=True)[0]
    torch.testing.assert_close(got[1:].float(), hf_token_logprobs(hf_model, ids), atol=1e-4, rtol=0)
    # Our policy with TorchRL's defaults (history, the service's tokenizer): same keys.
    ours = VLLMPolicy(engine, generate_kwargs={"max_tokens": 6})(chat_td())
    assert set(ours.keys(True, True)) >= set(out.keys(True, True)) - {("text", "full")}


def test_vllm_updater_v2_pushes_through_the_scheme(engine, tokenizer, trainer):
    env = TokenCountEnv(batch_size=(2,), prompt_len=4, answer_len=4, seed=0)
    updater = vLLMUpdaterV2(engine)
    collector = LLMCollector(
        env,
        policy=VLLMPolicy(engine, input_mode="tokens", sampling_params={"max_tokens": 4}),
        dialog_turns_per_batch=2,
        weight_updater=updater,
    )
    updater.init()
    assert engine.get_master_address() and isinstance(engine.get_master_port(), int)
    assert "model.embed_tokens.weight" in engine.get_model_metadata()
    next(iter(collector))
    for seed, pushed in enumerate(
        [
            # NOTE: not collector.update_policy_weights_(): in torchrl 0.14.1 the collector
            # calls updater.push_weights(policy_or_weights=...), which vLLMUpdaterV2's own
            # push_weights(weights) refuses (a TypeError in TorchRL, whatever the engine).
            lambda: updater.push_weights_from_transformers(
                TransformersWrapper(trainer, tokenizer=tokenizer, generate=False)
            ),
            # TorchRL's updater sends model.model of a bare transformers model: the
            # decoder without its prefix (this tied model has no separate LM head).
            lambda: updater.push_weights_from_transformers(trainer),
            lambda: updater.push_weights(TensorDict(trainer.state_dict(), [])),
        ]
    ):
        perturb(trainer, seed=20 + seed)
        before = int(engine.weight_version)
        pushed()
        gap = assert_replicas_match(engine, trainer, str(before + 1))
        if seed == 0:  # the scheme's first push is verified by value
            assert engine._torchrl.updates.last_report.probe_gap
        print(f"vLLMUpdaterV2 push {seed}: max |replica - trainer| {gap:.2e}")
    collector.shutdown()


def test_scheme_pushes_a_transformers_wrapper_and_a_peft_model(
    engine, tokenizer, trainer, tmp_path
):
    scheme = WeightSyncScheme(engine, verify="always")
    try:
        perturb(trainer, seed=30)
        wrapper = TransformersWrapper(trainer, tokenizer=tokenizer, generate=False)
        scheme.push(wrapper, version="wrapper")
        assert_replicas_match(engine, trainer, "wrapper")
        lora = make_adapter(engine.config.model, tmp_path / "lora", seed=3)
        names = [n for n, _ in lora.named_parameters()]
        report = scheme.push(TransformersWrapper(lora, tokenizer=tokenizer), version="peft")
        assert [n for n, _ in lora.named_parameters()] == names, "the PEFT model was changed"
        assert report.probe_gap and max(report.probe_gap.values()) < 1e-4
        assert_replicas_match(engine, lora, "peft")  # the merged model's log-probs
        # Through TorchRL's collector (our updater) too.
        env = TokenCountEnv(batch_size=(2,), prompt_len=4, answer_len=4, seed=0)
        collector = LLMCollector(
            env,
            policy=VLLMPolicy(engine, input_mode="tokens", sampling_params={"max_tokens": 4}),
            dialog_turns_per_batch=2,
            weight_updater=WeightSyncUpdater(scheme),
            track_policy_version=True,
        )
        next(iter(collector))
        perturb(lora, seed=31)
        collector.update_policy_weights_(TransformersWrapper(lora, tokenizer=tokenizer))
        assert_replicas_match(engine, lora, "1")
        collector.shutdown()
        # What cannot be pushed is named.
        with pytest.raises(WeightSyncError, match="cannot push a vLLMWrapper"):
            scheme.push(vLLMWrapper(engine, input_mode="history"), version="x")
    finally:
        scheme.close()


def test_scheme_is_torchrl_weight_sync_scheme_for_collectors(engine, trainer):
    """TorchRL's Collector(weight_sync_schemes=...): init_on_sender, connect, send."""
    scheme = WeightSyncScheme(engine, verify="always")
    assert isinstance(scheme, TorchRLWeightSyncScheme)
    env = TokenCountEnv(batch_size=(2,), prompt_len=4, answer_len=4, seed=0)
    policy = VLLMPolicy(
        engine, input_mode="tokens", pad_output=True, sampling_params={"max_tokens": 4}
    )
    collector = Collector(
        env,
        policy,
        frames_per_batch=2,
        total_frames=4,
        weight_sync_schemes={"policy": scheme},
        track_policy_version=True,
        trust_policy=True,
    )
    try:
        model = copy.deepcopy(trainer)
        for step, batch in enumerate(collector):
            assert batch.numel() == 2
            perturb(model, seed=40 + step)
            collector.update_policy_weights_(model)
            assert collector.policy_version == step + 1
            assert_replicas_match(engine, model, str(step + 1))
    finally:
        collector.shutdown()
        scheme.close()


@ray.remote(num_cpus=0.1)
def _run_policy(policy, td):
    """A Ray-remote consumer of a policy (the service crosses inside it)."""
    out = policy(td)
    svc = policy.model if hasattr(policy, "model") else policy.service
    return out, svc.is_owner, svc.weight_version


@ray.remote(num_cpus=0.1)
class _HandleHolder:
    def __init__(self, service):
        self.service = service

    def call(self, method, *args):
        return getattr(self.service, method)(*args)

    def generate(self, ids):
        out = self.service.generate([ids], GREEDY)[0].outputs[0]
        return list(out.token_ids)


@ray.remote(num_cpus=0.1)
def _grpo_push(policy, collector, model) -> str:
    """grpo-sync.py's weight sync in its train actor, with ServiceSyncScheme in place of
    TorchRL's VLLMWeightSyncScheme."""
    engine = policy.model
    sender = ServiceSyncScheme(engine).create_sender()
    sender.register_model(model)
    sender.init_all_workers_group({}, vllm_engine=engine)
    sender.register_collector(collector)
    sender.update_weights()
    return engine.weight_version


def _rows(td) -> list:
    """Every element of ``td``, whatever its batch dims."""
    return [r for t in td.unbind(0) for r in (_rows(t) if t.batch_dims else [t])]


def _token_td(ids) -> TensorDict:
    return TensorDict({("tokens", "prompt"): torch.tensor([ids])}, batch_size=[1])


def test_torchrl_v1_updater_calls_are_refused_by_the_service_and_its_replicas(engine):
    # TorchRL's vLLMUpdater (V1) joins vLLM's workers to its NCCL group through these calls
    # (tests/unit/test_torchrl_v1_refusal.py drives the updater itself).
    fix = r"vLLMUpdaterV2\(service\)"
    args = ("localhost", 29500, 1, 2)
    with pytest.raises(WeightSyncError, match=f"service .*init_weight_update_group.*{fix}"):
        engine.collective_rpc.remote("init_weight_update_group", args=args)
    actor = engine.actors[0]
    with pytest.raises(WeightSyncError, match=f"replica 0: .*init_weight_update_group.*{fix}"):
        ray.get(actor.collective_rpc.remote("init_weight_update_group", args), timeout=60)
    assert ray.get(actor.get_weight_version.remote()) == engine.weight_version  # still serving


def test_service_pickles_into_ray_processes_as_a_handle(engine, tokenizer):
    assert engine.is_owner and len(pickle.dumps(engine)) < 20_000
    assert engine.get_master_port() > 0 and len(engine.actors) == engine.num_replicas
    assert ray.get(engine.actors[0].get_tokenizer.remote()).eos_token == tokenizer.eos_token
    ids = tokenizer("one two three")["input_ids"]
    kwargs = {"input_mode": "tokens", "generate_kwargs": {"max_tokens": 5, "temperature": 0.0}}
    for policy in (vLLMWrapper(engine, **kwargs), VLLMPolicy(engine, **kwargs)):
        here = policy(_token_td(ids))
        there, owner, version = ray.get(_run_policy.remote(policy, _token_td(ids)))
        assert not owner and version == engine.weight_version
        for key in (("tokens", "response"), ("log_probs", "response")):
            assert torch.equal(there.get(key, as_list=True)[0], here.get(key, as_list=True)[0])
    holder = _HandleHolder.remote(engine)
    try:
        # Owner-only calls are forwarded; the owner's version is what every handle sees.
        before = engine.weight_version
        ray.get(holder.call.remote("set_weight_version", "handle-label"))
        assert engine.weight_version == "handle-label"
        assert ray.get(holder.call.remote("weight_versions")) == dict.fromkeys(
            engine.replica_ids, "handle-label"
        )
        engine.set_weight_version(before)
        wait_until(
            lambda: (
                ray.get(holder.call.remote("weight_versions"))
                == dict.fromkeys(engine.replica_ids, before)
            ),
            10,
        )
        # Deaths a handle meets (every replica): its batch waits for the owner's restart
        # and succeeds; the owner's pool recorded each death once and every side sees it.
        deaths, killed = len(engine.deaths()), len(engine.actors)
        for actor in engine.actors:
            ray.kill(actor, no_restart=True)
        after = ray.get(holder.generate.remote(ids))
        wait_ready(engine, killed)
        assert len(engine.deaths()) == deaths + killed
        wait_until(lambda: len(ray.get(holder.call.remote("deaths"))) == deaths + killed, 10)
        # Closing a handle stops nothing: the owner serves the same (restarted) replicas.
        ray.get(holder.call.remote("shutdown"))
        assert list(engine.generate([ids], GREEDY)[0].outputs[0].token_ids) == after
    finally:
        ray.kill(holder)


def test_ray_llm_collector_ships_the_service(engine, tokenizer, trainer):
    """TorchRL's RayLLMCollector with vLLMWrapper(service) and our updater inside its Ray
    actor: it collects, and a push through it is served at its version."""
    scheme = WeightSyncScheme(engine, verify="always")
    collector = RayLLMCollector(
        functools.partial(TokenCountEnv, batch_size=(2,), prompt_len=4, answer_len=4, seed=0),
        policy=vLLMWrapper(engine, input_mode="tokens", generate_kwargs={"max_tokens": 4}),
        dialog_turns_per_batch=2,
        weight_updater=WeightSyncUpdater(scheme),
        track_policy_version=True,
        remote_config={"num_cpus": 0.1},
    )
    try:
        assert collector.next().numel() == 2
        perturb(trainer, seed=50)
        collector.update_policy_weights_(trainer)
        assert collector.policy_version == 1
        assert engine.weight_version == scheme.version == "1"
        assert_replicas_match(engine, trainer, "1")
        rows = _rows(collector.next())
        assert len(rows) == 2
        for row in rows:
            ids, lps = row.get(("tokens", "full")), row.get(("log_probs", "response"))
            expected = hf_token_logprobs(trainer, ids.tolist())[-len(lps) :]
            torch.testing.assert_close(lps.float(), expected, atol=1e-4, rtol=0)
        # TorchRL's sota GRPO push, from its Ray-remote train loop: a sender over the
        # service (handle) with the collector registered.
        perturb(trainer, seed=51)
        policy = vLLMWrapper(engine, input_mode="tokens")
        assert ray.get(_grpo_push.remote(policy, collector, trainer)) == "2"
        assert collector.policy_version == 2 and engine.weight_version == "2"
        assert_replicas_match(engine, trainer, "2")
    finally:
        collector.shutdown()
        scheme.close()

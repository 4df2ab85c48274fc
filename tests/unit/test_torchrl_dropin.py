"""The drop-in's logic without vLLM: prompt forms, push sources (TorchRL wrappers, PEFT
merged apart), versions, the engine's update iterator, and the two ABC registrations."""

from __future__ import annotations

import copy

import peft
import pytest
import torch
from torchrl.modules.llm import TransformersWrapper

from torchrl_vllm_ext import InvalidRequestError, VLLMPolicy, WeightSyncError, WeightSyncScheme
from torchrl_vllm_ext.engine.driver.prompt_forms import encode_texts, parse_prompts
from torchrl_vllm_ext.engine.driver.service import VLLMService
from torchrl_vllm_ext.engine.driver.torchrl_engine import (
    from_pretrained_kwargs,
    lora_name,
    register_engine,
)
from torchrl_vllm_ext.errors import ConfigurationError
from torchrl_vllm_ext.weight_sync.sources import (
    adapter_source,
    full_push_source,
    merged_lora_state,
)
from torchrl_vllm_ext.weight_sync.torchrl.engine_updates import collect, decoder_names_to_checkpoint
from torchrl_vllm_ext.weight_sync.torchrl.pushes import TorchRLPushes, next_version, tracked_version

from ..helpers import FakeService


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from torchrl_vllm_ext.hf import load_tokenizer

    return load_tokenizer(tiny_model)


def encode(texts):
    return [[ord(c) for c in t] for t in texts]


@pytest.mark.parametrize(
    ("prompts", "ids", "texts"),
    [
        ("ab", [[97, 98]], ["ab"]),
        (["ab", "c"], [[97, 98], [99]], ["ab", "c"]),
        ([5, 6], [[5, 6]], [None]),
        ([[5, 6], [7]], [[5, 6], [7]], [None, None]),
        ({"prompt_token_ids": [5]}, [[5]], [None]),
        ({"prompt": "c"}, [[99]], ["c"]),
        ([{"prompt": "c"}, {"prompt_token_ids": [1]}, "d"], [[99], [1], [100]], ["c", None, "d"]),
        (torch.tensor([3, 4]), [[3, 4]], [None]),
    ],
)
def test_every_vllm_prompt_form_parses(prompts, ids, texts):
    parsed = parse_prompts(prompts, encode)
    assert [list(map(int, p)) for p in parsed.token_ids] == ids
    assert parsed.texts == texts


@pytest.mark.parametrize(
    ("prompts", "match"),
    [
        ({"prompt": "a", "multi_modal_data": {}}, r"\['multi_modal_data'\] are not served"),
        ({"prompt_embeds": torch.zeros(2, 4)}, "prompt_embeds"),
        ({"prompt": "a", "prompt_token_ids": [1]}, "with one of them"),
        (torch.zeros(2, 3, dtype=torch.long), "2-D array"),
        (42, "got int"),
        (b"bytes", "got bytes"),
    ],
)
def test_unserved_prompt_forms_are_named(prompts, match):
    with pytest.raises(InvalidRequestError, match=match):
        parse_prompts(prompts, encode)


def test_encode_texts_adds_special_tokens_like_vllm(tokenizer):
    ids = encode_texts(tokenizer, ["hello world"])[0]
    assert ids == tokenizer("hello world", add_special_tokens=True)["input_ids"]
    off = encode_texts(tokenizer, ["hello world"], {"add_special_tokens": False})[0]
    assert off == tokenizer("hello world", add_special_tokens=False)["input_ids"]


def test_lora_request_names_the_adapter():
    from vllm.lora.request import LoRARequest

    request = LoRARequest("policy", 1, "/nowhere")
    assert lora_name(None, request) == "policy" == lora_name(None, [request, request])
    with pytest.raises(InvalidRequestError, match="disagree"):
        lora_name("other", request)
    with pytest.raises(InvalidRequestError, match="2 adapters"):
        lora_name(None, [request, LoRARequest("b", 2, "/nowhere")])


def test_service_and_scheme_pass_torchrl_isinstance_checks():
    from torchrl.modules.llm.backends.vllm import RLvLLMEngine
    from torchrl.weight_update import WeightSyncScheme as TorchRLScheme

    assert register_engine(VLLMService)
    assert issubclass(VLLMService, RLvLLMEngine)
    assert issubclass(WeightSyncScheme, TorchRLScheme)


# ---------------------------------------------------------------------- push sources
@pytest.fixture(scope="module")
def lora_model(hf_model):
    model = peft.get_peft_model(
        copy.deepcopy(hf_model),
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]),
    )
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def test_peft_full_push_is_the_merged_model_and_leaves_it_alone(lora_model):
    names = [n for n, _ in lora_model.named_parameters()]
    merged = merged_lora_state(lora_model)
    assert [n for n, _ in lora_model.named_parameters()] == names
    expected = copy.deepcopy(lora_model).merge_and_unload().state_dict()
    assert sorted(merged) == sorted(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(merged[name], tensor, atol=1e-6, rtol=0)
    source = full_push_source(TransformersWrapper(lora_model, generate=False, input_mode="tokens"))
    assert sorted(source.tensors) == sorted(expected) and source.scorer is lora_model


def test_transformers_wrapper_is_pushed_as_its_model(hf_model):
    wrapper = TransformersWrapper(hf_model, generate=False, input_mode="tokens")
    source = full_push_source(wrapper)
    assert source.module is hf_model and "model.embed_tokens.weight" in source.tensors


def test_what_cannot_be_pushed_is_named(hf_model, lora_model):
    policy = VLLMPolicy(FakeService(), input_mode="tokens")
    with pytest.raises(WeightSyncError, match="cannot push a VLLMPolicy"):
        full_push_source(policy)
    with pytest.raises(
        WeightSyncError, match="Qwen2ForCausalLM as a LoRA adapter: it is not a PEFT model"
    ):
        adapter_source(hf_model)
    wrapped = TransformersWrapper(lora_model, generate=False, input_mode="tokens")
    assert adapter_source(wrapped) is lora_model


# ---------------------------------------------------------------------- versions
def test_versions_follow_the_engine_and_the_collector():
    assert next_version("7", 0) == "8" and next_version("sft", 4) == "5"

    class Tracked:
        policy_version = 3

    served = []
    pushes = TorchRLPushes(lambda weights, version: served.append(version), lambda: "sft")
    pushes.push("w", tracked_version(Tracked()))  # the collector moves to 4 after it
    pushes.push("w")  # a label that is no integer: this adapter's count + 1
    assert served == ["4", "2"] and pushes.count == 2
    Tracked.policy_version = "uuid-1"
    with pytest.raises(ConfigurationError, match="integer versions"):
        tracked_version(Tracked())


def test_update_iterator_is_checked_and_decoder_names_mapped():
    t = torch.zeros(1)
    assert list(collect(iter([("a", t)]))) == ["a"]
    with pytest.raises(WeightSyncError, match="item 0 is int"):
        collect(iter([1]))
    with pytest.raises(WeightSyncError, match="given twice"):
        collect(iter([("a", t), ("a", t)]))
    expected = {"model.norm.weight": None, "lm_head.weight": None}
    assert list(decoder_names_to_checkpoint({"norm.weight": t}, expected)) == ["model.norm.weight"]
    untouched = {"lm_head.weight": t}
    assert decoder_names_to_checkpoint(untouched, expected) is untouched


def test_from_pretrained_takes_async_vllms_keywords():
    assert from_pretrained_kwargs(num_devices=2, verbose=False, compile=False, seed=1) == {
        "seed": 1,
        "tensor_parallel_size": 2,
    }
    assert from_pretrained_kwargs()["tensor_parallel_size"] == 1
    with pytest.raises(ConfigurationError, match="disagree"):
        from_pretrained_kwargs(num_devices=2, tensor_parallel_size=1)
    with pytest.raises(ConfigurationError, match="float32"):
        from_pretrained_kwargs(enable_fp32_output=True)

"""Batches and metrics between trainer ranks as plain data (no pickle): TorchRL's LLM
layout survives the JSON description, and a description naming any other class is refused."""

from __future__ import annotations

import json

import pytest
import torch
from tensordict import NonTensorStack, TensorDict
from torchrl.modules.llm.policies import LogProbs, Masks, Text, Tokens

from torchrl_vllm_ext.grpo.rank_messages import rebuild, to_plain


def _wire(td):
    layout = td.consolidate(metadata=True)._consolidated
    return json.loads(json.dumps(to_plain(layout["metadata"]))), layout["storage"]


def test_torchrl_layout_round_trips_through_json():
    rows = 2
    td = TensorDict(
        {
            "tokens": Tokens(
                prompt=torch.arange(6).view(rows, 3),
                response=torch.arange(8).view(rows, 4),
                batch_size=[rows],
            ),
            "masks": Masks(
                all_attention_mask=torch.ones(rows, 7, dtype=torch.bool), batch_size=[rows]
            ),
            "log_probs": LogProbs(response=torch.randn(rows, 4), batch_size=[rows]),
            "text": Text(prompt=NonTensorStack("one", "two"), batch_size=[rows]),
            "next": {"reward": torch.rand(rows, 1, 1)},
        },
        batch_size=[rows],
    )
    back = rebuild(*_wire(td))
    assert isinstance(back["tokens"], Tokens) and isinstance(back["text"], Text)
    assert back["text"].prompt == ["one", "two"]
    for key in [("tokens", "prompt"), ("tokens", "response"), ("log_probs", "response")]:
        assert torch.equal(back.get(key), td.get(key)), key
    assert torch.equal(back["next", "reward"], td["next", "reward"])
    assert back["masks"].all_attention_mask.dtype == torch.bool


def test_a_class_outside_tensordict_and_torchrl_is_refused():
    plain, storage = _wire(TensorDict({"x": torch.ones(2)}, [2]))
    plain["cls"] = "os:system"
    with pytest.raises(ValueError, match="only tensordict's and TorchRL's tensor classes"):
        rebuild(plain, storage)


def test_a_non_tensor_json_cannot_carry_is_named():
    td = TensorDict({"x": torch.ones(2)}, [2])
    td.set_non_tensor("when", object())
    with pytest.raises(TypeError, match="JSON cannot carry"):
        _wire(td)

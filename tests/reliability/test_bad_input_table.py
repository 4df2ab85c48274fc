"""Bad input across the service, launch, policy, weight sync and CLI, one row per kind.

Each row gets a typed error whose message names the bad value and says what to do,
and the service answers the next valid request.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import ray
import torch
from tensordict import TensorDict

from torchrl_vllm_ext import (
    ConfigurationError,
    InvalidRequestError,
    TorchRLVLLMError,
    UnknownRoutingStrategyError,
    VLLMPolicy,
    VLLMService,
    WeightSyncError,
    WeightSyncScheme,
)
from torchrl_vllm_ext.weight_sync.transports.storage.slots import CURRENT, SlotWriter

from ..helpers import wait_ready

OK = {"max_tokens": 2, "ignore_eos": True}  # exactly 2 tokens, even if EOS is drawn
# A message says what to do about it: one of these words appears in every one of them.
FIX = re.compile(
    r"\b(pass|use|check|push|launch|give|put|cast|truncate|tokenize|add|build|must|needs?|"
    r"expected|re-push|pick|strip|wrap|e\.g\.|one of|instead|at least|between)\b",
    re.IGNORECASE,
)


@dataclass
class Ctx:
    service: VLLMService
    scheme: WeightSyncScheme
    trainer: torch.nn.Module
    tmp: Path

    def policy(self, **kwargs) -> VLLMPolicy:
        kwargs.setdefault("input_mode", "tokens")
        return VLLMPolicy(self.service, sampling_params=OK, **kwargs)

    def state(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.trainer.state_dict().items()}

    def push(self, sd) -> None:
        self.scheme.push(sd, version="never")

    def worker_load(self, path: Path, version: str | None = None) -> None:
        """The public worker entry point, on a live replica (through its actor)."""
        handle = self.service.replica_handle(self.service.replica_ids[0])
        ray.get(handle.collective_rpc.remote("load_weights_from_storage", (str(path), version)))

    def generate(self, *, model=None, input=None, output=None, lines=('{"prompt": "hi"}',)):
        """``torchrl-vllm generate`` on this service; raises what the command reports."""
        from torchrl_vllm_ext.cli import build_parser
        from torchrl_vllm_ext.jobs import generate

        if input is None:
            input = self.tmp / f"in-{len(list(self.tmp.iterdir()))}.jsonl"
            input.write_text("\n".join(lines) + "\n")
        output = output if output is not None else self.tmp / f"out-{len(list(self.tmp.iterdir()))}"
        argv = ["generate", "--model", str(model or self.service.config.model)]
        argv += ["--input", str(input), "--output", str(output), "--max-tokens", "2"]
        args = build_parser().parse_args([*argv, "--no-progress"])
        return generate.run(args, self.service)

    def slots(self, name: str) -> Path:
        root = self.tmp / name
        SlotWriter(root).write({"w": torch.ones(4)}, "1")
        return root


def tokens_td(ids, **extra) -> TensorDict:
    return TensorDict({("tokens", "prompt"): ids, **extra}, batch_size=[len(ids)])


def with_nan(c: Ctx):
    sd = c.state()
    sd["model.layers.1.self_attn.q_proj.weight"][3, 3] = float("nan")
    return sd


def renamed(c: Ctx):
    sd = c.state()
    sd["model.decoder.weight"] = sd["model.norm.weight"].clone() + 1
    return sd


def missing(c: Ctx):
    sd = c.state()
    del sd["model.layers.0.mlp.down_proj.weight"]
    return sd


def reshaped(c: Ctx):
    sd = c.state()
    sd["model.norm.weight"] = torch.ones(3)
    return sd


def non_tensor(c: Ctx):
    sd = c.state()
    sd["model.norm.weight"] = [1.0, 2.0]
    return sd


def int_dtype(c: Ctx):
    sd = c.state()
    sd["model.norm.weight"] = sd["model.norm.weight"].long()
    return sd


def output_is_a_file(c: Ctx):
    (c.tmp / "a-file").write_text("not a directory")
    c.generate(output=c.tmp / "a-file")


def output_entry_links_outside(c: Ctx):
    from torchrl_vllm_ext.jobs.generate_store import RUN

    out = c.tmp / "linked-out"
    out.mkdir()
    (out / RUN).symlink_to(c.tmp / "elsewhere.json")
    c.generate(output=out)


def corrupt_manifest(c: Ctx):
    root = c.slots("corrupt")
    (root / CURRENT).write_text("{not json")
    c.worker_load(root)


def missing_slot(c: Ctx):
    root = c.slots("missing-slot")
    shutil.rmtree(root / "slot-A")
    c.worker_load(root)


def escaping_slot(c: Ctx):
    root = c.slots("escape")
    manifest = json.loads((root / CURRENT).read_text())
    manifest["slot"] = "../../etc"
    (root / CURRENT).write_text(json.dumps(manifest))
    c.worker_load(root)


def empty_dir(c: Ctx):
    (c.tmp / "empty").mkdir()
    c.worker_load(c.tmp / "empty")


def stale_version(c: Ctx):
    c.worker_load(c.slots("stale"), "999")


def scribbled_slot(c: Ctx):
    root = c.slots("scribbled")
    TensorDict.load_memmap(root / "slot-A", mode="r+")["w"].add_(1)
    c.worker_load(root)


# (name, call, error type, regex the message matches: the bad value)
CASES = [
    # ---- service
    ("service: empty prompt", lambda c: c.service.generate_request_data([[1, 2], []], OK),
     InvalidRequestError, "prompt 1 is empty"),
    ("service: out-of-vocabulary id", lambda c: c.service.generate_request_data([[1, 99999]], OK),
     InvalidRequestError, "token id 99999"),
    ("service: negative id", lambda c: c.service.generate_request_data([[-5, 1]], OK),
     InvalidRequestError, "token id -5"),
    ("service: over-long prompt", lambda c: c.service.generate_request_data([[1] * 300], OK),
     InvalidRequestError, "300 tokens but max_model_len is 256"),
    ("service: text into the token-id path", lambda c: c.service.generate_request_batch(["hello"], OK),
     InvalidRequestError, r"prompt 0 is a string \('hello'\)"),
    ("service: prompt dict with an unserved key",
     lambda c: c.service.generate({"prompt": "hi", "multi_modal_data": {}}, OK),
     InvalidRequestError, r"\['multi_modal_data'\] are not served"),
    ("service: lora_request that is not one", lambda c: c.service.generate([[1, 2]], OK, lora_request="x"),
     InvalidRequestError, "lora_request='x' is not a vllm LoRARequest"),
    ("service: float ids", lambda c: c.service.generate_request_data([[1.5, 2.0]], OK),
     InvalidRequestError, "dtype float64; token ids must be integers"),
    ("service: 2-D array", lambda c: c.service.generate_request_data(np.ones((2, 3), dtype=np.int64), OK),
     InvalidRequestError, "2-D array"),
    ("service: not a sequence", lambda c: c.service.generate_request_data(42, OK),
     InvalidRequestError, "got int"),
    ("service: negative max_tokens", lambda c: c.service.generate_request_data([[1, 2]], {"max_tokens": -3}),
     InvalidRequestError, "max_tokens=-3"),
    ("service: zero samples", lambda c: c.service.generate_request_data([[1, 2]], {"max_tokens": 2, "n": 0}),
     InvalidRequestError, "n=0"),
    ("service: misspelled sampling field",
     lambda c: c.service.generate_request_data([[1, 2]], {"max_tokens": 2, "temprature": 1.0}),
     InvalidRequestError, "'temprature'.*did you mean 'temperature'"),
    ("service: negative temperature",
     lambda c: c.service.generate_request_data([[1, 2]], {"max_tokens": 2, "temperature": -1.0}),
     InvalidRequestError, "temperature must be non-negative, got -1.0"),
    ("service: sampling params of the wrong type",
     lambda c: c.service.generate_request_data([[1, 2]], "greedy"),
     InvalidRequestError, "got str"),
    ("service: one params per prompt mismatch", lambda c: c.service.generate_request_data([[1], [2]], [OK]),
     InvalidRequestError, "1 sampling params for 2 prompts"),
    ("service: unknown routing", lambda c: c.service.generate_request_data([[1, 2]], OK, routing="fastest"),
     UnknownRoutingStrategyError, "'fastest'"),
    ("service: unknown pause mode", lambda c: c.service.pause("freeze"),
     ConfigurationError, "'freeze'"),
    ("service: remove every replica", lambda c: c.service.remove_replicas(2),
     ConfigurationError, r"remove_replicas\(k=2\)"),
    ("service: add zero replicas", lambda c: c.service.add_replicas(0),
     ConfigurationError, r"k=0"),
    # ---- launch
    ("launch: model path does not exist", lambda c: VLLMService.launch(c.tmp / "no-model"),
     ConfigurationError, "no-model.* is not a local directory"),
    ("launch: model path without config.json", lambda c: VLLMService.launch(c.tmp),
     ConfigurationError, "has no config.json"),
    ("launch: zero replicas", lambda c: VLLMService.launch(c.tmp, num_replicas=0),
     ConfigurationError, "num_replicas=0"),
    # ---- policy
    ("policy: missing input key",
     lambda c: c.policy()(TensorDict({"ids": torch.tensor([[5, 6]])}, batch_size=[1])),
     InvalidRequestError, r"no key \('tokens', 'prompt'\)"),
    ("policy: float token ids", lambda c: c.policy()(tokens_td(torch.tensor([[5.0, 6.0]]))),
     InvalidRequestError, "dtype torch.float32"),
    ("policy: out-of-vocabulary id", lambda c: c.policy()(tokens_td(torch.tensor([[5, 99999]]))),
     InvalidRequestError, "token id 99999"),
    ("policy: over-long prompt", lambda c: c.policy()(tokens_td(torch.ones(1, 300, dtype=torch.long))),
     InvalidRequestError, "300 tokens but max_model_len is 256"),
    ("policy: pad id inside tokens without a mask",
     lambda c: c.policy(pad_token_id=0)(tokens_td(torch.tensor([[0, 5, 6]]))),
     InvalidRequestError, "contains the pad id 0"),
    ("policy: float seeds",
     lambda c: c.policy()(tokens_td(torch.tensor([[5, 6]]), seed=torch.tensor([0.5]))),
     InvalidRequestError, "must be an integer tensor"),
    ("policy: per-call n", lambda c: c.policy()(tokens_td(torch.tensor([[5, 6]])), n=3),
     InvalidRequestError, "n cannot be overridden"),
    ("policy: unknown input mode", lambda c: c.policy(input_mode="audio"),
     ConfigurationError, "'audio'"),
    ("policy: token prompts in the default (history) mode",
     lambda c: VLLMPolicy(c.service, sampling_params=OK)(tokens_td(torch.tensor([[5, 6]]))),
     InvalidRequestError, r"no key \('history', 'prompt'\)"),
    ("policy: zero samples", lambda c: c.policy(num_samples=0),
     ConfigurationError, "num_samples=0"),
    # ---- weight sync
    ("sync: NaN weight", lambda c: c.push(with_nan(c)),
     WeightSyncError, "'model.layers.1.self_attn.q_proj.weight' contains NaN"),
    ("sync: wrong parameter name", lambda c: c.push(renamed(c)),
     WeightSyncError, "'model.decoder.weight' is not in the served checkpoint"),
    ("sync: missing parameter", lambda c: c.push(missing(c)),
     WeightSyncError, "'model.layers.0.mlp.down_proj.weight' is missing"),
    ("sync: wrong shape", lambda c: c.push(reshaped(c)),
     WeightSyncError, r"'model.norm.weight' has shape \(3,\)"),
    ("sync: integer weights", lambda c: c.push(int_dtype(c)),
     WeightSyncError, "'model.norm.weight' has dtype torch.int64"),
    ("sync: a value that is not a tensor", lambda c: c.push(non_tensor(c)),
     WeightSyncError, r"weights\['model.norm.weight'\] is a list"),
    ("sync: a vLLM policy instead of the trainer's model", lambda c: c.push(c.policy()),
     WeightSyncError, "cannot push a VLLMPolicy"),
    ("sync: weights of an unsupported type", lambda c: c.push([1, 2, 3]),
     WeightSyncError, "weights of type list"),
    ("sync: unknown transport", lambda c: WeightSyncScheme(c.service, transport="pigeon"),
     ConfigurationError, "'pigeon'"),
    ("sync: corrupted manifest", corrupt_manifest, WeightSyncError, "is not a valid manifest"),
    ("sync: missing slot", missing_slot, WeightSyncError, "slot A of .*missing-slot is missing"),
    ("sync: manifest slot outside the storage dir", escaping_slot,
     WeightSyncError, r"names slot '\.\./\.\./etc'"),
    ("sync: nothing published", empty_dir, WeightSyncError, "no published weights in .*empty"),
    ("sync: stale version", stale_version, WeightSyncError, "publishes version '1', expected '999'"),
    ("sync: slot modified after publishing", scribbled_slot,
     WeightSyncError, "checksum mismatch for 'w'"),
    # ---- CLI: torchrl-vllm generate
    ("cli: missing input file", lambda c: c.generate(input=c.tmp / "nowhere.jsonl"),
     ConfigurationError, "--input '.*nowhere.jsonl' does not exist"),
    ("cli: model path without config.json", lambda c: c.generate(model=c.tmp),
     ConfigurationError, "--model='.*' has no config.json"),
    ("cli: malformed JSONL line", lambda c: c.generate(lines=('{"prompt": "ok"}', "{not json")),
     InvalidRequestError, "line 2 is not valid JSON"),
    ("cli: line without a prompt", lambda c: c.generate(lines=('{"promt": "typo"}',)),
     InvalidRequestError, "line 1 must have exactly one of"),
    ("cli: output path is a file", output_is_a_file,
     ConfigurationError, "--output '.*a-file' exists and is not a directory"),
    ("cli: output entry links outside the output dir", output_entry_links_outside,
     ConfigurationError, "run.json' is a symbolic link"),
]  # fmt: skip


@pytest.fixture(scope="module")
def ctx(service, scheme, trainer, tmp_path_factory):
    wait_ready(service)
    return Ctx(service, scheme, trainer, tmp_path_factory.mktemp("bad-input"))


def test_table_covers_at_least_25_kinds():
    assert len(CASES) >= 25 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize(("name", "call", "error", "match"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_a_typed_error_and_the_service_keeps_serving(ctx, name, call, error, match):
    version = ctx.service.weight_version
    with pytest.raises(error, match=match) as info:
        call(ctx)
    assert isinstance(info.value, TorchRLVLLMError)
    assert FIX.search(str(info.value)), f"the message says no fix: {info.value}"
    out = ctx.service.generate_request_data([[1, 2, 3]], OK)
    assert len(out[0].samples[0].token_ids) == 2
    assert set(ctx.service.weight_versions().values()) == {version}, "nothing was loaded"

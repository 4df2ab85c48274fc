"""LoRA adapters on real replicas: added to every replica, sampled and scored with, equal to
the PEFT model's log-probs (transformers, fp32); bad adapters are refused cleanly."""

from __future__ import annotations

import os

import pytest
import torch
from tensordict import TensorDict

from torchrl_vllm_ext import (
    ConfigurationError,
    InvalidRequestError,
    VLLMPolicy,
    VLLMService,
    WeightSyncError,
)

from ..helpers import CPUS_PER_REPLICA, ENGINE_KWARGS, hf_token_logprobs, make_adapter

RANK = 8
SEQUENCE = [5, 6, 7, 8, 9, 10, 40, 41, 42]


@pytest.fixture(scope="module")
def lora_service(tiny_model, ray_cluster):
    svc = VLLMService.launch(
        tiny_model,
        num_replicas=2,
        cpus_per_replica=CPUS_PER_REPLICA / 2,
        health_check_interval=0,
        enable_lora=True,
        max_lora_rank=16,
        max_loras=2,
        **ENGINE_KWARGS,
    )
    yield svc
    svc.shutdown()


def scored(service, lora=None) -> torch.Tensor:
    policy = VLLMPolicy(service, input_mode="tokens", generate=False, lora=lora)
    td = TensorDict({("tokens", "full"): torch.tensor([SEQUENCE])}, batch_size=[1])
    return policy(td).get(("log_probs", "full"))[0, 1:]


def test_adapter_log_probs_equal_peft_on_every_replica(
    lora_service, tiny_model, hf_model, tmp_path
):
    peft_model = make_adapter(tiny_model, tmp_path / "a1", seed=1)
    lora_id = lora_service.add_lora("a1", tmp_path / "a1")
    assert lora_service.list_loras() == {"a1": lora_id}
    expected = hf_token_logprobs(peft_model, SEQUENCE)
    base = hf_token_logprobs(hf_model, SEQUENCE)
    assert (expected - base).abs().max() > 1e-2, "the adapter changes the model"
    for _ in range(2):  # the router spreads calls: both replicas answer
        torch.testing.assert_close(scored(lora_service, "a1"), expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(scored(lora_service), base, atol=1e-4, rtol=0)
    # Sampling with the adapter: its log-probs are the adapter's.
    policy = VLLMPolicy(
        lora_service,
        input_mode="tokens",
        lora="a1",
        sampling_params={"max_tokens": 4, "temperature": 1.0},
    )
    out = policy(TensorDict({("tokens", "prompt"): torch.tensor([SEQUENCE[:4]])}, batch_size=[1]))
    full = out.get(("tokens", "full"))[0].tolist()
    torch.testing.assert_close(
        out.get(("log_probs", "response"))[0], hf_token_logprobs(peft_model, full)[-4:],
        atol=1e-4, rtol=0,
    )  # fmt: skip


def test_two_adapters_live_and_a_new_version_of_one(lora_service, tiny_model, tmp_path):
    v1 = make_adapter(tiny_model, tmp_path / "v1", seed=11)
    v2 = make_adapter(tiny_model, tmp_path / "v2", seed=12)
    lora_service.add_lora("old", tmp_path / "v1")
    lora_service.add_lora("new", tmp_path / "v2")
    torch.testing.assert_close(
        scored(lora_service, "old"), hf_token_logprobs(v1, SEQUENCE), atol=1e-4, rtol=0
    )
    torch.testing.assert_close(
        scored(lora_service, "new"), hf_token_logprobs(v2, SEQUENCE), atol=1e-4, rtol=0
    )
    # Re-adding a name serves the new files under a new id.
    first = lora_service.list_loras()["old"]
    assert lora_service.add_lora("old", tmp_path / "v2") != first
    torch.testing.assert_close(
        scored(lora_service, "old"), hf_token_logprobs(v2, SEQUENCE), atol=1e-4, rtol=0
    )
    lora_service.remove_lora("old")
    lora_service.remove_lora("new")


def test_bad_adapters_are_refused_and_the_service_keeps_serving(lora_service, tiny_model, tmp_path):
    with pytest.raises(ConfigurationError, match=r"adapter_config\.json"):
        lora_service.add_lora("nothing", tmp_path)
    make_adapter(tiny_model, tmp_path / "big", seed=3, rank=32)  # > max_lora_rank=16
    with pytest.raises(InvalidRequestError, match="big"):
        lora_service.add_lora("big", tmp_path / "big")
    assert "big" not in lora_service.list_loras()
    with pytest.raises(InvalidRequestError, match="no LoRA adapter named 'ghost'"):
        scored(lora_service, "ghost")
    assert scored(lora_service).shape == (len(SEQUENCE) - 1,)


def test_a_new_replica_gets_the_live_adapters_before_traffic(lora_service, tiny_model, tmp_path):
    import ray

    make_adapter(tiny_model, tmp_path / "kept", seed=21)
    lora_id = lora_service.add_lora("kept", tmp_path / "kept")
    (rid,) = lora_service.add_replicas(1)
    try:
        assert lora_id in ray.get(lora_service.replica_handle(rid).list_loras.remote())
    finally:
        lora_service.remove_replicas(1)
        lora_service.remove_lora("kept")


def perturb_adapter(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.add_(torch.randn(param.shape, generator=gen) * 0.05)


def test_adapter_pushes_serve_each_version_and_keep_the_last_k(lora_service, tiny_model, tmp_path):
    from torchrl_vllm_ext.weight_sync.adapters import AdapterSync

    trainer = make_adapter(tiny_model, tmp_path / "init", seed=31)
    expected = {}
    with AdapterSync(lora_service, "policy", keep=2) as sync:
        policy = VLLMPolicy(lora_service, input_mode="tokens", generate=False, lora=sync)
        td = TensorDict({("tokens", "full"): torch.tensor([SEQUENCE])}, batch_size=[1])
        for version in (1, 2, 3):
            perturb_adapter(trainer, seed=100 + version)
            report = sync.push(trainer, version)
            expected[version] = hf_token_logprobs(trainer, SEQUENCE)
            assert report.lora_name == f"policy@{version}" == sync.current
            got = policy(td.clone()).get(("log_probs", "full"))[0, 1:]
            torch.testing.assert_close(got, expected[version], atol=1e-4, rtol=0)
        assert sync.live_versions == ["2", "3"] and report.retired == ["1"]
        assert "policy@1" not in lora_service.list_loras()
        # Work pinned to an older live version still gets that version.
        torch.testing.assert_close(scored(lora_service, "policy@2"), expected[2], atol=1e-4, rtol=0)
        # Generation tags each sample with the adapter version that made it.
        sampler = VLLMPolicy(
            lora_service, input_mode="tokens", lora=sync, sampling_params={"max_tokens": 2}
        )
        out = sampler(
            TensorDict({("tokens", "prompt"): torch.tensor([SEQUENCE[:4]])}, batch_size=[1])
        )
        assert out.get(("vllm", "lora")).tolist() == ["policy@3"]
        # TorchRL's TransformersWrapper around the PEFT model is pushed as its adapter;
        # a model that is not a PEFT model is named.
        from torchrl.modules.llm import TransformersWrapper

        perturb_adapter(trainer, seed=104)
        sync.push(TransformersWrapper(trainer, input_mode="tokens", generate=False), 4)
        got = policy(td.clone()).get(("log_probs", "full"))[0, 1:]
        torch.testing.assert_close(got, hf_token_logprobs(trainer, SEQUENCE), atol=1e-4, rtol=0)
        with pytest.raises(WeightSyncError, match="Linear as a LoRA adapter: it is not a PEFT"):
            sync.push(torch.nn.Linear(1, 1), 40)
        # Bad pushes are refused before any replica is touched.
        before = lora_service.list_loras()
        bad = trainer.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"].weight
        with torch.no_grad():
            saved = bad.clone()
            bad[0, 0] = float("nan")
        with pytest.raises(WeightSyncError, match="NaN"):
            sync.push(trainer, 6)
        with torch.no_grad():
            bad.copy_(saved)
        other_rank = make_adapter(tiny_model, tmp_path / "r4", seed=5, rank=4)
        with pytest.raises(WeightSyncError, match="r=4"):
            sync.push(other_rank, 7)
        assert lora_service.list_loras() == before and sync.current == "policy@4"
    assert not any(n.startswith("policy@") for n in lora_service.list_loras())


def _our_files(pids: set[int]) -> set[str]:
    """Every path in the directories of ours (``leftovers.PREFIX``) under shared memory and
    the temporary directory that the processes ``pids`` own."""
    import tempfile
    from pathlib import Path

    from torchrl_vllm_ext import leftovers

    found = set()
    for base in {leftovers.shm_base(), Path(tempfile.gettempdir())}:
        for entry in base.glob(leftovers.PREFIX + "*"):
            owner = leftovers.read_owner(entry)
            if owner is not None and owner.pid in pids:
                found |= {str(entry), *(str(p) for p in entry.rglob("*"))}
    return found


_WRITES: list[str] | None = None
"""Paths this process opens for writing while a test records them (None: not recording)."""


def _record_writes(event: str, args: tuple) -> None:
    if _WRITES is None or event != "open":
        return
    path, mode, flags = args
    writing = (
        any(c in mode for c in "wax+")
        if isinstance(mode, str)
        else bool((flags or 0) & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
    )
    if writing:
        _WRITES.append(str(path))


def test_an_adapter_push_writes_no_file_and_serves_peft_log_probs(
    lora_service, tiny_model, tmp_path
):
    import sys

    import ray

    from torchrl_vllm_ext.weight_sync.adapters import AdapterSync

    global _WRITES
    trainer = make_adapter(tiny_model, tmp_path / "init", seed=41)
    pids = {os.getpid()} | {int(v.process.rsplit(":", 1)[-1]) for v in lora_service.pool.ready()}
    before = _our_files(pids)
    sys.addaudithook(_record_writes)  # NOTE: hooks stay for the process; it reads _WRITES
    with AdapterSync(lora_service, "memory", keep=1) as sync:
        _WRITES = []
        try:
            for version in (1, 2):
                perturb_adapter(trainer, seed=200 + version)
                report = sync.push(trainer, version)
                expected = hf_token_logprobs(trainer, SEQUENCE)
                for _ in range(2):  # the router spreads calls: both replicas answer
                    got = scored(lora_service, sync.current)
                    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
            writes, _WRITES = _WRITES, None
        finally:
            _WRITES = None
        assert writes == [], f"the push wrote {writes[:5]}"
        assert _our_files(pids) == before, "a replica or the driver wrote adapter files"
        assert "write" not in report.phases and report.retired == ["1"]
        # Every replica's workers hold the adapter (vLLM lists it) and a replica added
        # later gets it from Ray's object store before it takes traffic.
        lora_id = lora_service.list_loras()[sync.current]
        for view in lora_service.pool.ready():
            assert lora_id in ray.get(view.handle.list_loras.remote())
        (rid,) = lora_service.add_replicas(1)
        try:
            assert lora_id in ray.get(lora_service.replica_handle(rid).list_loras.remote())
        finally:
            lora_service.remove_replicas(1)
    assert not any(n.startswith("memory@") for n in lora_service.list_loras())

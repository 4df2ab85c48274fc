"""The demo's CPU replicas start without torch.compile; the driver's environment is kept."""

from __future__ import annotations

import os

from torchrl_vllm_ext.grpo.run import replicas_without_torch_compile


def test_replicas_started_inside_inherit_the_switch_and_the_driver_gets_its_env_back(
    monkeypatch,
):
    monkeypatch.delenv("TORCH_COMPILE_DISABLE", raising=False)
    with replicas_without_torch_compile(gpu=False):
        assert os.environ["TORCH_COMPILE_DISABLE"] == "1"
    assert "TORCH_COMPILE_DISABLE" not in os.environ


def test_gpu_replicas_and_a_users_own_setting_are_left_alone(monkeypatch):
    monkeypatch.delenv("TORCH_COMPILE_DISABLE", raising=False)
    with replicas_without_torch_compile(gpu=True):
        assert "TORCH_COMPILE_DISABLE" not in os.environ
    monkeypatch.setenv("TORCH_COMPILE_DISABLE", "0")
    with replicas_without_torch_compile(gpu=False):
        assert os.environ["TORCH_COMPILE_DISABLE"] == "0"
    assert os.environ["TORCH_COMPILE_DISABLE"] == "0"

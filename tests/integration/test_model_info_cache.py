"""The driver fills vLLM's model-info cache that replicas on this host read at start."""

from __future__ import annotations

import json
import logging

from torchrl_vllm_ext.engine.driver.model_info import fill_model_info_cache


def test_the_driver_fills_the_cache_a_replica_reads(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))  # vLLM reads it at each use
    fill_model_info_cache(tiny_model, dtype="float32").join(timeout=300)
    (entry,) = (tmp_path / "modelinfos").glob("*Qwen2ForCausalLM.json")
    assert "modelinfo" in json.loads(entry.read_text())


def test_a_model_vllm_cannot_read_is_reported_and_left_to_the_replicas(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, "torchrl_vllm_ext"):
        fill_model_info_cache(tmp_path / "no-such-model").join(timeout=300)
    assert "could not fill vLLM's model-info cache" in caplog.text

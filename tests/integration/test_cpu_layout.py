"""Both vLLM-CPU weight layouts take a storage update exactly.

Default: linear weights stay in checkpoint layout and an update is the model's own
``load_weights`` (in place). ``ServiceConfig(cpu_packed_weights=True)`` (which sets
``TORCHRL_VLLM_CPU_PACKED_WEIGHTS=1`` in the worker): vLLM's oneDNN packing, updated
by its layerwise reload plus the tied-LM-head refresh. Each case
runs a real in-process ``vllm.LLM`` with the package's worker extension in a fresh
interpreter (the layout switch is process-wide), loads a perturbed model through
``load_weights_from_storage`` and compares prompt log-probs with transformers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import json, os, sys
import torch
from transformers import AutoModelForCausalLM
from vllm import LLM, SamplingParams

from torchrl_vllm_ext.extensions import WORKER_EXTENSION
from torchrl_vllm_ext.weight_sync.cpu_layout import loads_in_place
from torchrl_vllm_ext.weight_sync.params import expected_specs, named_tensors, validate
from torchrl_vllm_ext.weight_sync.transports.storage.slots import SlotWriter

model_dir, slots = sys.argv[1], sys.argv[2]
llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=128,
          kv_cache_memory_bytes=1 << 26, worker_extension_cls=WORKER_EXTENSION)
in_place = llm.apply_model(loads_in_place)[0]
trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
seq = list(range(5, 40))

def vllm_logprobs():
    out = llm.generate([{"prompt_token_ids": seq}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    return torch.tensor([next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]])

def trainer_logprobs():
    with torch.no_grad():
        lp = torch.log_softmax(trainer(torch.tensor([seq])).logits[0, :-1].float(), -1)
    return lp.gather(-1, torch.tensor(seq[1:])[:, None])[:, 0]

writer = SlotWriter(slots)
diffs, versions = [], []
for version in ("1", "2"):
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    tensors = validate(named_tensors(trainer), expected_specs(model_dir))
    writer.write(tensors, version)
    versions += llm.collective_rpc("load_weights_from_storage", args=(slots, version))
    diffs.append(float((vllm_logprobs() - trainer_logprobs()).abs().max()))
print(json.dumps({"in_place": in_place, "diffs": diffs, "versions": versions}))
"""


# The checkpoint layout is every replica's default: test_weight_sync.py's storage pushes
# prove it exact by default, and test_engine_modes.py's load plan ("trace", "replay")
# runs only where the layout loads in place; its fresh-interpreter case here is slow.
@pytest.mark.parametrize(
    "packed",
    [pytest.param(False, marks=pytest.mark.slow, id="checkpoint-layout"),
     pytest.param(True, id="onednn-packed")],
)  # fmt: skip
def test_storage_update_is_exact_in_both_cpu_layouts(tiny_model, tmp_path, packed):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", TORCHRL_VLLM_CPU_PACKED_WEIGHTS=str(int(packed)))
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tiny_model), str(tmp_path / "slots")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["in_place"] is (not packed)
    assert result["versions"] == ["1", "2"]
    # fp32 tiny model: vLLM-CPU and transformers agree to ~1e-6 after every update.
    assert max(result["diffs"]) < 1e-4, result

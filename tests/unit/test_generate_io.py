"""torchrl-vllm generate without vLLM: input parsing, output directory, resume bookkeeping."""

from __future__ import annotations

import json
import os

import pytest
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict, lazy_stack

from torchrl_vllm_ext import ConfigurationError, InvalidRequestError
from torchrl_vllm_ext.jobs.generate import GenerateOptions, fingerprint
from torchrl_vllm_ext.jobs.generate_io import (
    Prompts,
    parse_jsonl_line,
    policy_input,
    read_jsonl,
    read_prompts,
)
from torchrl_vllm_ext.jobs.generate_store import (
    Layout,
    OutputDir,
    chunk_output,
    chunks_left,
    inside,
    load_output,
)
from torchrl_vllm_ext.testing import make_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("m") / "qwen2", arch="qwen2", seed=0)


@pytest.fixture(scope="module")
def tokenizer(model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def jsonl(*rows) -> bytes:
    return "\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows).encode()


# ---------------------------------------------------------------------------- JSONL
def test_jsonl_kinds(tokenizer):
    p = read_jsonl(
        jsonl({"prompt": "hello world", "id": 1}, "", {"prompt": "red", "id": "b"}), tokenizer
    )
    assert p.kind == "prompt" and p.texts == ["hello world", "red"] and p.ids == ["1", "b"]
    assert p.token_ids[0].tolist() == tokenizer("hello world")["input_ids"]

    chat = [{"role": "user", "content": "hi"}]
    p = read_jsonl(jsonl({"messages": chat}), tokenizer)
    assert p.kind == "messages" and p.ids is None
    assert p.texts[0].endswith("<|im_start|>assistant\n")
    assert p.token_ids[0].tolist() == tokenizer(p.texts[0], add_special_tokens=False)["input_ids"]

    p = read_jsonl(jsonl({"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8]}), tokenizer)
    assert p.kind == "prompt_token_ids" and p.texts is None
    assert [t.tolist() for t in p.token_ids] == [[5, 6, 7], [8]]
    assert p.lengths.tolist() == [3, 1]


def test_jsonl_digest_follows_content(tokenizer):
    a = read_jsonl(jsonl({"prompt": "a"}), tokenizer).digest
    assert a == read_jsonl(jsonl({"prompt": "a"}), tokenizer).digest
    assert a != read_jsonl(jsonl({"prompt": "b"}), tokenizer).digest


@pytest.mark.parametrize(
    ("rows", "match"),
    [
        (['{"prompt": "a"}', "{not json"], r"line 2 is not valid JSON"),
        (['{"prompt": "a"}', "[1, 2]"], r"line 2 is a JSON list"),
        (['{"promt": "a"}'], r"line 1 must have exactly one of .* none of them"),
        (['{"prompt": "a", "messages": []}'], r"prompt and messages"),
        (['{"prompt": ""}'], r'line 1: "prompt" must be a non-empty string'),
        (['{"messages": [{"role": "user"}]}'], r'"messages" must be a non-empty list'),
        (['{"prompt_token_ids": [1, -2]}'], r"non-negative ints"),
        (['{"prompt_token_ids": [1.5]}'], r"non-negative ints"),
        (
            ['{"prompt": "a"}', "", '{"prompt_token_ids": [1]}'],
            r"mixes prompt kinds: 'prompt' \(first at line 1\), 'prompt_token_ids' \(first at line 3",
        ),
        (['{"prompt": "a", "id": 1}', '{"prompt": "b"}'], r'line 2 has no "id"'),
        (['{"prompt": "a", "id": 1}', '{"prompt": "b", "id": "1"}'], r"line 2 repeats id '1'"),
        (['{"prompt": "a", "id": [1]}'], r"id=\[1\] must be a string or an integer"),
        (["", "  "], r"holds no prompts"),
    ],
)
def test_jsonl_errors_name_the_line(tokenizer, rows, match):
    with pytest.raises(InvalidRequestError, match=match):
        read_jsonl(jsonl(*rows), tokenizer, source="in.jsonl")


def test_jsonl_not_utf8(tokenizer):
    with pytest.raises(InvalidRequestError, match=r"line 2 is not UTF-8"):
        read_jsonl(b'{"prompt": "a"}\n{"prompt": "\xff"}', tokenizer)


def test_parse_line_reports_id_and_ignored_keys():
    assert parse_jsonl_line('{"prompt_token_ids": [1], "id": "x", "n": 2}', 4) == (
        "prompt_token_ids",
        [1],
        "x",
        {"n"},
    )


def test_missing_input_and_bad_memmaps(tmp_path, tokenizer):
    with pytest.raises(ConfigurationError, match=r"does not exist"):
        read_prompts(tmp_path / "nope.jsonl", tokenizer)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigurationError, match=r"not be loaded as a memory-mapped"):
        read_prompts(tmp_path / "empty", tokenizer)
    TensorDict({"other": torch.zeros(2, 3, dtype=torch.long)}, [2]).memmap(tmp_path / "nokey")
    with pytest.raises(InvalidRequestError, match=r"has no key \('tokens', 'prompt'\)"):
        read_prompts(tmp_path / "nokey", tokenizer)
    TensorDict({("tokens", "prompt"): torch.zeros(2, 3)}, [2]).memmap(tmp_path / "float")
    with pytest.raises(InvalidRequestError, match=r"dtype torch.float32"):
        read_prompts(tmp_path / "float", tokenizer)
    TensorDict({("tokens", "prompt"): torch.ones(2, 2, 3, dtype=torch.long)}, [2, 2]).memmap(
        tmp_path / "2d"
    )
    with pytest.raises(InvalidRequestError, match=r"batch size \(2, 2\)"):
        read_prompts(tmp_path / "2d", tokenizer)


def test_memmap_inputs(tmp_path, tokenizer):
    ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]])
    TensorDict({("tokens", "prompt"): ids, ("masks", "all_attention_mask"): ids != 0}, [2]).memmap(
        tmp_path / "padded"
    )
    p = read_prompts(tmp_path / "padded", tokenizer, pad_token_id=0)
    assert p.kind == "memmap" and [t.tolist() for t in p.token_ids] == [[5, 6], [7, 8, 9, 10]]

    # Without a mask the pad id is ambiguous; without the pad id every position is a token.
    TensorDict({("tokens", "prompt"): ids}, [2]).memmap(tmp_path / "nomask")
    with pytest.raises(InvalidRequestError, match=r"contains the pad id 0"):
        read_prompts(tmp_path / "nomask", tokenizer, pad_token_id=0)
    assert read_prompts(tmp_path / "nomask", tokenizer, pad_token_id=99).lengths.tolist() == [4, 4]

    ragged = lazy_stack(
        [TensorDict({("tokens", "prompt"): torch.tensor(r)}) for r in ([1, 2, 3], [4])]
    )
    ragged.memmap(tmp_path / "ragged")
    p2 = read_prompts(tmp_path / "ragged", tokenizer)
    assert [t.tolist() for t in p2.token_ids] == [[1, 2, 3], [4]]
    assert p2.digest != p.digest


def test_options_are_checked():
    with pytest.raises(ConfigurationError, match=r"--max-tokens=0"):
        GenerateOptions(max_tokens=0)
    with pytest.raises(ConfigurationError, match=r"--temperature=-1"):
        GenerateOptions(temperature=-1.0)
    with pytest.raises(ConfigurationError, match=r"--chunk-size"):
        GenerateOptions(chunk_size=0)


# ---------------------------------------------------------------------------- bookkeeping
def test_ranges():
    # Done ranges in any order, adjacent or overlapping.
    assert chunks_left(14, [[4, 8], [0, 4], [10, 12], [11, 13]], 9) == [(8, 10), (13, 14)]
    assert chunks_left(12, [], 5) == [(0, 5), (5, 10), (10, 12)]
    assert chunks_left(12, [[0, 5], [8, 10]], 4) == [(5, 8), (10, 12)]
    assert chunks_left(4, [[0, 4]], 2) == []


LAYOUT = Layout(rows=5, samples=1, prompt_width=3, max_tokens=2)
FP = {"input": "abc", "seed": 0}


def fake_chunk(lo, hi, layout=LAYOUT):
    b = (hi - lo, layout.samples) if layout.samples > 1 else (hi - lo,)
    wp, t = layout.prompt_width, layout.max_tokens
    full = torch.arange(lo, hi).reshape(-1, *[1] * len(b)).expand(*b, wp + t).clone()
    tensors = {
        ("tokens", "prompt"): full[..., :wp],
        ("tokens", "response"): full[..., wp:],
        ("tokens", "full"): full,
        ("log_probs", "response"): torch.zeros(*b, t),
        ("log_probs", "full"): torch.zeros(*b, wp + t),
        ("masks", "all_attention_mask"): torch.ones(*b, wp + t, dtype=torch.bool),
        ("masks", "all_assistant_mask"): torch.ones(*b, wp + t, dtype=torch.bool),
        "row": torch.arange(lo, hi).reshape(-1, *[1] * (len(b) - 1)).expand(b),
    }
    g = layout.samples
    strings = {  # prompt per row; the others per sample, row-major
        "prompt": [f"p{i}" for i in range(lo, hi)],
        "response": [f"r{i}" for i in range(lo, hi) for _ in range(g)],
        "weight_version": ["0"] * ((hi - lo) * g),
        "finish_reason": ["length" if i % 2 else "stop" for i in range(lo, hi) for _ in range(g)],
    }
    return tensors, strings


def chunk_files(root):
    """The committed chunks (a killed write's tmp file is not one)."""
    return sorted(p.name for p in (root / "chunks").glob("rows-*.json"))


def test_output_dir_resume_and_load(tmp_path):
    out = OutputDir.open(tmp_path / "out", LAYOUT, FP)
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o700
    assert out.remaining(2) == [(0, 2), (2, 4), (4, 5)]
    out.write_chunk(0, 2, *fake_chunk(0, 2))
    with pytest.raises(ConfigurationError, match=r"no finished generate output \(2 rows done\)"):
        load_output(tmp_path / "out")
    # Killed after the tensors of chunk [2, 4) were written, while its chunk file was being
    # written (its tmp file is left): those rows are not done.
    tensors, _ = fake_chunk(2, 4)
    out.data.get(("tokens", "full"))[2:4] = tensors[("tokens", "full")]
    (tmp_path / "out" / "chunks" / ".rows-000000000002-000000000004.json.123.tmp").write_text("{")
    del out

    again = OutputDir.open(tmp_path / "out", LAYOUT, FP)
    assert again.rows_done == 2 and not again.complete and again.remaining(3) == [(2, 5)]
    assert chunk_files(tmp_path / "out") == ["rows-000000000000-000000000002.json"]
    again.write_chunk(2, 5, *fake_chunk(2, 5))
    assert again.complete
    td = load_output(tmp_path / "out")
    assert td.batch_size == (5,)
    assert td["row"].tolist() == [0, 1, 2, 3, 4]
    assert td["tokens", "full"][:, 0].tolist() == [0, 1, 2, 3, 4]
    assert td["text"].prompt == [f"p{i}" for i in range(5)]
    assert td["text"].full == [f"p{i}r{i}" for i in range(5)]
    assert td.get(("vllm", "finish_reason")).tolist() == [
        "stop",
        "length",
        "stop",
        "length",
        "stop",
    ]
    assert td.get(("vllm", "weight_version")).tolist() == ["0"] * 5
    assert "id" not in td.keys()
    assert type(td["tokens"]).__name__ == "Tokens"
    assert type(td["text"]).__name__ == "Text"

    # Complete: opening again resumes nothing.
    done = OutputDir.open(tmp_path / "out", LAYOUT, FP)
    assert done.complete and done.remaining(2) == []


def test_samples_and_ids_load_per_sample(tmp_path):
    layout = Layout(rows=3, samples=2, prompt_width=2, max_tokens=1)
    out = OutputDir.open(tmp_path / "o", layout, FP)
    tensors, strings = fake_chunk(0, 3, layout)
    out.write_chunk(0, 3, tensors, {**strings, "id": ["a", "b", "c"]})
    td = load_output(tmp_path / "o")
    assert td.batch_size == (3, 2)
    assert td["text"].response == [["r0", "r0"], ["r1", "r1"], ["r2", "r2"]]
    assert td["text"].prompt == [["p0", "p0"], ["p1", "p1"], ["p2", "p2"]]
    assert td.get("id").tolist() == [["a", "a"], ["b", "b"], ["c", "c"]]
    assert td["row"].tolist() == [[0, 0], [1, 1], [2, 2]]


def test_data_is_never_rewritten(tmp_path):
    """data/ holds tensors only: its meta files are written once, at allocation."""
    out = OutputDir.open(tmp_path / "o", LAYOUT, FP)
    metas = {p: p.read_bytes() for p in (tmp_path / "o" / "data").rglob("meta.json")}
    out.write_chunk(0, 5, *fake_chunk(0, 5))
    load_output(tmp_path / "o")
    assert {p: p.read_bytes() for p in (tmp_path / "o" / "data").rglob("meta.json")} == metas
    assert json.loads((tmp_path / "o" / "run.json").read_text())["rows"] == 5


def test_other_run_is_refused(tmp_path):
    OutputDir.open(tmp_path / "o", LAYOUT, FP).write_chunk(0, 2, *fake_chunk(0, 2))
    assert OutputDir.open(tmp_path / "o", LAYOUT, FP).rows_done == 2  # same run: resumed
    with pytest.raises(ConfigurationError, match=r"seed: 0 there, 1 now.*--overwrite"):
        OutputDir.open(tmp_path / "o", LAYOUT, {**FP, "seed": 1})
    with pytest.raises(ConfigurationError, match=r"max_tokens: 2 there, 3 now"):
        OutputDir.open(tmp_path / "o", Layout(5, 1, 3, 3), FP)
    fresh = OutputDir.open(tmp_path / "o", LAYOUT, {**FP, "seed": 1}, overwrite=True)
    assert fresh.rows_done == 0 and chunk_files(tmp_path / "o") == []
    # An unreadable run file is refused, unless the run is discarded anyway.
    (tmp_path / "o" / "run.json").write_text("{torn")
    with pytest.raises(ConfigurationError, match=r"run.json' cannot be read.*--overwrite"):
        OutputDir.open(tmp_path / "o", LAYOUT, FP)
    assert OutputDir.open(tmp_path / "o", LAYOUT, FP, overwrite=True).rows_done == 0


def test_output_path_checks(tmp_path):
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigurationError, match=r"not empty \(\['notes.txt'\]\)"):
        OutputDir.open(tmp_path / "user", LAYOUT, FP, overwrite=True)
    assert (tmp_path / "user" / "notes.txt").read_text() == "mine"
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigurationError, match=r"not a directory"):
        OutputDir.open(tmp_path / "file", LAYOUT, FP)

    # Our own names must not lead out of the directory through a link.
    (tmp_path / "o").mkdir()
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "o" / "chunks")
    with pytest.raises(ConfigurationError, match=r"symbolic link"):
        OutputDir.open(tmp_path / "o", LAYOUT, FP)
    assert not any((tmp_path / "elsewhere").iterdir())
    with pytest.raises(ConfigurationError, match=r"outside the output directory"):
        inside(tmp_path / "o", "..", "elsewhere")


def test_chunk_roundtrip_to_output_widths(tokenizer):
    """chunk_output re-pads a policy-shaped padded result to the output's fixed widths."""
    prompts = Prompts(
        "prompt_token_ids",
        [torch.tensor([5, 6]).numpy(), torch.tensor([7]).numpy()],
        None,
        ["a", "b"],
        "d",
    )
    td = policy_input(prompts, 0, 2, pad=0, seed=10)
    assert td["tokens", "prompt"].tolist() == [[5, 6], [0, 7]]
    assert td["masks", "all_attention_mask"].tolist() == [[True, True], [False, True]]
    assert td["seed"].tolist() == [10, 11]
    # What VLLMPolicy(pad_output=True) returns for it: [lpad | prompt | response | rpad].
    result = TensorDict(
        {
            ("tokens", "prompt"): torch.tensor([[5, 6], [0, 7]]),
            ("tokens", "response"): torch.tensor([[8, 0], [9, 10]]),
            ("tokens", "full"): torch.tensor([[5, 6, 8, 0], [0, 7, 9, 10]]),
            ("masks", "all_attention_mask"): torch.tensor(
                [[True, True, True, False], [False, True, True, True]]
            ),
            ("masks", "all_assistant_mask"): torch.tensor(
                [[False, False, True, False], [False, False, True, True]]
            ),
            ("log_probs", "full"): torch.tensor(
                [[float("nan")] * 2 + [-1.0, 0.0], [0.0, float("nan"), -2.0, -3.0]]
            ),
            ("log_probs", "response"): torch.tensor([[-1.0, 0.0], [-2.0, -3.0]]),
        },
        [2],
    )
    result.set(("vllm", "weight_version"), NonTensorData("0", batch_size=[2]))
    result.set(("vllm", "finish_reason"), NonTensorStack.from_list(["stop", "length"]))
    layout = Layout(rows=2, samples=1, prompt_width=3, max_tokens=4)
    tensors, strings, n = chunk_output(result, prompts, 0, 2, layout, tokenizer, 0)
    assert n == 3
    assert tensors["tokens", "full"].tolist() == [[0, 5, 6, 8, 0, 0, 0], [0, 0, 7, 9, 10, 0, 0]]
    assert tensors["masks", "all_assistant_mask"].sum(-1).tolist() == [1, 2]
    assert tensors["masks", "all_attention_mask"].sum(-1).tolist() == [3, 3]
    lp = tensors["log_probs", "full"]
    assert lp[0, 1:3].isnan().all() and lp[0, 0] == 0.0 and lp[1, 3:5].tolist() == [-2.0, -3.0]
    assert tensors["masks", "all_attention_mask"].tolist() == [
        [False, True, True, True, False, False, False],
        [False, False, True, True, True, False, False],
    ]
    assert tensors["log_probs", "response"].tolist() == [[-1.0, 0, 0, 0], [-2.0, -3.0, 0, 0]]
    assert tensors["row"].tolist() == [0, 1]
    assert strings["id"] == ["a", "b"] and strings["finish_reason"] == ["stop", "length"]
    assert strings["weight_version"] == ["0", "0"]
    assert strings["response"] == [tokenizer.decode([8]), tokenizer.decode([9, 10])]
    assert strings["prompt"] == [tokenizer.decode([5, 6]), tokenizer.decode([7])]


def test_chunk_output_with_samples(tokenizer):
    """With G samples per row the batch is (n, G): prompt strings per row, the rest per sample."""
    prompts = Prompts("prompt", [torch.tensor([5]).numpy()], ["hi"], None, "d")
    attention = torch.tensor([[[True, True, False], [True, True, True]]])
    result = TensorDict(
        {
            ("tokens", "prompt"): torch.tensor([[[5], [5]]]),
            ("tokens", "response"): torch.tensor([[[8, 0], [9, 10]]]),
            ("tokens", "full"): torch.tensor([[[5, 8, 0], [5, 9, 10]]]),
            ("masks", "all_attention_mask"): attention,
            ("masks", "all_assistant_mask"): attention & torch.tensor([False, True, True]),
            ("log_probs", "full"): torch.zeros(1, 2, 3),
            ("log_probs", "response"): torch.zeros(1, 2, 2),
        },
        [1, 2],
    )
    result.set(("vllm", "weight_version"), NonTensorData("3", batch_size=[1, 2]))
    result.set(("vllm", "finish_reason"), NonTensorStack.from_list([["length", "stop"]]))
    layout = Layout(rows=1, samples=2, prompt_width=2, max_tokens=3)
    tensors, strings, n = chunk_output(result, prompts, 0, 1, layout, tokenizer, 0)
    assert n == 3 and tensors["tokens", "full"].shape == (1, 2, 5)
    assert tensors["tokens", "full"].tolist() == [[[0, 5, 8, 0, 0], [0, 5, 9, 10, 0]]]
    assert tensors["row"].tolist() == [[0, 0]]
    assert strings == {
        "prompt": ["hi"],
        "response": [tokenizer.decode([8]), tokenizer.decode([9, 10])],
        "weight_version": ["3", "3"],
        "finish_reason": ["length", "stop"],
    }


def test_fingerprint(model, tokenizer):
    p = read_jsonl(jsonl({"prompt": "a"}), tokenizer)
    a = fingerprint(p, GenerateOptions(), str(model), "float32")
    assert a == fingerprint(p, GenerateOptions(chunk_size=3), str(model), "float32")
    assert a != fingerprint(p, GenerateOptions(temperature=0.5), str(model), "float32")
    assert a != fingerprint(p, GenerateOptions(), str(model), "bfloat16")


@pytest.mark.usefixtures("restore_logging")
def test_cli_errors_exit_2_before_any_launch(tmp_path, model, capsys):
    from torchrl_vllm_ext.cli import main

    good = tmp_path / "in.jsonl"
    good.write_text('{"prompt": "hello"}\n')
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{oops\n')
    out = tmp_path / "out"
    cases = [
        (["--model", str(model), "--input", str(bad)], "bad.jsonl line 2 is not valid JSON"),
        (["--model", str(tmp_path), "--input", str(good)], "no config.json"),
        (["--model", str(tmp_path / "gone"), "--input", str(good)], "is not a local directory"),
        (["--model", str(model), "--input", str(tmp_path / "x.jsonl")], "does not exist"),
        (
            ["--model", str(model), "--input", str(good), "--max-tokens", "5000"],
            "the context length 2048",
        ),
        (["--model", str(model), "--input", str(good), "--top-p", "0"], "--top-p=0.0"),
    ]
    for argv, message in cases:
        assert main(["generate", *argv, "--output", str(out)]) == 2
        assert message in capsys.readouterr().err
    assert not out.exists()  # nothing is written before the input and arguments check out

"""torchrl-vllm generate: prompts in, samples out as a memory-mapped TensorDict; resumable.

    torchrl-vllm generate --model MODEL_DIR --input prompts.jsonl --output OUT_DIR \
        [--max-tokens 64] [--temperature 1.0] [--num-samples 1] [--seed 0] [--chunk-size 64]

Input: a JSONL file of {"prompt": "text"}, {"messages": [...]} (chat template with the
generation prompt) or {"prompt_token_ids": [...]} lines, all of one kind, each with an
optional unique "id"; or a memory-mapped TensorDict directory with int token ids under
("tokens", "prompt") (and ("masks", "all_attention_mask") if padded).

Output: one TensorDict of batch (N,) ((N, G) with --num-samples G) in TorchRL's padded
LLM layout, its tensors memory-mapped in OUT_DIR/data; read it in Python with
torchrl_vllm_ext.load_output(OUT_DIR). Each chunk of --chunk-size rows is committed once
written: a killed run resumes with the same command and redoes no finished row. Row i is
seeded with --seed + i, so the output does not depend on chunking, replicas or
interruptions. Another run in the same directory is refused (pick a new --output or pass
--overwrite). The last line printed is a JSON summary.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from dataclasses import dataclass, fields
from pathlib import Path

from torchrl_vllm_ext.engine.placement import PLACEMENTS
from torchrl_vllm_ext.errors import ConfigurationError, InvalidRequestError
from torchrl_vllm_ext.hf import load_tokenizer, max_positions, model_dir, pad_token_id
from torchrl_vllm_ext.jobs.flags import add_config_flags, config_from_args


@dataclass
class GenerateOptions:
    """How rows are generated; each field is the ``--flag`` of its name."""

    max_tokens: int = 64
    """tokens generated per sample at most (the width of tokens.response)"""
    temperature: float = 1.0
    """sampling temperature; 0 is greedy"""
    top_p: float = 1.0
    """nucleus sampling mass"""
    num_samples: int = 1
    """samples per prompt G (also -n); G > 1 gives the output a second batch dim"""
    seed: int = 0
    """row i is sampled with seed + i"""
    chunk_size: int = 64
    """rows per policy call and per committed chunk"""

    def __post_init__(self):
        for name, ok, rule in (
            ("max_tokens", self.max_tokens >= 1, "an integer >= 1"),
            ("num_samples", self.num_samples >= 1, "an integer >= 1"),
            ("chunk_size", self.chunk_size >= 1, "an integer >= 1"),
            ("temperature", math.isfinite(self.temperature) and self.temperature >= 0, ">= 0"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
            ("seed", self.seed >= 0, ">= 0"),
        ):
            if not ok:
                flag = "--" + name.replace("_", "-")
                raise ConfigurationError(f"{flag}={getattr(self, name)!r} must be {rule}.")


FLAGS = {f.name: "--" + f.name.replace("_", "-") for f in fields(GenerateOptions)}


def add_parser(sub):
    p = sub.add_parser(
        "generate",
        help="generate for a JSONL / memmapped TensorDict of prompts into a memmapped TensorDict",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = p.add_argument
    add("--model", required=True, help="local Hugging Face model directory")
    add("--input", required=True, help="JSONL file or memmapped TensorDict directory")
    add("--output", required=True, help="output directory (created, or resumed)")
    add("--replicas", type=int, default=1, help="vLLM replicas (default 1)")
    add("--cpus-per-replica", type=float, help="CPUs reserved per replica without GPUs (1)")
    add("--ray-address", help="Ray cluster to join (head's host:port); default: a local one")
    add("--placement", default="any", choices=PLACEMENTS, help="replicas' nodes (any)")
    dtypes = ("auto", "float32", "bfloat16", "float16")
    add("--dtype", default="auto", choices=dtypes, help="engine dtype (default auto)")
    add("--max-model-len", type=int, help="engine context (default: longest prompt + tokens)")
    add_config_flags(p, GenerateOptions, FLAGS)
    add("-n", dest="num_samples", type=int, default=argparse.SUPPRESS, help="--num-samples")
    add("--overwrite", action="store_true", help="discard a run in --output, do not resume it")
    add("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
    return p


def run(args, service=None) -> int:
    """The command: 0, or 130 when interrupted (typed errors go to ``cli.main``). A running
    ``service`` on ``args.model`` is used instead of launching one; the caller owns it."""
    from torchrl_vllm_ext.jobs.generate_io import read_prompts
    from torchrl_vllm_ext.jobs.generate_store import Layout, OutputDir
    from torchrl_vllm_ext.jobs.logs import job_log_file

    options = config_from_args(GenerateOptions, args, FLAGS)
    model = model_dir(args.model, "--model")
    limit = max_positions(model, "--model")
    tokenizer = load_tokenizer(model, "--model")
    prompts = read_prompts(args.input, tokenizer, pad_token_id(tokenizer))
    check_fits(prompts, min(args.max_model_len or limit, limit), options.max_tokens)
    served = (model, args.dtype)  # the fingerprint names what is served
    if service is not None:
        served = (service.config.model, service.config.engine_kwargs.get("dtype", "auto"))
    # The output directory is checked (or started) before paying for an engine launch.
    width = int(prompts.lengths.max())
    layout = Layout(len(prompts), options.num_samples, width, options.max_tokens)
    fp = fingerprint(prompts, options, *served)
    out = OutputDir.open(args.output, layout, fp, overwrite=args.overwrite)
    rows_before, tokens, seconds = out.rows_done, 0, 0.0
    try:
        if service is not None and not out.complete:
            tokens, seconds = generate_into(service, out, prompts, tokenizer, options, args)
        elif not out.complete:
            from torchrl_vllm_ext import VLLMService

            with VLLMService.launch(
                model,
                num_replicas=args.replicas,
                cpus_per_replica=args.cpus_per_replica,
                ray_address=args.ray_address,
                placement=args.placement,
                dtype=args.dtype,
                max_model_len=args.max_model_len or width + options.max_tokens,
                enforce_eager=True,
                seed=options.seed,
                log_file=None if args.verbose else job_log_file(out.root),
            ) as svc:
                tokens, seconds = generate_into(svc, out, prompts, tokenizer, options, args)
    except KeyboardInterrupt:
        print("generate: interrupted; run the same command again to resume.", file=sys.stderr)
        return 130
    summary = {
        "rows": len(prompts),
        "samples_per_row": options.num_samples,
        "rows_generated": len(prompts) - rows_before,
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 1) if seconds > 0 else 0.0,
        "output": str(out.root),
    }
    print(json.dumps(summary), flush=True)
    return 0


def generate_into(service, out, prompts, tokenizer, options: GenerateOptions, args):
    """Generate the rows of ``prompts`` that ``out`` lacks; ``(tokens, seconds)``."""
    from tqdm.auto import tqdm

    from torchrl_vllm_ext import VLLMPolicy
    from torchrl_vllm_ext.jobs.generate_io import policy_input
    from torchrl_vllm_ext.jobs.generate_store import chunk_output
    from torchrl_vllm_ext.wrappers.inputs import check_vocab

    check_fits(prompts, service.max_model_len, options.max_tokens)
    # Every row is checked before the first chunk: a fix of the input changes its
    # fingerprint, so a late refusal would cost the finished chunks.
    check_vocab(prompts.token_ids, "prompt_token_ids", service.max_token_id)
    pad, g = pad_token_id(tokenizer), options.num_samples
    params = {"max_tokens": options.max_tokens, "top_p": options.top_p}
    policy = VLLMPolicy(
        service,
        input_mode="tokens",
        pad_output=True,
        num_samples=g if g > 1 else None,
        sampling_params={**params, "temperature": options.temperature},
        pad_token_id=pad,
    )
    tokens, start = 0, time.perf_counter()
    bar = tqdm(total=len(prompts), initial=out.rows_done, unit="row", desc="generate",
               file=sys.stderr, disable=args.no_progress, dynamic_ncols=True)  # fmt: skip
    with bar:
        for lo, hi in out.remaining(options.chunk_size):
            result = policy(policy_input(prompts, lo, hi, pad, options.seed))
            tensors, strings, n = chunk_output(result, prompts, lo, hi, out.layout, tokenizer, pad)
            out.write_chunk(lo, hi, tensors, strings)
            tokens += n
            bar.update(hi - lo)
            bar.set_postfix(tok_s=f"{tokens / max(time.perf_counter() - start, 1e-9):.0f}")
    return tokens, time.perf_counter() - start


def fingerprint(prompts, options: GenerateOptions, model, dtype: str) -> dict:
    """What must not change between a run and its resumption."""
    root, h = Path(model).resolve(), hashlib.sha256()
    # Sizes and times of the model's files: a retrained model at the same path differs.
    for f in sorted(p for p in root.iterdir() if p.is_file()):
        h.update(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns};".encode())
    return {
        "input": prompts.digest,
        "model": str(root),
        "model_files": h.hexdigest(),
        "dtype": str(dtype),
        "temperature": options.temperature,
        "top_p": options.top_p,
        "seed": options.seed,
    }


def check_fits(prompts, max_model_len: int | None, max_tokens: int) -> None:
    """Every prompt plus ``max_tokens`` must fit the engine's context."""
    row = int(prompts.lengths.argmax())
    n = int(prompts.lengths[row])
    if max_model_len is not None and n + max_tokens > max_model_len:
        raise InvalidRequestError(
            f"input row {row} has {n} prompt tokens; with --max-tokens {max_tokens} it needs "
            f"{n + max_tokens} > the context length {max_model_len}. Lower --max-tokens, shorten "
            "the prompt, or raise --max-model-len (up to the model's limit)."
        )

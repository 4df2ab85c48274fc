"""``torchrl-vllm generate``: TensorDict in, TensorDict out, resumable.

::

    torchrl-vllm generate --model MODEL_DIR --input prompts.jsonl --output OUT_DIR \\
        [--max-tokens 64] [--temperature 1.0] [--num-samples 1] [--seed 0] [--chunk-size 64]

Inputs (:mod:`.generate_io`): a JSONL file of ``{"prompt": ...}``, ``{"messages": [...]}``
or ``{"prompt_token_ids": [...]}`` lines (optional ``"id"``), or the directory of a
memory-mapped TensorDict with token ids under ``("tokens", "prompt")``.

Output (:mod:`.generate_store`): ``generate_store.load_output(OUT_DIR)`` (or
``TensorDict.load_memmap(OUT_DIR / "data")`` after ``import torchrl.modules.llm.policies``), batch
``(N,)`` (``(N, G)`` with ``--num-samples G > 1``), in TorchRL's padded LLM layout:
``tokens`` (prompt left-padded to the longest prompt, response right-padded to
``--max-tokens``, full = prompt ++ response), ``log_probs`` (response; full with NaN at
prompt positions and 0.0 at padding), ``masks`` (attention, assistant), ``text`` (prompt
as given or chat-templated, response decoded by the tokenizer with special tokens kept),
``("vllm", "weight_version")``, ``("vllm", "finish_reason")``, ``row`` (input row
index) and ``id`` (when the input has ids).

Rows go through :class:`~torchrl_vllm_ext.VLLMPolicy` in tokens mode, ``--chunk-size`` at
a time; each finished chunk is written in place and then recorded in
``OUT_DIR/progress.json``, so a killed run resumes with the same command and redoes no
finished row. Every request is seeded with ``--seed`` + its row index, so the output does
not depend on chunking, replicas or interruptions. A run with other inputs or settings
in the same directory is refused (pick a new ``--output`` or pass ``--overwrite``).

The last stdout line is a JSON summary: rows, tokens, seconds, tokens/s, output path.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class GenerateOptions:
    """How rows are generated and stored."""

    max_tokens: int = 64
    """Tokens generated per sample at most (the width of ``tokens.response``)."""
    temperature: float = 1.0
    """Sampling temperature; 0 is greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    num_samples: int = 1
    """Samples per prompt ``G``; ``G > 1`` gives the output a second batch dim."""
    seed: int = 0
    """Row ``i`` is sampled with seed ``seed + i``."""
    chunk_size: int = 64
    """Rows per policy call and per progress record."""
    overwrite: bool = False
    """Discard a run already in the output directory instead of resuming it."""
    progress: bool = True
    """Show a progress bar on stderr."""

    def __post_init__(self):
        from torchrl_vllm_ext.errors import ConfigurationError

        for name in ("max_tokens", "num_samples", "chunk_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                flag = "--" + name.replace("_", "-")
                raise ConfigurationError(f"{flag}={value!r} must be an integer >= 1.")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ConfigurationError(
                f"--temperature={self.temperature!r} must be >= 0 (0 is greedy)."
            )
        if not 0 < self.top_p <= 1:
            raise ConfigurationError(f"--top-p={self.top_p!r} must be in (0, 1].")
        if self.seed < 0:
            raise ConfigurationError(f"--seed={self.seed!r} must be >= 0.")


# ---------------------------------------------------------------------------- CLI
def add_parser(sub):
    p = sub.add_parser(
        "generate",
        help="generate for a JSONL / memmapped TensorDict of prompts into a memmapped TensorDict",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, help="local Hugging Face model directory")
    p.add_argument("--input", required=True, help="JSONL file or memmapped TensorDict directory")
    p.add_argument("--output", required=True, help="output directory (created, or resumed)")
    p.add_argument("--replicas", type=int, default=1, help="vLLM replicas (default 1)")
    p.add_argument(
        "--cpus-per-replica",
        type=float,
        default=None,
        help="CPUs reserved per replica without GPUs (default 1; fractions allowed)",
    )
    p.add_argument("--dtype", default="auto", choices=DTYPES, help="engine dtype (default auto)")
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="engine context length (default: longest prompt + --max-tokens)",
    )
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per sample at most (64)")
    p.add_argument("--temperature", type=float, default=1.0, help="0 is greedy (default 1.0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1.0)")
    p.add_argument("--num-samples", "-n", type=int, default=1, help="samples per prompt (1)")
    p.add_argument("--seed", type=int, default=0, help="row i is seeded with seed + i (0)")
    p.add_argument("--chunk-size", type=int, default=64, help="rows per progress record (64)")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="discard a run already in --output instead of resuming it",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
    return p


def run(args, service=None) -> int:
    """The ``generate`` command: 0 on success, 2 on a typed error, 130 when interrupted.

    ``service`` (a running :class:`~torchrl_vllm_ext.VLLMService` on ``args.model``) is
    used instead of launching one; the caller keeps owning it.
    """
    from torchrl_vllm_ext.errors import TorchRLVLLMError

    try:
        summary = _run(args, service)
    except TorchRLVLLMError as e:
        print(f"torchrl-vllm generate: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            "torchrl-vllm generate: interrupted; run the same command again to resume.",
            file=sys.stderr,
        )
        return 130
    print(json.dumps(summary), flush=True)
    return 0


def _run(args, service) -> dict:
    from torchrl_vllm_ext.jobs.generate_io import read_prompts

    options = GenerateOptions(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        num_samples=args.num_samples,
        seed=args.seed,
        chunk_size=args.chunk_size,
        overwrite=args.overwrite,
        progress=not args.no_progress,
    )
    model, max_positions = check_model(args.model)
    tokenizer = load_tokenizer(model)
    prompts = read_prompts(args.input, tokenizer, pad_id(tokenizer))
    needed = int(prompts.lengths.max()) + options.max_tokens
    check_fits(prompts, min(args.max_model_len or max_positions, max_positions), options)
    if service is not None:
        return generate_to_dir(service, prompts, args.output, tokenizer, options)

    # Check (or start) the output directory before paying for an engine launch.
    out = open_output(args.output, prompts, options, model, args.dtype)
    if out.complete:
        logger.info("%s is already complete; nothing to generate", out.root)
        return _summary(out, options, 0, 0, 0.0)
    options.overwrite = False  # the directory is fresh (or resumable) now
    from torchrl_vllm_ext import VLLMService

    with VLLMService.launch(
        model,
        num_replicas=args.replicas,
        cpus_per_replica=args.cpus_per_replica,
        dtype=args.dtype,
        max_model_len=args.max_model_len or needed,
        enforce_eager=True,
        seed=args.seed,
    ) as svc:
        return generate_to_dir(svc, prompts, args.output, tokenizer, options)


# ---------------------------------------------------------------------------- the job
def generate_to_dir(service, prompts, output_dir, tokenizer, options: GenerateOptions) -> dict:
    """Generate every row of ``prompts`` not yet in ``output_dir``; return the summary.

    Args:
        service: a running :class:`~torchrl_vllm_ext.VLLMService`.
        prompts: :class:`~torchrl_vllm_ext.jobs.generate_io.Prompts` (from ``read_prompts``).
        output_dir: the output directory, created or resumed.
        tokenizer: the served model's tokenizer (decodes the text fields).
        options: :class:`GenerateOptions`.

    Examples:
        >>> from torchrl_vllm_ext.jobs.generate import GenerateOptions, generate_to_dir
        >>> from torchrl_vllm_ext.jobs.generate_io import read_prompts
        >>> prompts = read_prompts("prompts.jsonl", tokenizer)  # doctest: +SKIP
        >>> generate_to_dir(svc, prompts, "out", tokenizer, GenerateOptions(max_tokens=8))  # doctest: +SKIP
        {'rows': 3, 'samples_per_row': 1, 'rows_generated': 3, 'tokens': 24, ...}
    """
    from tqdm.auto import tqdm

    from torchrl_vllm_ext import VLLMPolicy
    from torchrl_vllm_ext.jobs import generate_chunks
    from torchrl_vllm_ext.wrappers.inputs import check_vocab

    check_fits(prompts, service.max_model_len, options)
    check_vocab(prompts.token_ids, "prompt_token_ids", service.max_token_id)
    engine = service.config
    out = open_output(
        output_dir, prompts, options, engine.model, engine.engine_kwargs.get("dtype", "auto")
    )
    pad = pad_id(tokenizer)
    policy = VLLMPolicy(
        service,
        input_mode="tokens",
        pad_output=True,
        num_samples=options.num_samples if options.num_samples > 1 else None,
        sampling_params={
            "max_tokens": options.max_tokens,
            "temperature": options.temperature,
            "top_p": options.top_p,
        },
        pad_token_id=pad,
    )
    chunks = out.remaining(options.chunk_size)
    rows_before = out.rows_done
    tokens, start = 0, time.perf_counter()
    with tqdm(
        total=len(prompts),
        initial=rows_before,
        unit="row",
        desc="generate",
        file=sys.stderr,
        disable=not options.progress,
        dynamic_ncols=True,
    ) as bar:
        for lo, hi in chunks:
            td = generate_chunks.policy_input(prompts, lo, hi, pad, options.seed)
            result = policy(td)
            tensors, strings, n_tok = generate_chunks.chunk_output(
                result, prompts, lo, hi, out.layout, tokenizer, pad
            )
            out.write_chunk(lo, hi, tensors, strings, n_tok)
            tokens += n_tok
            bar.update(hi - lo)
            bar.set_postfix(tok_s=f"{tokens / max(time.perf_counter() - start, 1e-9):.0f}")
    seconds = time.perf_counter() - start
    out.finish()
    return _summary(out, options, len(prompts) - rows_before, tokens, seconds)


def open_output(output_dir, prompts, options: GenerateOptions, model: str, dtype: str):
    """The output directory for this run (resumed when the fingerprint matches)."""
    from torchrl_vllm_ext.jobs.generate_store import Layout, OutputDir

    layout = Layout(
        rows=len(prompts),
        samples=options.num_samples,
        prompt_width=int(prompts.lengths.max()),
        max_tokens=options.max_tokens,
    )
    return OutputDir.open(
        output_dir,
        layout,
        fingerprint(prompts, options, model, dtype),
        overwrite=options.overwrite,
    )


def fingerprint(prompts, options: GenerateOptions, model: str, dtype: str) -> dict[str, Any]:
    """What must not change between a run and its resumption."""
    import hashlib

    root = Path(model).resolve()
    h = hashlib.sha256()
    # Sizes and times of the model's files: a retrained model at the same path differs.
    for f in sorted(p for p in root.iterdir() if p.is_file()):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns};".encode())
    return {
        "input": prompts.digest,
        "input_kind": prompts.kind,
        "model": str(root),
        "model_files": h.hexdigest(),
        "dtype": str(dtype),
        "temperature": options.temperature,
        "top_p": options.top_p,
        "seed": options.seed,
    }


def _summary(out, options, rows_generated: int, tokens: int, seconds: float) -> dict:
    return {
        "rows": out.layout.rows,
        "samples_per_row": options.num_samples,
        "rows_generated": rows_generated,
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 1) if seconds > 0 else 0.0,
        "output": str(out.data_path),
    }


# ---------------------------------------------------------------------------- checks
def check_model(path: str) -> tuple[str, int]:
    """The model directory (resolved) and its context limit; typed errors otherwise."""
    from torchrl_vllm_ext.errors import ConfigurationError

    root = Path(path).expanduser()
    config = root / "config.json"
    if not root.is_dir() or not config.is_file():
        raise ConfigurationError(
            f"--model {path!r} is not a model directory (no config.json there); pass the local "
            "folder of a Hugging Face causal LM (config.json, weights, tokenizer)."
        )
    try:
        cfg = json.loads(config.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigurationError(
            f"--model {path!r}: config.json cannot be read ({e}); check the file and its "
            "permissions."
        ) from None
    text_cfg = cfg.get("text_config", cfg)
    limit = text_cfg.get("max_position_embeddings") or cfg.get("max_position_embeddings")
    return str(root.resolve()), int(limit) if limit else 2**31 - 1


def load_tokenizer(model: str):
    from transformers import AutoTokenizer

    from torchrl_vllm_ext.errors import ConfigurationError

    try:
        return AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError) as e:
        raise ConfigurationError(
            f"--model {model!r}: its tokenizer cannot be loaded ({e}); the folder needs the "
            "tokenizer files (tokenizer.json / tokenizer_config.json)."
        ) from None


def pad_id(tokenizer) -> int:
    pad = tokenizer.pad_token_id
    return tokenizer.eos_token_id if pad is None else pad


def check_fits(prompts, max_model_len: int | None, options: GenerateOptions) -> None:
    """Every prompt plus ``max_tokens`` must fit the engine's context."""
    from torchrl_vllm_ext.errors import InvalidRequestError

    if max_model_len is None:
        return
    lengths = prompts.lengths
    row = int(lengths.argmax())
    if int(lengths[row]) + options.max_tokens > max_model_len:
        raise InvalidRequestError(
            f"input row {row} has {int(lengths[row])} prompt tokens; with --max-tokens "
            f"{options.max_tokens} it needs {int(lengths[row]) + options.max_tokens} > the "
            f"context length {max_model_len}. Lower --max-tokens, shorten the prompt, or raise "
            "--max-model-len (up to the model's limit)."
        )

"""The ``torchrl-vllm`` command line.

``demo``: launch the replica service on a tiny local model and generate (the GRPO
training job will replace it).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

logger = logging.getLogger("torchrl_vllm_ext.cli")

DEMO_PROMPTS = [
    "hello world",
    "the cat and the dog",
    "count one two three",
    "reverse the list",
]


def _demo(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from torchrl_vllm_ext import VLLMService
    from torchrl_vllm_ext.testing import make_tiny_model

    model = args.model or str(make_tiny_model(seed=args.seed))
    tokenizer = AutoTokenizer.from_pretrained(model)
    chats = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True
        )
        for p in DEMO_PROMPTS
    ]
    prompts = [list(c["input_ids"] if hasattr(c, "keys") else c) for c in chats]
    params = {"max_tokens": args.max_tokens, "n": args.n, "temperature": 1.0, "seed": args.seed}
    with VLLMService.launch(
        model,
        num_replicas=args.replicas,
        cpus_per_replica=args.cpus_per_replica,
        max_model_len=512,
        seed=args.seed,
    ) as svc:
        svc.generate(prompts, params)  # warm-up
        start = time.perf_counter()
        outs = svc.generate(prompts * args.repeat, params)
        elapsed = time.perf_counter() - start
        tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
        for prompt, out in zip(DEMO_PROMPTS, outs, strict=False):
            sample = out.outputs[0]
            mean_lp = sum(sample.logprobs.logprobs) / max(1, len(sample.token_ids))
            print(f"{prompt!r:>24} -> {sample.text[:48]!r}  (mean log-prob {mean_lp:.2f})")
        summary = {
            "replicas": svc.num_replicas,
            "requests": len(outs),
            "samples": sum(len(o.outputs) for o in outs),
            "tokens": tokens,
            "seconds": round(elapsed, 3),
            "tokens_per_s": round(tokens / elapsed, 1),
            "stats": [s.__dict__ for s in svc.stats()],
        }
    print(json.dumps(summary, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="torchrl-vllm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="launch vLLM replicas on a tiny model and generate")
    demo.add_argument(
        "--model", default=None, help="local HF model directory (default: a tiny random model)"
    )
    demo.add_argument("--replicas", type=int, default=2)
    demo.add_argument("--cpus-per-replica", type=float, default=None)
    demo.add_argument("--max-tokens", type=int, default=32)
    demo.add_argument("-n", type=int, default=4, help="samples per prompt")
    demo.add_argument(
        "--repeat", type=int, default=16, help="copies of the prompt set in the timed batch"
    )
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

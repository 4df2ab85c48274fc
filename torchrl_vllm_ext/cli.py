"""torchrl-vllm: TorchRL jobs on vLLM replicas.

Train a model with GRPO (demo), generate for a file of prompts (generate), run the
benchmarks (bench), check that a model is served and synced exactly (check-model), or
list and clean up what the package left on this machine (doctor). Run
"torchrl-vllm COMMAND --help" for the options of a command.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from torchrl_vllm_ext.jobs.logs import LOG_FILE_NAME, job_log_file, setup_logging

JOBS = ("demo", "generate", "bench", "doctor", "check_model")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="torchrl-vllm",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in JOBS:
        job = importlib.import_module(f"torchrl_vllm_ext.jobs.{name}").add_parser(sub)
        job.add_argument(
            "-v",
            "--verbose",
            action="store_true",
            help="show every log line (vLLM, Ray, the replicas) on the terminal; by default "
            f"they go to {LOG_FILE_NAME} in the output directory",
        )
    return parser


def run(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the job; typed errors propagate (for scripts and tests)."""
    args = build_parser().parse_args(argv)
    setup_logging(
        job_log_file(getattr(args, "output", None)), verbose=args.verbose, level=args.log_level
    )
    return args.func(args)


def main(argv: list[str] | None = None) -> int:
    """The console entry point: a typed error prints its message (value and fix), exit 2."""
    from torchrl_vllm_ext.errors import TorchRLVLLMError

    try:
        return run(argv)
    except TorchRLVLLMError as err:
        print(f"torchrl-vllm: error: {type(err).__name__}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

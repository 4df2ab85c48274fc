"""torchrl-vllm bench (being written)."""


def add_parser(sub):
    p = sub.add_parser("bench", help="(being written)")
    p.set_defaults(func=lambda args: 2)
    return p

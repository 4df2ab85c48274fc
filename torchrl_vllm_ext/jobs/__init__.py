"""The jobs behind the ``torchrl-vllm`` command: one module per subcommand.

Each module exposes ``add_parser(subparsers)`` (registers its flags and sets ``func``)
and keeps its heavy imports (vLLM, Ray, TorchRL) inside the job function, so
``torchrl-vllm --help`` is instant.
"""

"""How a vLLM worker puts received tensors into the served model (runs in the worker process):
:mod:`.loads` (stage before the pause, load in it), :mod:`.staging` (where a GPU worker stages),
:mod:`.planned` (a worker's load plans by layout), :mod:`.plan` and :mod:`.recorder` (the load
plan and the recorder that traces it)."""

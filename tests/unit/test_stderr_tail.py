"""Reading an engine-core process's error back from the replica's stderr file."""

from __future__ import annotations

import os
import subprocess
import sys

from torchrl_vllm_ext.engine.replica.stderr_tail import StderrMark, explain, last_exception

ENGINE_CORE_DEATH = """\
(EngineCore_DP0 pid=4242) Process EngineCore_DP0:
Traceback (most recent call last):
  File "vllm/v1/engine/core.py", line 1482, in run_engine_core
    engine_core = EngineCoreProc(*args, engine_index=dp_rank, **kwargs)
  File "vllm/v1/core/kv_cache_utils.py", line 1010, in _check_enough_kv_cache_memory
    raise ValueError(
(EngineCore_DP0 pid=4242) ValueError: To serve at least one request with the models's max seq len (8192), (1.5 GiB KV cache is needed, which is larger than the available KV cache memory (0.9 GiB). Try increasing `gpu_memory_utilization` or decreasing `max_model_len`.
"""
OUTER = (
    "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}"
)


def test_the_last_exception_line_wins_and_the_outer_error_is_skipped():
    text = "torch.OutOfMemoryError: CUDA out of memory\n" + ENGINE_CORE_DEATH + OUTER + "\n"
    found = last_exception(text)
    assert found.startswith("ValueError: To serve at least one request")
    assert "decreasing `max_model_len`" in found
    assert last_exception("torch.OutOfMemoryError: CUDA out of memory.\n") == (
        "torch.OutOfMemoryError: CUDA out of memory."
    )
    assert last_exception("INFO all good\nloaded 3 layers\n") is None
    ray_worker = "ray.exceptions.RayTaskError(OutOfMemoryError): ray::RayWorkerWrapper() (pid=9)"
    assert last_exception(ENGINE_CORE_DEATH + ray_worker + "\n" + OUTER) == ray_worker


def run_with_stderr_file(tmp_path, code: str) -> str:
    """Run ``code`` in a child whose stderr is a file (as a Ray worker's is); its stdout."""
    log = tmp_path / "worker.err"
    log.write_text("an earlier replica's lines\nValueError: not this one\n")
    with open(log, "a") as err:
        done = subprocess.run(
            [sys.executable, "-c", code],
            stderr=err,
            stdout=subprocess.PIPE,
            text=True,
            check=True,
            env={**os.environ, "PYTHONPATH": os.getcwd()},
        )
    return done.stdout


def test_a_mark_reads_only_what_a_child_wrote_after_it(tmp_path):
    code = f"""
import subprocess, sys
from torchrl_vllm_ext.engine.replica.stderr_tail import StderrMark, explain
mark = StderrMark()
# the engine core: a child process inheriting stderr, dying with a traceback
subprocess.run([sys.executable, "-c", {ENGINE_CORE_DEATH!r} and "raise ValueError('KV cache too small')"])
print(explain({OUTER!r}, mark))
print(explain("ValueError: a plain cause", mark))
"""
    explained, plain = run_with_stderr_file(tmp_path, code).splitlines()
    assert explained.startswith("ValueError: KV cache too small (in vLLM's engine-core process")
    assert "See root cause above" in explained
    assert plain == "ValueError: a plain cause"


def test_a_stderr_that_is_no_file_gives_the_cause_unchanged():
    r, w = os.pipe()
    try:
        mark = StderrMark(fd=w)
        assert mark.path is None and mark.written_since() == ""
        assert explain(OUTER, mark) == OUTER
    finally:
        os.close(r)
        os.close(w)

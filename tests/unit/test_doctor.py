"""``torchrl-vllm doctor`` on a temp directory: lists our directories with their owners,
``--clean`` removes only those whose owner is dead."""

from __future__ import annotations

import os
import subprocess
import sys

from torchrl_vllm_ext import leftovers
from torchrl_vllm_ext.cli import build_parser


def run(argv: list[str]) -> int:
    """The subcommand as the command line parses it (without its logging set-up)."""
    args = build_parser().parse_args(argv)
    return args.func(args)


def dead_owner() -> leftovers.Owner:
    """An owner that ran and exited (its pid is gone or names a later process)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    start = leftovers.process_start(proc.pid) or 1.0
    proc.wait()
    return leftovers.Owner(proc.pid, start, leftovers.Owner.me().host)


def test_doctor_lists_and_cleans_only_the_dead(tmp_path, capsys):
    mine = leftovers.owned_dir("torchrl-vllm-weights-", tmp_path)
    (mine / "slot-A").mkdir()
    (mine / "slot-A" / "w.memmap").write_bytes(b"x" * 1000)
    dead = tmp_path / "torchrl-vllm-weights-dead"
    dead.mkdir()
    leftovers.mark(dead, dead_owner())
    reused = tmp_path / "torchrl-vllm-adapters-reused"  # the pid lives, started earlier
    reused.mkdir()
    me = leftovers.Owner.me()
    leftovers.mark(reused, leftovers.Owner(me.pid, me.start - 100.0, me.host))
    elsewhere = tmp_path / "torchrl-vllm-weights-elsewhere"
    elsewhere.mkdir()
    leftovers.mark(elsewhere, leftovers.Owner(1, 0.0, "another-host"))
    unmarked = tmp_path / "torchrl-vllm-weights-old"
    unmarked.mkdir()
    foreign = tmp_path / "not-ours"
    foreign.mkdir()

    assert run(["doctor", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "directories of ours" in out and ": 5" in out.splitlines()[0]
    assert f"owner pid {os.getpid()}" in out and "alive" in out and "dead" in out
    assert "no owner recorded" in out and "not-ours" not in out
    assert "doctor --clean" in out
    assert all(p.exists() for p in (mine, dead, reused, elsewhere, unmarked, foreign))

    assert run(["doctor", "--dir", str(tmp_path), "--clean"]) == 0
    out = capsys.readouterr().out
    assert "removed 2 directories" in out
    assert not dead.exists() and not reused.exists()
    assert all(p.exists() for p in (mine, elsewhere, unmarked, foreign))
    leftovers.remove_owned(mine)
    assert not mine.exists()


def test_an_owner_that_is_a_zombie_counts_as_dead(tmp_path):
    # A killed replica stays a zombie until its parent reaps it: its directory is reapable.
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        start = leftovers.process_start(proc.pid) or 1.0
        owner = leftovers.Owner(proc.pid, start, leftovers.Owner.me().host)
        zombie = tmp_path / "torchrl-vllm-replica-tmp-zombie"
        zombie.mkdir()
        leftovers.mark(zombie, owner)
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped
        assert not owner.alive()
        assert leftovers.reap(tmp_path) == [zombie]
    finally:
        proc.wait()


def test_an_adopted_temp_dir_leaves_torchs_compile_caches_machine_wide():
    # A replica adopts its own temporary directory; torch's inductor cache and its C++
    # precompiled headers must stay where every start finds them (rebuilt: +5 s a start).
    code = (
        "from torchrl_vllm_ext import leftovers\n"
        "path = str(leftovers.adopt_tempdir('torchrl-vllm-test-tmp-'))\n"
        "from torch._inductor import codecache\n"
        "from torch._inductor.runtime.cache_dir_utils import cache_dir\n"
        "print(path not in codecache._HEADER_DIR and path not in cache_dir())\n"
        "leftovers.remove_owned(path)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == "True"


NAMED_SEMAPHORES = """
import multiprocessing, sys
from multiprocessing import synchronize, util
multiprocessing.set_start_method("spawn")  # as in vLLM's engine core under Ray
from torchrl_vllm_ext import leftovers
if sys.argv[1] == "thread":
    assert leftovers.thread_only_progress_lock()
    assert not leftovers.thread_only_progress_lock()  # kept: it has one now
from tqdm.auto import tqdm
for _ in tqdm(range(2), disable=True):  # a bar takes the lock, shown or not
    pass
print(sum(getattr(f, "_callback", None) is synchronize.SemLock._cleanup
          for f in util._finalizer_registry.values()))
"""


def test_progress_bars_in_a_spawned_process_name_no_semaphore_with_the_thread_lock():
    """A named semaphore is what a killed engine-core process leaves in /dev/shm."""
    counts = {
        lock: subprocess.run(
            [sys.executable, "-c", NAMED_SEMAPHORES, lock],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()[-1]
        for lock in ("default", "thread")
    }
    assert counts == {"default": "1", "thread": "0"}

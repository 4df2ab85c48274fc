"""TrainerRanks: ranks 1..N-1 of a trainer, spawned by rank 0 and joined to its gloo group.

Rank 0 is the process that builds :class:`TrainerRanks` (the job's, which also holds the
service). It serves a ``TCPStore`` on the loopback only (a port the system picks: no race for a
free one), spawns the other ranks (multiprocessing's spawn context: no fork of a process
running Ray's and the service's threads), waits until each one reached the store, checking
that none died on the way, and only then joins the process group itself: a rank that fails
to import or to load its model is named at once, not after gloo's 30 minutes.

One owner of their lifetime (``close`` / ``with``): on success the ranks are joined (they
were told to stop by their protocol, :mod:`.data_parallel`), on an error or an interrupt
they are terminated (then killed); the process group is destroyed either way. A rank that
fails posts its traceback to the store; rank 0 raises :class:`TrainerRankError` naming it.
"""

from __future__ import annotations

import logging
import multiprocessing
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from torchrl_vllm_ext.errors import TorchRLVLLMError, TrainerRankError
from torchrl_vllm_ext.listening import serve_store

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"
POLL_S = 0.05
"""Seconds between two looks at the ranks while they start."""
GROUP_TIMEOUT = timedelta(minutes=30)
"""gloo's wait for a collective: rank 0 may launch replicas while the others wait."""


def _arrived(rank: int) -> str:
    return f"arrived/{rank}"


def _error(rank: int) -> str:
    return f"error/{rank}"


def run_rank(target: Callable, rank: int, world: int, port: int, args: tuple) -> None:
    """A spawned rank's main: reach rank 0's store, join the group, run
    ``target(rank, world, *args)``; its error goes to the store (rank 0 names it)."""
    store = dist.TCPStore(HOST, port, is_master=False, timeout=timedelta(seconds=60))
    store.set(_arrived(rank), "1")
    try:
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore("group", store),
            rank=rank,
            world_size=world,
            timeout=GROUP_TIMEOUT,
        )
        target(rank, world, *args)
    except KeyboardInterrupt:  # Ctrl-C reached the whole terminal's process group
        sys.exit(1)
    except BaseException as e:
        text = "".join(traceback.format_exception(e))
        try:
            store.set(_error(rank), text)
        finally:
            print(f"trainer rank {rank} failed:\n{text}", file=sys.stderr, flush=True)
            sys.exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class TrainerRanks:
    """Spawn ranks ``1..world-1`` running ``target(rank, world, *args)``; this process
    is rank 0 of their gloo group once the constructor returns.

    Args:
        world: the number of ranks, this one included (>= 2).
        target: a module-level function (spawned processes import it by name).
        args: its arguments after ``rank, world`` (picklable).
        start_timeout_s: how long the ranks may take to reach rank 0's store.
        join_timeout_s: how long ``close`` waits for ranks told to stop, before it
            terminates them.

    Examples:
        >>> from torchrl_vllm_ext.grpo.ranks import TrainerRanks
        >>> with TrainerRanks(2, my_rank_main, (config,)) as ranks:  # doctest: +SKIP
        ...     torch.distributed.get_world_size()
        2
    """

    def __init__(
        self,
        world: int,
        target: Callable,
        args: tuple = (),
        *,
        start_timeout_s: float = 300.0,
        join_timeout_s: float = 60.0,
    ):
        if world < 2:
            raise ValueError(f"TrainerRanks needs world >= 2 (rank 0 is this process), got {world}")
        if dist.is_initialized():
            raise TrainerRankError(
                "this process already belongs to a torch.distributed group; a job spawns its "
                "trainer ranks from a process outside any group (or pass one trainer rank)."
            )
        self.world = world
        self.join_timeout_s = join_timeout_s
        self.processes: list[multiprocessing.Process] = []
        self.store = serve_store(HOST, timedelta(seconds=60))
        try:
            context = multiprocessing.get_context("spawn")
            for rank in range(1, world):
                process = context.Process(
                    target=run_rank,
                    args=(target, rank, world, self.store.port, args),
                    name=f"trainer-rank-{rank}",
                    daemon=True,  # never outlives this process, whatever ends it
                )
                process.start()
                self.processes.append(process)
            self._wait_for_ranks(start_timeout_s)
            dist.init_process_group(
                "gloo",
                store=dist.PrefixStore("group", self.store),
                rank=0,
                world_size=world,
                timeout=GROUP_TIMEOUT,
            )
        except BaseException:
            self.close(ok=False)
            raise
        logger.info("trainer ranks 1..%d up (pids %s)", world - 1, [p.pid for p in self.processes])

    def _wait_for_ranks(self, timeout_s: float) -> None:
        """Until every rank reached the store; a rank that died on the way is named."""
        deadline = time.monotonic() + timeout_s
        waiting = set(range(1, self.world))
        while waiting:
            for rank in sorted(waiting):
                if self.store.check([_arrived(rank)]):
                    waiting.discard(rank)
                elif not self.processes[rank - 1].is_alive():
                    raise self._failure(rank, "exited before joining the trainer's group")
            if waiting and time.monotonic() > deadline:
                raise TrainerRankError(
                    f"trainer ranks {sorted(waiting)} did not start within {timeout_s:.0f} s; "
                    "the machine may be overloaded (pass fewer --trainer-ranks).",
                    min(waiting),
                )
            if waiting:
                time.sleep(POLL_S)

    def _failure(self, rank: int, what: str) -> TrainerRankError:
        process = self.processes[rank - 1]
        text = None
        if self.store is not None and self.store.check([_error(rank)]):
            text = self.store.get(_error(rank)).decode()
        detail = f":\n{text}" if text else f" (exit code {process.exitcode}; its stderr says why)"
        return TrainerRankError(f"trainer rank {rank} (pid {process.pid}) {what}{detail}", rank)

    def failed(self) -> TrainerRankError | None:
        """The first rank that posted an error, as the error to raise; None if none did."""
        if self.store is None:
            return None
        for rank in range(1, self.world):
            if self.store.check([_error(rank)]):
                return self._failure(rank, "failed")
        return None

    def close(self, ok: bool = True) -> dict[int, int | None]:
        """End every rank and the process group; each rank's exit code. ``ok``: the ranks
        were told to stop and are joined (``join_timeout_s``); else (an error, an
        interrupt) they are terminated at once. Either way a rank still alive after that
        is killed. Idempotent."""
        wait = self.join_timeout_s if ok else 0.0
        for process in self.processes:
            process.join(max(0.0, wait))
        for process in self.processes:
            if process.is_alive():
                if ok:
                    logger.warning("trainer rank %s did not stop: terminated", process.name)
                process.terminate()
                process.join(5.0)
            if process.is_alive():
                process.kill()
                process.join()
        codes = {rank: p.exitcode for rank, p in enumerate(self.processes, start=1)}
        for process in self.processes:
            logger.info("%s (pid %s) exited: %s", process.name, process.pid, process.exitcode)
        if dist.is_initialized():
            dist.destroy_process_group()
        self.processes = []
        self.store = None
        return codes

    def __enter__(self) -> TrainerRanks:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        failure = self.failed()
        ok = exc_type is None and failure is None
        codes = self.close(ok=ok)
        if failure is not None and isinstance(exc, TorchRLVLLMError | KeyboardInterrupt):
            # NOTE: rank 0's own error came first (the others then lose rank 0's store):
            # it stays the error; theirs goes to the log.
            logger.warning("after rank 0's %s: %s", type(exc).__name__, failure)
        elif failure is not None:
            raise failure from exc
        bad = {rank: code for rank, code in codes.items() if code != 0}
        if ok and bad:
            rank, code = min(bad.items())
            raise TrainerRankError(
                f"trainer rank {rank} exited with code {code} after the job's last step "
                "(its stderr says why)",
                rank,
            )


__all__ = ["TrainerRanks", "run_rank"]

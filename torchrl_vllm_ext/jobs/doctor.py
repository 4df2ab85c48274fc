"""torchrl-vllm doctor: what of ours is on this machine, and --clean for the dead.

Lists the package's directories in shared memory (/dev/shm/torchrl-vllm-*) with their
owner (pid, host), whether it runs and their size, and the replica processes and Ray
clusters running here. --clean removes the directories whose owner is dead (what a
killed trainer or replica left); a directory without an owner marker (made by an older
version) is listed and kept: remove it yourself once nothing uses it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import psutil

from torchrl_vllm_ext import leftovers

REPLICA_MARK = "VLLMReplica"  # Ray titles an actor's process ray::<class>.<method>
RAY_CLUSTER_MARK = "gcs_server"  # one per Ray cluster (its head)


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "doctor",
        help="list the package's leftovers on this machine; --clean removes the dead ones",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--clean", action="store_true", help="remove the directories whose owner is dead"
    )
    p.add_argument(
        "--dir",
        type=Path,
        default=None,
        help=f"where to look (default: {leftovers.shm_base()})",
    )
    p.set_defaults(func=run)
    return p


def _status(item: leftovers.Leftover) -> str:
    if item.owner is None:
        return "no owner recorded"
    state = "alive" if item.alive else "dead"
    return f"owner pid {item.owner.pid} on {item.owner.host}: {state}"


def processes() -> list[tuple[int, str]]:
    """Our replicas' processes and the Ray clusters' heads on this machine: (pid, what)."""
    found = []
    for p in psutil.process_iter(["pid", "name", "cmdline"]):
        try:
            cmd = " ".join(p.info["cmdline"] or ()) or (p.info["name"] or "")
        except psutil.Error:
            continue
        if REPLICA_MARK in cmd:
            found.append((p.info["pid"], f"replica actor: {cmd[:80]}"))
        elif RAY_CLUSTER_MARK in (p.info["name"] or ""):
            found.append((p.info["pid"], "Ray cluster head (gcs_server)"))
    return found


def run(args: argparse.Namespace) -> int:
    items = leftovers.leftovers(args.dir)
    base = args.dir or leftovers.shm_base()
    print(f"directories of ours in {base}: {len(items)}")
    for item in items:
        print(f"  {item.path}  {item.nbytes / 1e6:.1f} MB  {_status(item)}")
    procs = processes()
    print(f"replica processes and Ray clusters on this machine: {len(procs)}")
    for pid, what in procs:
        print(f"  pid {pid}  {what}")
    if args.clean:
        removed = leftovers.reap(args.dir)
        freed = sum(i.nbytes for i in items if i.path in removed)
        print(f"removed {len(removed)} directories of dead owners ({freed / 1e6:.1f} MB)")
        for path in removed:
            print(f"  {path}")
    else:
        dead = sum(1 for i in items if i.alive is False)
        if dead:
            print(f"{dead} of them belong to dead processes: `torchrl-vllm doctor --clean`")
    return 0

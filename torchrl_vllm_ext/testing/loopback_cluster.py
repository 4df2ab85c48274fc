"""A real multi-node Ray cluster on one machine: one ``ray start`` per loopback address.

Every node is a full Ray node (its own raylet, object store, agents), so placement
across nodes, node IPs that differ from the driver's, and the loss of a whole node run
for real; only the wire is loopback. Each node's processes share the session of the
``ray start`` that made them, which is how :meth:`LoopbackCluster.stop` finds every one
of them (also those Ray re-parents when a raylet dies) and nothing else.

NOTE: the head is not on 127.0.0.1: Ray (2.60, Linux) rewrites ``127.0.0.1`` and
``localhost`` to the host's routable address. Other 127/8 addresses are kept as given.

Examples:
    >>> with LoopbackCluster([NodeSpec("127.0.0.2", 2, {"rollout": 2})]) as c:  # doctest: +SKIP
    ...     ray.init(address=c.address)
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from torchrl_vllm_ext.listening import free_port

logger = logging.getLogger(__name__)

HEAD_IP = "127.0.0.4"
FAST_DEATH_ENV = {
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
}
"""Head settings that declare a silent node dead in ~3-5 s instead of ~14 s."""


@dataclass(frozen=True)
class NodeSpec:
    """One node: its loopback address, CPUs and custom resources."""

    ip: str
    num_cpus: float
    resources: dict[str, float] = field(default_factory=dict)


def _session(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except (ProcessLookupError, PermissionError):
        return None


class LoopbackCluster:
    """A head node on :data:`HEAD_IP` plus ``workers``; :meth:`stop` leaves no process.

    Args:
        workers: the worker nodes.
        head_cpus: CPUs of the head (the driver's node).
        head_resources: custom resources of the head.
        fast_death: detect a dead node in seconds (:data:`FAST_DEATH_ENV`).
    """

    def __init__(
        self,
        workers: list[NodeSpec],
        head_cpus: float = 1,
        head_resources: dict[str, float] | None = None,
        fast_death: bool = True,
    ):
        self.head = NodeSpec(HEAD_IP, head_cpus, dict(head_resources or {}))
        self.workers = list(workers)
        self.fast_death = fast_death
        self.port = free_port("127.0.0.1")
        # Short: Ray's Unix sockets live below it (and it keeps /tmp/ray/session_latest
        # of any other cluster on the machine untouched).
        self.temp_dir = tempfile.mkdtemp(prefix="trv-", dir="/tmp")
        self.sessions: dict[str, int] = {}  # node ip -> session id of its processes
        self._ray = str(Path(sys.executable).with_name("ray"))

    @property
    def address(self) -> str:
        """The GCS address to join (``ray.init(address=...)``, ``ray_address=...``)."""
        return f"{HEAD_IP}:{self.port}"

    @staticmethod
    def env() -> dict[str, str]:
        """Environment every node and the driver need (no token auth between nodes)."""
        return {"RAY_AUTH_MODE": "disabled"}

    def start(self) -> LoopbackCluster:
        t0 = time.perf_counter()
        try:
            head_env = {**(FAST_DEATH_ENV if self.fast_death else {})}
            # Ray's fixed default ports (metrics, client server, dashboard) may be taken
            # by another cluster on the machine: every node gets free ones.
            head_env.update(
                AUTOSCALER_METRIC_PORT=str(free_port("127.0.0.1")),
                DASHBOARD_METRIC_PORT=str(free_port("127.0.0.1")),
            )
            self._start_node(
                self.head,
                [
                    "--head",
                    "--port",
                    str(self.port),
                    "--include-dashboard=false",
                    "--temp-dir",
                    self.temp_dir,
                    "--ray-client-server-port",
                    str(free_port("127.0.0.1")),
                    "--dashboard-port",
                    str(free_port("127.0.0.1")),
                ],
                head_env,
            )
            for node in self.workers:
                self._start_node(node, ["--address", self.address], {})
        except BaseException:
            self.stop()
            raise
        logger.info(
            "loopback Ray cluster at %s: %d nodes in %.1fs",
            self.address,
            1 + len(self.workers),
            time.perf_counter() - t0,
        )
        return self

    def _start_node(self, node: NodeSpec, args: list[str], env: dict[str, str]) -> None:
        cmd = [
            self._ray,
            "start",
            *args,
            "--node-ip-address",
            node.ip,
            "--num-cpus",
            str(node.num_cpus),
            "--resources",
            json.dumps(node.resources),
            "--disable-usage-stats",
            "--object-store-memory",
            str(100 << 20),
            "--min-worker-port",
            "0",
            "--max-worker-port",
            "0",
            "--dashboard-agent-listen-port",
            str(free_port("127.0.0.1")),
        ]
        proc = subprocess.Popen(
            cmd,
            env={**os.environ, **self.env(), **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # every daemon of this node inherits this session
        )
        self.sessions[node.ip] = proc.pid
        out, _ = proc.communicate(timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"ray start of node {node.ip} failed:\n{out[-2000:]}")

    def processes(self, ip: str | None = None) -> list[psutil.Process]:
        """Live processes of one node (``ip``) or of the whole cluster."""
        sessions = {self.sessions[ip]} if ip is not None else set(self.sessions.values())
        out = []
        for proc in psutil.process_iter():
            if _session(proc.pid) in sessions:
                try:
                    if proc.status() != psutil.STATUS_ZOMBIE:
                        out.append(proc)
                except psutil.Error:
                    pass
        return out

    def kill_raylet(self, ip: str) -> None:
        """SIGKILL node ``ip``'s raylet: the node is lost as if its host went down."""
        (raylet,) = [p for p in self.processes(ip) if p.name() == "raylet"]
        raylet.send_signal(signal.SIGKILL)

    def stop(self) -> None:
        """SIGKILL every process of every node (SIGTERM leaves Ray's servers up for
        5-25 s); idempotent. Disconnect the driver (``ray.shutdown()``) first."""
        procs = self.processes()
        for proc in procs:
            try:
                proc.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(procs, timeout=10)
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __enter__(self) -> LoopbackCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


__all__ = ["FAST_DEATH_ENV", "HEAD_IP", "LoopbackCluster", "NodeSpec"]

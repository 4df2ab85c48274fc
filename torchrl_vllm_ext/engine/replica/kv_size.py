"""The KV-cache size a replica's starting engine logs, read back while it still starts.

Replicas sharing a GPU start in order (:mod:`~torchrl_vllm_ext.engine.driver.start_order`):
the first profiles alone and its size pins the others'. vLLM's workers log the size after
the memory profile and before CUDA-graph capture; while the engine starts, vLLM's logging
configuration (``VLLM_LOGGING_CONFIG_PATH``, inherited by the engine-core process) routes
that one line to a file of the replica (``_compat.kv_size_log_config``), and every other
line where vLLM sends it. The replica's ``kv_cache_size`` polls the file from its own
concurrency group.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

from torchrl_vllm_ext._compat import kv_cache_bytes_logged, kv_size_log_config

_LOGGING_CONFIG_ENV = "VLLM_LOGGING_CONFIG_PATH"


class KvSizeLog:
    """Where a starting engine's KV-size line goes, and the size it says (see the module).

    Examples:
        >>> log = KvSizeLog()
        >>> log.size() is None and not log.over
        True
    """

    def __init__(self):
        self.path: Path | None = None
        """The file the workers' KV-size lines go to (None: not routed)."""
        self.over = False
        """Whether the engine's start is over (a watcher stops polling then). False from the
        start: the watcher may ask before the start has begun."""

    @contextlib.contextmanager
    def routed(self, tmp: Path, report: bool) -> Iterator[None]:
        """While the engine starts (``report``): its processes log their workers' KV-size
        lines to a file in ``tmp`` (the replica's temporary directory, removed with it)."""
        config = kv_size_log_config(str(tmp / "kv-size.log")) if report else None
        if config is None:
            yield
            return
        path = tmp / "vllm-logging.json"
        path.write_text(json.dumps(config))
        self.path = Path(config["handlers"]["torchrl_vllm_kv_size"]["filename"])
        saved = os.environ.get(_LOGGING_CONFIG_ENV)
        os.environ[_LOGGING_CONFIG_ENV] = str(path)  # the engine-core process inherits it
        try:
            yield
        finally:
            if saved is None:
                os.environ.pop(_LOGGING_CONFIG_ENV, None)
            else:
                os.environ[_LOGGING_CONFIG_ENV] = saved

    def size(self) -> int | None:
        """The size logged so far (bytes), or None."""
        try:
            return kv_cache_bytes_logged(self.path.read_text()) if self.path else None
        except OSError:  # not written yet
            return None

    async def wait(self, poll_s: float = 0.25) -> int | None:
        """The size as soon as it is logged; None when the start ends without one."""
        while True:
            over = self.over  # read first: one more look at the file after the end
            size = self.size()
            if size is not None or over:
                return size
            await asyncio.sleep(poll_s)

"""vLLM's model-info cache, filled by the driver before the replicas look it up.

Every vLLM engine inspects its model class (``ModelConfig`` asks vLLM's model registry)
in a subprocess that imports vLLM afresh, unless the registry's cache under
``VLLM_CACHE_ROOT`` already holds the answer for that class. On a machine that has never
run the model, every replica starting at once pays that import: a third of the demo's
cold start on 2 CPU cores. The driver can answer once, in a thread, while it sets up the
trainer and starts Ray; the replicas then read the cache. vLLM writes the cache file
atomically, so a replica that looks before the driver is done inspects the class itself,
as it would without this.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

logger = logging.getLogger(__name__)


def fill_model_info_cache(model_path: str | Path, dtype: str = "auto") -> threading.Thread:
    """Start filling vLLM's model-info cache for ``model_path``'s model class; returns the
    thread (join it before the process ends).

    Only the replicas on this host share the driver's cache: call it when they run here.

    Examples:
        >>> thread = fill_model_info_cache(make_tiny_model(), dtype="float32")  # doctest: +SKIP
        >>> thread.join()  # doctest: +SKIP
    """

    def inspect() -> None:
        try:
            from vllm.engine.arg_utils import EngineArgs

            EngineArgs(model=str(model_path), dtype=dtype).create_model_config()
        except Exception as exc:
            # Nothing is lost: each replica then inspects the class itself, and reports
            # any real problem with the model when it starts.
            logger.warning("could not fill vLLM's model-info cache for %s: %r", model_path, exc)

    thread = threading.Thread(target=inspect, name="vllm-model-info", daemon=True)
    thread.start()
    return thread


__all__ = ["fill_model_info_cache"]

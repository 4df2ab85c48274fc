"""vLLM worker extension: the receiving end of every weight-sync transport.

vLLM mixes ``worker_extension_cls`` (:data:`torchrl_vllm_ext.protocol.WORKER_EXTENSION`, a
stable dotted path) into every model worker by inheritance; the replica actor calls its
methods through ``collective_rpc``. The class is the union of each registered transport's
receiver mixin (``transports/<name>/receiver.py``, :func:`~.transports.registry.receivers`)
over the step they share (:class:`~.transports.receiving.Receiving`: stage, then load in
the pause). Method names and arguments are declared in
:class:`torchrl_vllm_ext.protocol.WorkerMethods`; arguments and results are plain data.
Every method verifies what it received before it touches the served weights.
"""

from __future__ import annotations

from torchrl_vllm_ext import leftovers
from torchrl_vllm_ext.weight_sync import cpu_layout
from torchrl_vllm_ext.weight_sync.transports.receiving import Receiving
from torchrl_vllm_ext.weight_sync.transports.registry import receivers

# Only vLLM worker processes import this module (as ``worker_extension_cls``), before
# they build the model: on CPU the weights then stay updatable in place.
cpu_layout.keep_checkpoint_layout()
# ...and before vLLM's weight-loading bars take tqdm's lock: a thread lock, not a named
# semaphore that a killed engine-core process would leave in /dev/shm.
leftovers.thread_only_progress_lock()


class WeightSyncWorkerExtension(*receivers(), Receiving):
    """Methods vLLM adds to its model worker (``self`` is the vLLM ``Worker``)."""

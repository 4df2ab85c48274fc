"""TorchRL's ``WeightSyncScheme`` contract, sender side, over one of our schemes: a part the
:class:`~torchrl_vllm_ext.weight_sync.scheme.WeightSyncScheme` holds (its TorchRL methods
delegate to it), and the scheme's registration under TorchRL's ABC.

A collector given ``weight_sync_schemes={"policy": scheme}`` calls ``init_on_sender``,
``connect``, then ``send`` at each ``update_policy_weights_``. The receivers are the
replicas' workers, run by this package: no receiver side."""

from __future__ import annotations

import weakref
from collections.abc import Callable

from torchrl_vllm_ext.errors import ConfigurationError
from torchrl_vllm_ext.weight_sync.report import SyncReport
from torchrl_vllm_ext.weight_sync.torchrl.pushes import TorchRLPushes, tracked_version


class SchemeContract:
    """TorchRL's sender calls over a scheme, and what they keep: the collector whose
    policy version the pushes follow, the model ``send()`` pushes, the two flags TorchRL's
    collectors read.

    Args:
        pushes: the scheme's TorchRL pushes (the version each push is served as).
        prepare: sets up what every push uses (the scheme's transport; blocks).

    Examples:
        >>> contract = SchemeContract(TorchRLPushes(lambda w, v: v, lambda: "4"), lambda: None)
        >>> contract.init_on_sender(model_id="policy", model="weights")
        >>> contract.initialized_on_sender, contract.model_id
        (True, 'policy')
        >>> contract.connect(); contract.synchronized_on_sender
        True
        >>> contract.send()
        '5'
    """

    def __init__(self, pushes: TorchRLPushes, prepare: Callable[[], None]):
        self._pushes = pushes
        self._prepare = prepare
        self.model_id: str | None = None
        """The collector's name of the model (``init_on_sender``)."""
        self._collector = None  # a weak reference to the collector (its policy version)
        self._model = None  # what send() pushes when given nothing
        self.initialized_on_sender = False
        """Whether ``init_on_sender`` ran (TorchRL's collectors call it once)."""
        self.synchronized_on_sender = False
        """Whether ``connect`` ran (TorchRL's collectors call it once)."""

    def init_on_sender(self, *, model_id: str | None = None, context=None, model=None, **_) -> None:
        """Bind the scheme to a collector (``context``: versions follow its
        ``policy_version``) and, optionally, the trainer ``model`` ``send()`` pushes."""
        self.model_id = model_id
        self._collector = weakref.ref(context) if context is not None else None
        self._model = model
        self.initialized_on_sender = True

    def connect(self, *, worker_idx: int | None = None, weights=None) -> None:
        """TorchRL's rendezvous: prepare the transport; push ``weights`` if given."""
        if worker_idx is not None:
            raise ConfigurationError(
                f"connect(worker_idx={worker_idx!r}): the scheme is the sender; the replicas' "
                "workers receive inside the service and are not TorchRL workers."
            )
        self._prepare()
        if weights is not None:
            self.send(weights)
        self.synchronized_on_sender = True

    def send(self, weights=None, worker_ids=None) -> SyncReport:
        """Push ``weights`` (or the ``model`` given to :meth:`init_on_sender`) to every
        replica as the collector's next policy version; blocks."""
        if worker_ids is not None:
            raise ConfigurationError(
                f"send(worker_ids={worker_ids!r}): a push reaches every replica (they serve one "
                "version); call send() without worker_ids."
            )
        weights = weights if weights is not None else self._model
        if weights is None:
            raise ConfigurationError(
                "send() has no weights: pass the trainer model (collector."
                "update_policy_weights_(model)) or init_on_sender(model=...)."
            )
        collector = self._collector() if self._collector is not None else None
        return self._pushes.push(weights, tracked_version(collector))

    def init_on_receiver(self, *args, **kwargs) -> None:
        """Refused: the replicas' workers are the receivers (see the module)."""
        raise ConfigurationError(
            "WeightSyncScheme has no receiver side: the replicas' workers load the weights "
            "inside the service. Give the scheme to the collector that pushes (the sender)."
        )


def register_with_torchrl(scheme_class: type) -> None:
    """Register ``scheme_class`` under TorchRL's ``WeightSyncScheme`` ABC."""
    # TorchRL's collectors check isinstance(scheme, torchrl's WeightSyncScheme) (an ABC);
    # the class keeps its own contract and is registered, not derived (~1 s import).
    try:
        from torchrl.weight_update import WeightSyncScheme as TorchRLWeightSyncScheme
    except ImportError:  # pragma: no cover - torchrl is a dependency
        return
    TorchRLWeightSyncScheme.register(scheme_class)


__all__ = ["SchemeContract", "register_with_torchrl"]

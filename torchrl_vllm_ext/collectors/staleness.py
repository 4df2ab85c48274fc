"""Staleness: keep replay-buffer samples at most ``max_policy_lag`` weight versions behind.

A sample's *lag* is the trainer's current version minus the version its request was
admitted at (``("vllm", "weight_version")``, the engine's; the oldest weights that
touched it). Two ways to bound it:

- ``"drop"``: :class:`StalenessFilter`, a TorchRL transform on the replay buffer, drops
  rows over the bound when they are written and again when they are sampled.
- ``"wait"``: :class:`StalenessGate` holds the collector back before it starts a batch
  that would run more than ``max_policy_lag`` versions ahead of the trainer (AReaL's
  bounded off-policyness): with a trainer that consumes one batch per version in order,
  no sample is ever over the bound, so nothing is thrown away.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase
from torchrl.envs import Transform

from torchrl_vllm_ext.errors import ConfigurationError
from torchrl_vllm_ext.wrappers.inputs import flatten_rows
from torchrl_vllm_ext.wrappers.layout import VERSION_KEY

STALENESS_MODES = ("drop", "wait")


def sample_versions(td: TensorDictBase, key=VERSION_KEY) -> torch.Tensor:
    """The generating version of every element of ``td``, int64, shaped like its batch.

    Engine versions are strings (``"3"``); TorchRL's ``policy_version`` is an int tensor:
    both are read.

    Examples:
        >>> from tensordict import TensorDict, NonTensorStack
        >>> td = TensorDict(batch_size=[2])
        >>> _ = td.set(("vllm", "weight_version"), NonTensorStack("1", "3"))
        >>> sample_versions(td).tolist()
        [1, 3]
    """
    value = td.get(key, None)
    if value is None:
        raise ConfigurationError(
            f"the rows carry no {key!r}: a staleness bound reads each row's generating "
            "version there. Collect with VLLMPolicy (it writes ('vllm', 'weight_version')), "
            "or name the key your policy writes as version_key="
        )
    if isinstance(value, torch.Tensor):
        return value.reshape(td.batch_size).long()
    flat = value.tolist() if hasattr(value, "tolist") else value
    try:
        ints = torch.tensor([int(v) for v in flatten_rows(flat)], dtype=torch.int64)
    except ValueError as e:
        raise ConfigurationError(
            f"a row's version under {key!r} is not an integer ({e}): a staleness bound "
            "needs integer versions; push without version= (the scheme counts 1, 2, ...) "
            "or with integers"
        ) from e
    if ints.numel() == 1 and td.batch_size.numel() != 1:  # one shared NonTensorData
        ints = ints.expand(td.batch_size.numel())
    return ints.reshape(td.batch_size)


def check_lag(max_policy_lag) -> int:
    if (
        isinstance(max_policy_lag, bool)
        or not isinstance(max_policy_lag, int)
        or max_policy_lag < 0
    ):
        raise ConfigurationError(
            f"max_policy_lag={max_policy_lag!r} must be an int >= 0 (0: on-policy only)."
        )
    return max_policy_lag


class StalenessFilter(Transform):
    """Drop samples generated more than ``max_policy_lag`` versions before ``current_version()``.

    Put it on a TorchRL ``ReplayBuffer`` (``transform=``): rows over the bound are dropped
    on ``extend`` (the inverse pass) and again on ``sample`` (the forward pass), so a
    sample that aged in the buffer while the trainer moved on is not returned either.
    An ``extend`` whose rows are all stale adds nothing; a ``sample`` may come back empty.
    In a ``Compose`` put it first (``rb.insert_transform(0, f)``): it then reads the rows
    as stored, and runs last on a write. ``dropped`` counts the rows removed.

    Args:
        current_version: returns the trainer's current version (an int), e.g.
            ``lambda: collector.policy_version``.
        max_policy_lag: the largest accepted ``current - sample version`` (0: on-policy).
        version_key: where each row's generating version is read (engine string or int).

    Examples:
        >>> from tensordict import TensorDict, NonTensorStack
        >>> from torchrl.data import LazyStackStorage, ReplayBuffer
        >>> version = [3]
        >>> rb = ReplayBuffer(
        ...     storage=LazyStackStorage(16),
        ...     transform=StalenessFilter(lambda: version[0], max_policy_lag=1),
        ... )
        >>> td = TensorDict({"x": torch.arange(3)}, batch_size=[3])
        >>> _ = td.set(("vllm", "weight_version"), NonTensorStack("1", "2", "3"))
        >>> _ = rb.extend(td)  # version "1" is 2 behind: dropped
        >>> len(rb)
        2
        >>> version[0] = 4  # the trainer moved on: "2" is now too old as well
        >>> _ = torch.manual_seed(0)  # 8 random picks of 2 rows: (1/2)^8 would pick no fresh one
        >>> rb.sample(8)["x"].unique().tolist()
        [2]
    """

    def __init__(
        self,
        current_version: Callable[[], int],
        max_policy_lag: int,
        version_key=VERSION_KEY,
    ):
        super().__init__(in_keys=[version_key], out_keys=[])
        self.current_version = current_version
        self.max_policy_lag = check_lag(max_policy_lag)
        self.version_key = version_key
        self.dropped = 0

    def fresh(self, td: TensorDictBase) -> torch.Tensor:
        """Bool mask of the rows of ``td`` within the bound."""
        current = self.current_version()
        if current is None:
            return torch.ones(td.batch_size, dtype=torch.bool)
        return int(current) - sample_versions(td, self.version_key) <= self.max_policy_lag

    def _keep(self, td: TensorDictBase) -> TensorDictBase:
        mask = self.fresh(td)
        if mask.all():
            return td
        self.dropped += int((~mask).sum())
        return td[mask]

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        return self._keep(tensordict)

    def _inv_call(self, tensordict: TensorDictBase) -> TensorDictBase | None:
        kept = self._keep(tensordict)
        # A write whose rows are all stale writes nothing: ``ReplayBuffer.extend`` takes None
        # as "nothing to add", where an empty TensorDict makes its writer raise (and kills a
        # collector thread that was extending it).
        return kept if kept.batch_size.numel() else None


class StalenessGate:
    """Hold a collector back so no batch starts more than ``max_policy_lag`` versions ahead.

    Batch ``b`` (counting from 0 at the trainer's version ``v0``) may start only once the
    trainer has reached version ``v0 + b - max_policy_lag``. A trainer that trains on batch
    ``b`` at version ``v0 + b`` then never sees a sample more than ``max_policy_lag``
    versions old. :meth:`wrap` puts the gate in front of a policy; ``waited_s`` sums the
    time the collector was held.

    Args:
        current_version: returns the trainer's current version (an int).
        max_policy_lag: how many versions a batch may run ahead of the trainer.
        poll_s: how often a held collector re-reads the version.

    Examples:
        >>> version = [0]
        >>> gate = StalenessGate(lambda: version[0], max_policy_lag=1)
        >>> gate.ready(), gate.admit(), gate.admit(), gate.ready()
        (True, None, None, False)
        >>> version[0] = 1
        >>> gate.ready()
        True
    """

    def __init__(self, current_version: Callable[[], int], max_policy_lag: int, poll_s=0.01):
        self.current_version = current_version
        self.max_policy_lag = check_lag(max_policy_lag)
        self.poll_s = poll_s
        self.started = 0
        self.waited_s = 0.0
        self._v0: int | None = None
        self._closed = threading.Event()

    def _version(self) -> int:
        v = self.current_version()
        return 0 if v is None else int(v)

    def ready(self) -> bool:
        """Whether the next batch may start now."""
        if self._v0 is None:
            self._v0 = self._version()
        return self.started - (self._version() - self._v0) <= self.max_policy_lag

    def admit(self) -> None:
        """Block until the next batch may start (or :meth:`close`), then count it started."""
        start = time.perf_counter()
        while not self.ready() and not self._closed.wait(self.poll_s):
            pass
        self.waited_s += time.perf_counter() - start
        self.started += 1

    def close(self) -> None:
        """Release a held collector (at shutdown)."""
        self._closed.set()

    def wrap(self, policy: TensorDictModuleBase) -> GatedPolicy:
        """``policy`` behind this gate, for ``LLMCollector(policy=...)``."""
        return GatedPolicy(policy, self)


class GatedPolicy(TensorDictModuleBase):
    """A policy that waits at a :class:`StalenessGate` before every call; keys unchanged.

    Examples:
        >>> from tensordict.nn import TensorDictModule
        >>> inner = TensorDictModule(lambda x: x + 1, in_keys=["x"], out_keys=["y"])
        >>> policy = GatedPolicy(inner, StalenessGate(lambda: 0, max_policy_lag=0))
        >>> policy.in_keys, policy.out_keys
        (['x'], ['y'])
    """

    def __init__(self, policy: TensorDictModuleBase, gate: StalenessGate):
        super().__init__()
        self.policy = policy
        self.gate = gate
        self.in_keys = list(policy.in_keys)
        self.out_keys = list(policy.out_keys)

    def register_collector(self, collector) -> None:
        if hasattr(self.policy, "register_collector"):
            self.policy.register_collector(collector)

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        self.gate.admit()
        return self.policy(tensordict)


__all__ = [
    "STALENESS_MODES",
    "GatedPolicy",
    "StalenessFilter",
    "StalenessGate",
    "sample_versions",
]

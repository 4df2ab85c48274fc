"""Whether a replica takes traffic: the service's pause and vLLM's sleep, as one state.

A weight push, a restart and the value check each depend on it, and each gets its steps
from a plain function here (unit-tested without vLLM):

- :func:`update_steps`: a push pauses and resumes only a replica that was serving; it is
  refused while the weights sleep (level 1 holds them in host memory, level 2 dropped
  them: a load would be overwritten by the wake-up, or write into unmapped memory), and
  its value probe waits until the replica serves again (a forward pass with the KV cache
  unmapped crashes the GPU kernels; a paused engine would never answer it).
- :func:`restart_steps`: a replica restarted while the service is paused or asleep comes
  back in the same state, with the live weights where they are awake.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from torchrl_vllm_ext._compat import PAUSE_MODES, PauseMode
from torchrl_vllm_ext.errors import ConfigurationError, WeightSyncError

SLEEP_TAGS = ("weights", "kv_cache")
"""What vLLM's sleep mode frees, and ``wake_up(tags)`` restores."""


def check_pause_mode(mode: str) -> PauseMode:
    """``mode`` if it is one of vLLM's pause modes; a typed error naming them otherwise.

    The one check of a pause mode, wherever one enters (service, scheme, replica, engine).

    Examples:
        >>> check_pause_mode("keep")
        'keep'
        >>> check_pause_mode("freeze")
        Traceback (most recent call last):
        ...
        torchrl_vllm_ext.errors.ConfigurationError: pause mode 'freeze' is not one of vLLM's ('abort', 'wait', 'keep'): 'abort' ends in-flight requests, 'wait' lets them finish, 'keep' freezes them until resume.
    """
    if mode not in PAUSE_MODES:
        raise ConfigurationError(
            f"pause mode {mode!r} is not one of vLLM's {PAUSE_MODES}: 'abort' ends in-flight "
            "requests, 'wait' lets them finish, 'keep' freezes them until resume."
        )
    return mode


def check_wake_tags(tags) -> frozenset[str] | None:
    """``tags`` as a set (None: everything); a typed error naming vLLM's tags otherwise."""
    if tags is None:
        return None
    if isinstance(tags, str) or not set(tags) <= set(SLEEP_TAGS):
        raise ConfigurationError(
            f"wake_up(tags={tags!r}): tags are a list of {SLEEP_TAGS} (None: everything)."
        )
    return frozenset(tags)


@dataclass(frozen=True)
class ServingState:
    """A replica's (or the whole service's) pause and sleep.

    Examples:
        >>> s = ServingState().slept(2).woke(["weights"])
        >>> s.asleep, s.serving, s.weights_awake
        (frozenset({'kv_cache'}), False, True)
        >>> s.woke(["kv_cache"]).serving
        True
    """

    paused: tuple[str, bool] | None = None
    """``(mode, clear_cache)`` of the service's :meth:`pause`; None: not paused."""
    sleep_level: int = 0
    """vLLM sleep level while anything sleeps (1 or 2); 0: awake."""
    asleep: frozenset[str] = frozenset()
    """The parts still asleep (:data:`SLEEP_TAGS`)."""

    def slept(self, level: int) -> ServingState:
        if level not in (1, 2):
            raise ConfigurationError(f"sleep(level={level!r}): level must be 1 or 2.")
        return replace(self, sleep_level=level, asleep=frozenset(SLEEP_TAGS))

    def woke(self, tags) -> ServingState:
        wanted = check_wake_tags(tags)
        left = frozenset() if wanted is None else self.asleep - wanted
        return replace(self, asleep=left, sleep_level=self.sleep_level if left else 0)

    def paused_as(self, mode: str, clear_cache: bool) -> ServingState:
        return replace(self, paused=(mode, clear_cache))

    def resumed(self) -> ServingState:
        return replace(self, paused=None)

    @property
    def serving(self) -> bool:
        """Whether requests run (not paused, nothing asleep)."""
        return self.paused is None and not self.asleep

    @property
    def weights_awake(self) -> bool:
        return "weights" not in self.asleep


@dataclass(frozen=True)
class UpdateSteps:
    """What one replica's weight update does around its load."""

    pause: bool
    """Pause generation before the load and resume after it (the replica was serving).
    False: it is paused or asleep already and stays so."""
    probe_now: bool
    """The value probe may run right after the load; False: it waits until the replica
    serves again (:meth:`~torchrl_vllm_ext.VLLMService.resume` / ``wake_up``)."""


def update_steps(state: ServingState, replica_id: int, version: str) -> UpdateSteps:
    """The steps of a weight update of ``version`` on a replica in ``state``.

    Raises:
        WeightSyncError: the replica's weights sleep.

    Examples:
        >>> update_steps(ServingState(), 0, "3")
        UpdateSteps(pause=True, probe_now=True)
        >>> update_steps(ServingState().paused_as("keep", False), 0, "3")
        UpdateSteps(pause=False, probe_now=False)
        >>> update_steps(ServingState().slept(2).woke(["weights"]), 0, "3")
        UpdateSteps(pause=False, probe_now=False)
    """
    if not state.weights_awake:
        kept = "offloaded to host memory" if state.sleep_level == 1 else "released"
        raise WeightSyncError(
            f"replica {replica_id} sleeps (level {state.sleep_level}) with its weights {kept}: "
            f"version {version} was not loaded. Call wake_up(['weights']) before pushing "
            "(then wake_up(['kv_cache']) once the push returned)."
        )
    if state.serving:
        return UpdateSteps(pause=True, probe_now=True)
    return UpdateSteps(pause=False, probe_now=False)


RestartStep = Literal["bring_up", "sleep", "wake_weights", "pause"]


def restart_steps(state: ServingState) -> list[RestartStep]:
    """What a replica started while the service is in ``state`` does before it counts as
    ready, in order: load the live weights (``bring_up``), sleep at the service's level,
    wake the weights again, pause as the service did.

    Weights that are awake in a sleeping service were woken to be pushed into: the new
    replica sleeps first, wakes them, then loads the live version. Weights that sleep are
    loaded first (level 1 then keeps them in host memory).

    Examples:
        >>> restart_steps(ServingState())
        ['bring_up']
        >>> restart_steps(ServingState().slept(1))
        ['bring_up', 'sleep']
        >>> restart_steps(ServingState().slept(2).woke(["weights"]).paused_as("abort", True))
        ['sleep', 'wake_weights', 'bring_up', 'pause']
    """
    steps: list[RestartStep] = []
    if not state.asleep:
        steps.append("bring_up")
    elif state.weights_awake:
        steps += ["sleep", "wake_weights", "bring_up"]
    else:
        steps += ["bring_up", "sleep"]
    if state.paused is not None:
        steps.append("pause")
    return steps

"""When and how a push checks that its weights arrived, by value (the scheme's step 4).

:mod:`.verify` measures (probe ids, the trainer's reference, one replica's gap); this
module is the policy around it, and its state from push to push: which pushes are
checked (``verify``: the scheme's first successful push, every push, or none), the limit
(``verify_tol`` or the one derived from the served dtype), the trainer's reference
computed in a thread while the bytes move, every loaded replica's probe after its
pause, and the checks of replicas that could not run the probe yet (paused, or with
their KV cache asleep), run when the service serves again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from torchrl_vllm_ext.engine.calls import Outcomes
from torchrl_vllm_ext.errors import ConfigurationError, ReplicaDeadError, WeightSyncError
from torchrl_vllm_ext.weight_sync.transports.protocol import Replicas
from torchrl_vllm_ext.weight_sync.verify import (
    ProbeResult,
    Reference,
    ReferenceModel,
    TimedReference,
    mean_gap,
    plain_causal_lm,
    probe_ids,
    reference,
)

logger = logging.getLogger(__name__)

VERIFY = ("first", "always", "never")


@dataclass
class Verdict:
    """The value check of one group of loaded replicas (a value: the caller decides)."""

    gaps: dict[int, float] = field(default_factory=dict)
    """Replicas that passed -> their mean probe gap."""
    failed: dict[int, Exception] = field(default_factory=dict)
    """Replicas that failed (a gap past the limit, or a probe error) -> why; those that
    served weights nobody pushed are discarded (restarted) by the check already."""
    dead: dict[int, Exception] = field(default_factory=dict)
    """Replicas that died or left the pool between their load and the probe."""
    seconds: float = 0.0
    """How long the probes took."""

    def applied_to(self, loaded: Outcomes) -> Outcomes:
        """``loaded`` as the check leaves it: failed replicas among the errors, the dead
        among the dead, each passing replica's result with its ``probe_gap``."""
        out = Outcomes(
            results=dict(loaded.results), errors=dict(loaded.errors), dead=dict(loaded.dead)
        )
        for rid in list(out.results):
            if rid in self.failed or rid in self.dead:
                del out.results[rid]
            elif rid in self.gaps:
                out.results[rid] = {**out.results[rid], "probe_gap": self.gaps[rid]}
        out.errors.update(self.failed)
        out.dead.update(self.dead)
        return out


@dataclass
class Deferred:
    """A verified push's check of the replicas that could not run the probe yet, run when
    the service serves again."""

    version: str
    expected: Reference
    replicas: set[int]


class ArrivalCheck:
    """The value check of one scheme's pushes.

    Args:
        fleet: the replicas pushed to (the service's pool).
        config: the service's config (the model directory, the configured dtype).
        names: the scheme's :class:`~.checkpoint_names.CheckpointNames` (the reference
            model's writers).
        verify: ``"first"``, ``"always"``, ``"never"`` (or a bool).
        verify_tol: a fixed limit on the mean |log-prob gap|; None derives it per push.
    """

    def __init__(self, fleet, config, names, verify: bool | str, verify_tol: float | None):
        self.mode = {True: "always", False: "never"}.get(verify, verify)
        if self.mode not in VERIFY:
            raise ConfigurationError(f"verify={verify!r} is not one of {VERIFY} (or a bool).")
        if verify_tol is not None and not verify_tol > 0:
            raise ConfigurationError(
                f"verify_tol={verify_tol!r} must be a positive mean log-prob gap, or None to "
                "derive the limit at each push from the served dtype."
            )
        self.tol = verify_tol
        self.fleet = fleet
        self.config = config
        self.names = names
        self.verified_pushes = 0
        self.deferred: Deferred | None = None
        """The check of replicas that could not run the probe yet, if any."""
        self._probe = probe_ids(config.model)
        self._reference_model: ReferenceModel | None = None

    def limit(self, expected: Reference) -> float:
        return self.tol if self.tol is not None else expected.limit

    def served_dtype_name(self, replicas: Replicas) -> str:
        """The dtype the replicas serve (as they report it; the configured one otherwise)."""
        reported = {r.info.dtype for r in replicas if getattr(r.info, "dtype", "")}
        if len(reported) > 1:
            raise ConfigurationError(
                f"replicas serve the weights in different dtypes {sorted(reported)}: the value "
                "check has one reference; launch them with one dtype= or push with "
                "verify='never'."
            )
        if reported:
            return reported.pop()
        configured = str(self.config.engine_kwargs.get("dtype", "auto"))
        # NOTE: vLLM serves a float32 checkpoint in bfloat16 under "auto" on GPUs.
        return "bfloat16" if configured == "auto" else configured

    def served_dtype_or_mixed(self) -> str:
        """:meth:`served_dtype_name` of the ready replicas, ``"mixed"`` when they differ."""
        try:
            return self.served_dtype_name(list(self.fleet.ready()))
        except ConfigurationError:  # replicas of several dtypes: no one dtype
            return "mixed"

    def verified(self) -> None:
        """A push (or its deferred check) passed."""
        self.verified_pushes += 1
        if self.mode == "first":
            self._reference_model = None  # not needed again: free its copy of the weights

    def supersede(self) -> None:
        """A new push starts: its own check covers the replicas a deferred one waits for."""
        if self.deferred is not None:
            logger.info("version %s: its deferred value check is superseded", self.deferred.version)
            self.deferred = None

    @property
    def probe(self) -> list[int]:
        """The probe sequence every checked push scores."""
        return list(self._probe)

    def due(self) -> bool:
        """Whether the next push is checked by value."""
        return not (self.mode == "never" or (self.mode == "first" and self.verified_pushes))

    def start_reference(self, weights, tensors, replicas: Replicas) -> asyncio.Future | None:
        """The trainer's :class:`Reference` for the probe and the seconds it took (a
        :class:`TimedReference`), computed in a thread while the bytes move (``weights``:
        the module that may score them itself, else None); None when this push is not
        checked."""
        if not self.due():
            return None
        dtype = self.served_dtype_name(replicas)

        def run() -> TimedReference:
            t0 = time.perf_counter()
            if plain_causal_lm(weights):
                out = reference(weights, self._probe, dtype)
            else:
                if self._reference_model is None:
                    self._reference_model = ReferenceModel(
                        self.config.model, self.names.checkpoint_writers
                    )
                out = self._reference_model.reference(tensors, self._probe, dtype)
            return TimedReference(out, time.perf_counter() - t0)

        return asyncio.ensure_future(asyncio.to_thread(run))

    async def check(self, loaded: Outcomes, expected, version: str) -> Verdict:
        """Every loaded replica scores the probe; one whose log-probs differ fails and is
        restarted (it serves weights nobody pushed). A replica paused or with its KV
        cache asleep cannot run the probe now: its check is deferred
        (:meth:`check_deferred`)."""
        verdict = Verdict()
        if expected is None or not loaded.results:
            return verdict
        later = {rid for rid, r in loaded.results.items() if not r.get("probe_now", True)}
        if later:
            # One push's groups (rolling: one replica each) add to the same check.
            same = self.deferred is not None and self.deferred.version == version
            earlier = self.deferred.replicas if same else set()
            self.deferred = Deferred(version, expected, later | earlier)
            logger.info(
                "version %s: value check of replica(s) %s deferred until they serve "
                "(paused or asleep)",
                version,
                sorted(later),
            )
        t0 = time.perf_counter()
        views = [
            v
            for v in self.fleet.ready()
            if v.replica_id in loaded.results and v.replica_id not in later
        ]
        probes = await self.fleet.call_all("probe_logprobs", self._probe, replicas=views)
        verdict.dead.update(probes.dead)
        verdict.failed.update(probes.errors)
        for rid in loaded.results:
            if rid in later or rid in probes.errors or rid in probes.dead:
                continue
            if rid not in probes.results:  # left the pool since its load: not verified
                verdict.dead[rid] = ReplicaDeadError(
                    f"replica {rid} left the pool before version {version} was verified."
                )
                continue
            gap = mean_gap(expected.logprobs, probes.results[rid])
            # The noise is named in a refusal only where the limit was derived from it.
            noise = expected.noise if self.tol is None else 0.0
            result = ProbeResult(rid, gap, self.limit(expected), noise)
            if result.ok:
                verdict.gaps[rid] = result.gap
                continue
            error = result.error(version)
            logger.error("%s", error)
            verdict.failed[rid] = error
            self.fleet.restart_untrusted(
                next(v for v in views if v.replica_id == rid), error, "verification"
            )
        verdict.seconds = time.perf_counter() - t0
        return verdict

    async def check_deferred(self, ready, live_version: str | None) -> None:
        """The check a push deferred, once the service serves again (the scheme runs it,
        under its push lock, after ``resume`` / ``wake_up``): raises
        :class:`WeightSyncError` naming a replica that fails it (restarted at the live
        version)."""
        if self.deferred is None:
            return
        deferred, self.deferred = self.deferred, None
        version = deferred.version
        if version != live_version:  # a later push superseded it
            return
        serving = {v.replica_id for v in ready} & deferred.replicas
        checked = Outcomes(results={rid: {} for rid in sorted(serving)})
        verdict = await self.check(checked, deferred.expected, version)
        if verdict.failed:
            rid, error = next(iter(verdict.failed.items()))
            raise WeightSyncError(
                f"deferred value check of version {version} failed on replica {rid}: "
                f"{error}; it is restarted at version {version}."
            ) from error
        self.verified()

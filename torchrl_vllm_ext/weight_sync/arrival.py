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

from torchrl_vllm_ext.engine.driver.pool import Outcomes
from torchrl_vllm_ext.errors import ConfigurationError, ReplicaDeadError, WeightSyncError
from torchrl_vllm_ext.weight_sync.transports.protocol import Replicas
from torchrl_vllm_ext.weight_sync.verify import (
    ProbeResult,
    Reference,
    ReferenceModel,
    mean_gap,
    plain_causal_lm,
    probe_ids,
    reference,
)

logger = logging.getLogger(__name__)

VERIFY = ("first", "always", "never")


class ArrivalCheck:
    """The value check of one scheme's pushes.

    Args:
        service: the service pushed to (its pool, config and model directory).
        names: the scheme's :class:`~.checkpoint_names.CheckpointNames` (the reference
            model's writers).
        verify: ``"first"``, ``"always"``, ``"never"`` (or a bool).
        verify_tol: a fixed limit on the mean |log-prob gap|; None derives it per push.
    """

    def __init__(self, service, names, verify: bool | str, verify_tol: float | None):
        self.mode = {True: "always", False: "never"}.get(verify, verify)
        if self.mode not in VERIFY:
            raise ConfigurationError(f"verify={verify!r} is not one of {VERIFY} (or a bool).")
        if verify_tol is not None and not verify_tol > 0:
            raise ConfigurationError(
                f"verify_tol={verify_tol!r} must be a positive mean log-prob gap, or None to "
                "derive the limit at each push from the served dtype."
            )
        self.tol = verify_tol
        self.service = service
        self.names = names
        self.verified_pushes = 0
        # A verified push's check of the replicas that could not run the probe yet:
        # (version, trainer's reference, replica ids), run when the service serves again.
        self.deferred: tuple[str, Reference, set[int]] | None = None
        self._probe = probe_ids(service.config.model)
        self._reference_model: ReferenceModel | None = None

    def limit(self, expected: Reference) -> float:
        return self.tol if self.tol is not None else expected.limit

    def served_dtype(self, replicas: Replicas) -> str:
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
        configured = str(self.service.config.engine_kwargs.get("dtype", "auto"))
        # NOTE: vLLM serves a float32 checkpoint in bfloat16 under "auto" on GPUs.
        return "bfloat16" if configured == "auto" else configured

    def verified(self) -> None:
        """A push (or its deferred check) passed."""
        self.verified_pushes += 1
        if self.mode == "first":
            self._reference_model = None  # not needed again: free its copy of the weights

    def supersede(self) -> None:
        """A new push starts: its own check covers the replicas a deferred one waits for."""
        if self.deferred is not None:
            logger.info("version %s: its deferred value check is superseded", self.deferred[0])
            self.deferred = None

    def start_reference(
        self, weights, tensors, phases: dict, replicas: Replicas
    ) -> asyncio.Future | None:
        """The trainer's :class:`Reference` for the probe, computed in a thread while the
        bytes move (``weights``: the module that may score them itself, else None); None
        when this push is not checked."""
        if self.mode == "never" or (self.mode == "first" and self.verified_pushes):
            return None
        dtype = self.served_dtype(replicas)

        def run() -> Reference:
            t0 = time.perf_counter()
            if plain_causal_lm(weights):
                out = reference(weights, self._probe, dtype)
            else:
                if self._reference_model is None:
                    self._reference_model = ReferenceModel(
                        self.service.config.model, self.names.checkpoint_writers
                    )
                out = self._reference_model.reference(tensors, self._probe, dtype)
            phases["reference"] = time.perf_counter() - t0
            return out

        return asyncio.ensure_future(asyncio.to_thread(run))

    async def check(self, loaded: Outcomes, expected, version: str, phases: dict) -> None:
        """Every loaded replica scores the probe; a mismatch moves it to the errors and
        restarts it (it serves weights nobody pushed). A replica paused or with its KV
        cache asleep cannot run the probe now: its check is deferred
        (:meth:`check_deferred`)."""
        if expected is None or not loaded.results:
            return
        later = {rid for rid, r in loaded.results.items() if not r.get("probe_now", True)}
        if later:
            # One push's groups (rolling: one replica each) add to the same check.
            earlier = self.deferred[2] if self.deferred and self.deferred[0] == version else set()
            self.deferred = (version, expected, later | earlier)
            logger.info(
                "version %s: value check of replica(s) %s deferred until they serve "
                "(paused or asleep)",
                version,
                sorted(later),
            )
        t0 = time.perf_counter()
        pool = self.service.pool
        views = [
            v for v in pool.ready() if v.replica_id in loaded.results and v.replica_id not in later
        ]
        probes = await pool.call_all("probe_logprobs", self._probe, replicas=views)
        loaded.dead.update(probes.dead)
        for rid, cause in probes.errors.items():
            loaded.errors[rid] = cause
        for rid in list(loaded.results):
            if rid in later:
                continue
            if rid not in probes.results:  # died or failed since its load: not verified
                del loaded.results[rid]
                if rid not in probes.errors and rid not in probes.dead:
                    loaded.dead[rid] = ReplicaDeadError(
                        f"replica {rid} left the pool before version {version} was verified."
                    )
                continue
            gap = mean_gap(expected.logprobs, probes.results[rid])
            # The noise is named in a refusal only where the limit was derived from it.
            noise = expected.noise if self.tol is None else 0.0
            result = ProbeResult(rid, gap, self.limit(expected), noise)
            loaded.results[rid]["probe_gap"] = result.gap
            if not result.ok:
                error = result.error(version)
                logger.error("%s", error)
                del loaded.results[rid]
                loaded.errors[rid] = error
                pool.discard(next(v for v in views if v.replica_id == rid), error, "verification")
        phases["verify"] = phases.get("verify", 0.0) + time.perf_counter() - t0

    async def check_deferred(self, ready, live_version: str | None) -> None:
        """The check a push deferred, once the service serves again (the scheme runs it,
        under its push lock, after ``resume`` / ``wake_up``): raises
        :class:`WeightSyncError` naming a replica that fails it (restarted at the live
        version)."""
        if self.deferred is None:
            return
        version, expected, rids = self.deferred
        self.deferred = None
        if version != live_version:  # a later push superseded it
            return
        serving = {v.replica_id for v in ready} & rids
        checked = Outcomes(results={rid: {} for rid in sorted(serving)})
        await self.check(checked, expected, version, {})
        if checked.errors:
            rid, error = next(iter(checked.errors.items()))
            raise WeightSyncError(
                f"deferred value check of version {version} failed on replica {rid}: "
                f"{error}; it is restarted at version {version}."
            ) from error
        self.verified()

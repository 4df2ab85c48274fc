"""The broadcast transport's receiver (vLLM worker side): join the trainer's process group,
receive and verify the buckets (in a background thread before the pause, or at once for a
restarted replica). The receive buffers are kept, holding the last version whole: a delta
update (:mod:`...delta`) is written into them, then verified like a full one. A
tensor-parallel worker may instead be sent only its slices, point to point
(:mod:`.per_worker`): it reports them (``weight_broadcast_slices``), receives its payload,
checks its checksum and writes it into the buffers at its positions; its load plan reads
nothing else. Its sender: :mod:`.sender`."""

from __future__ import annotations

import dataclasses
import logging
import math

import torch

from torchrl_vllm_ext.errors import WeightSyncError
from torchrl_vllm_ext.weight_sync.delta import (
    apply_bucket,
    bucket_change,
    checksum_after,
    payload_bytes,
    split_payload,
    touched_words,
    words_sum,
)
from torchrl_vllm_ext.weight_sync.loading.loads import Loads, Received
from torchrl_vllm_ext.weight_sync.loading.plan import Layout
from torchrl_vllm_ext.weight_sync.loading.planned import model_state
from torchrl_vllm_ext.weight_sync.loading.scatter import Changes
from torchrl_vllm_ext.weight_sync.loading.slices import SliceReads
from torchrl_vllm_ext.weight_sync.params import device_checksums, torch_dtype
from torchrl_vllm_ext.weight_sync.specs import PerWorkerUpdate, UpdateHeader, from_json
from torchrl_vllm_ext.weight_sync.transports.broadcast import per_worker
from torchrl_vllm_ext.weight_sync.transports.broadcast.collective import (
    JoinedGroup,
    end_group,
    make_process_group,
)
from torchrl_vllm_ext.weight_sync.transports.packing import unpack, verify_checksums

logger = logging.getLogger(__name__)


class BroadcastReceiver:
    """The broadcast transport's part of a worker's weight sync (the worker extension's
    broadcast methods delegate here).

    Args:
        loads: the worker's shared staging and loading step.
    """

    def __init__(self, loads: Loads):
        self.loads = loads
        self.group: JoinedGroup | None = None
        """The group this worker joined, if any."""
        self.backend: str | None = None
        self.device: torch.device | None = None
        """Where buckets are received (the worker's GPU for NCCL, else the CPU)."""
        self.buffers: list[torch.Tensor] = []
        """Receive buffers kept from push to push (one per bucket)."""
        self.held: str | None = None
        """The version the buffers hold whole and verified (the base a delta changes)."""
        self.sums: list[int] = []
        """The buffers' checksums, verified (a delta's are these plus what it changed)."""
        self.reported: dict[str, per_worker.Runs] = {}
        """The slices this worker reported, by digest (what a per-worker payload is cut by)."""
        self.payload: torch.Tensor | None = None
        """The last per-worker payload's buffer (the next is received into it)."""
        self.cuts: per_worker.Cuts = {}
        """Their byte runs of the buckets, kept from push to push."""
        self._reported_of: tuple | None = None
        """``(slices, digest)`` last reported: not worked out again while they hold."""

    def init_weight_broadcast(
        self,
        host: str,
        port: int,
        world_size: int,
        rank_offset: int,
        backend: str,
        timeout_s: float,
    ) -> int:
        """Join the trainer's broadcast group; returns this worker's rank in it."""
        self.close_weight_broadcast()
        rank = rank_offset + self.loads.worker.rank
        self.group = make_process_group(backend, host, port, world_size, rank, timeout_s)
        self.backend = backend
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if backend == "nccl"
            else torch.device("cpu")
        )
        return rank

    def receive_weight_broadcast(self, header_json: str) -> str:
        """Receive every bucket of one update, verify all, then load; returns the version."""
        header = from_json(header_json, UpdateHeader)
        received = self._receive(header)
        self.loads.load(received.named, header.version, changes=received.changes)
        return header.version

    def stage_weight_broadcast(self, header_json: str) -> bool:
        """Receive and verify one update in a background thread (before the pause)."""
        header = from_json(header_json, UpdateHeader)
        return self.loads.stage(header.version, lambda: self._receive(header))

    def weight_broadcast_slices(self, header_json: str) -> per_worker.Runs | None:
        """The element runs this worker keeps of each tensor of ``header``'s buckets (read
        off its load plan of that layout), or None: no plan yet, or one that would not
        replay now."""
        header = from_json(header_json, UpdateHeader)
        model = self.loads.worker.get_model()
        slices = self.loads.plans.slices(self._layout(header), lambda: model_state(model))
        if slices is None:
            return None
        if self._reported_of is None or self._reported_of[0] is not slices:
            runs = per_worker.worker_runs(slices)
            self._reported_of = (slices, per_worker.runs_digest(runs))
            self.reported = {self._reported_of[1]: runs}  # the latest layout's only
        return self.reported[self._reported_of[1]]

    def stage_weight_sends(self, update_json: str) -> bool:
        """Receive this worker's slices of one update and verify them in a background
        thread (before the pause)."""
        update = from_json(update_json, PerWorkerUpdate)
        return self.loads.stage(update.header.version, lambda: self._receive_slices(update))

    def _receive_slices(self, update: PerWorkerUpdate) -> Received:
        """This worker's payload of ``update``, verified, written into the receive buffers
        at its positions: views of the buffers, of which only those positions are this
        version's (the plan the slices came from reads nothing else)."""
        header, mine = update.header, update.workers[self.loads.worker.rank]
        runs = self.reported.get(mine.runs_digest)
        payload = self.payload
        if payload is None or payload.numel() != mine.nbytes or payload.device != self.device:
            payload = torch.empty(mine.nbytes, dtype=torch.uint8, device=self.device)
            self.payload = payload  # kept: the next push's is received into it
        if mine.nbytes:  # a worker that keeps nothing is sent nothing
            self._collect(header, [payload], point_to_point=True)
        if runs is None:
            raise WeightSyncError(
                f"version {header.version}: the slices this worker was sent were cut by runs "
                f"it does not hold (digest {mine.runs_digest}); nothing was loaded. Push "
                "again: the next push asks every worker for its slices anew."
            )
        (got,) = device_checksums([payload])
        if got != mine.checksum:
            raise WeightSyncError(
                f"the slices worker {self.loads.worker.rank} was sent of version "
                f"{header.version} (per-worker send, {mine.nbytes} bytes) do not match the "
                f"trainer's (checksum {got} != {mine.checksum}); nothing was loaded."
            )
        self.held = None  # the buffers hold this version's slices only
        buffers = [
            _buffer(self.buffers, i, b.nbytes, self.device) for i, b in enumerate(header.buckets)
        ]
        cut = per_worker.cut_runs(header, runs, mine.runs_digest, self.cuts)
        per_worker.scatter(payload, cut, buffers)
        reads = self.loads.plans.reads(self._layout(header))
        if reads is None:
            raise WeightSyncError(
                f"version {header.version}: this worker's load plan of the layout it reported "
                "slices of is gone; nothing was loaded. Push again."
            )
        return Received(self._views(header), reads=_sent(reads, header, runs, mine.nbytes))

    def _layout(self, header: UpdateHeader) -> Layout:
        """The layout key of ``header``'s tensors as this worker receives them (contiguous
        views of the receive buffers on its device)."""
        device = (self.device or torch.device("cpu")).type
        return tuple(
            (spec.name, spec.shape, _contiguous(spec.shape), torch_dtype(bucket.dtype), device)
            for bucket in header.buckets
            for spec in bucket.tensors
        )

    def _receive(self, header: UpdateHeader) -> Received:
        """Every bucket of ``header``'s version, verified, as views of the receive buffers
        (which then hold that version: the base of the next delta)."""
        if header.base:
            return self._receive_delta(header)
        self.held = None  # the buffers are overwritten from here on
        buffers = [
            _buffer(self.buffers, i, b.nbytes, self.device) for i, b in enumerate(header.buckets)
        ]
        sums = self._collect(header, buffers)
        self._verify(header, device_checksums(buffers), sums)
        self.held = header.version
        # Loaded in one reload: vLLM re-processes a layer once all its weights arrived.
        return Received(self._views(header))

    def _receive_delta(self, header: UpdateHeader) -> Received:
        """A delta of the version these buffers hold: its payloads received, then written
        into the buffers, which must then equal the new version's checksums; what changed
        goes with the tensors (the pause writes only that where it can)."""
        sizes = [payload_bytes(b, d) for b, d in zip(header.buckets, header.deltas, strict=True)]
        payloads = [torch.empty(n, dtype=torch.uint8, device=self.device) for n in sizes if n]
        self._collect(header, payloads)  # every payload is received before any check
        layout = [b.nbytes for b in header.buckets]
        if self.held != header.base or [b.numel() for b in self.buffers] != layout:
            raise WeightSyncError(
                f"a delta of version {header.base} to {header.version} reached a worker whose "
                f"buffers hold {self.held or 'no whole version'}; nothing was loaded. Push "
                "again: the next push sends every byte."
            )
        self.held = None
        sent, changed, sums = iter(payloads), [], list(self.sums)
        for i, (bucket, delta) in enumerate(zip(header.buckets, header.deltas, strict=True)):
            if sizes[i]:
                payload, buffer = next(sent), self.buffers[i]
                _, at = split_payload(bucket, delta, payload)
                touched = touched_words(bucket, delta, at)
                before = words_sum(buffer, touched) if touched is not None else 0
                positions, values = apply_bucket(buffer, bucket, delta, payload)
                changed.append(bucket_change(bucket, delta, positions, values))
                sums[i] = (
                    checksum_after(sums[i], before, words_sum(buffer, touched))
                    if touched is not None
                    else device_checksums([buffer])[0]
                )
        # The buffers held the base, verified; what the delta touched is summed again.
        self._verify(header, sums)
        self.held = header.version
        return Received(self._views(header), Changes(header.base, tuple(changed)))

    def _collect(
        self, header: UpdateHeader, buffers: list[torch.Tensor], point_to_point: bool = False
    ) -> torch.Tensor | None:
        """Receive ``buffers`` in order (and the int64 checksums that follow them, if the
        header says so), broadcast or (``point_to_point``) sent to this worker alone; a
        cut-off receive ends the group and raises."""
        group = self.group
        if group is None:
            raise WeightSyncError(
                "this worker is not in a broadcast group; call init_weight_broadcast first."
            )
        sums = None
        for i, buf in enumerate(buffers):
            try:
                if point_to_point:
                    group.process_group.recv([buf], 0, 0).wait()
                else:
                    group.process_group.broadcast(buf, 0).wait()
                if header.checksums_follow and i == len(buffers) - 1:
                    sums = torch.empty(len(buffers), dtype=torch.int64, device=self.device)
                    group.process_group.broadcast(sums, 0).wait()
            except Exception as e:  # the trainer died or stalled past the group's timeout
                # The group is unusable now; the next push forms a new one.
                if self.group is group:
                    self.group = None
                    end_group(self.backend, group.process_group)
                    self.buffers, self.held = [], None
                error = WeightSyncError(
                    f"broadcast of weight version {header.version} was cut off after "
                    f"{i} of {len(buffers)} {'delta payloads' if header.base else 'buckets'} "
                    f"({type(e).__name__}: "
                    f"{e}); nothing was loaded, this worker keeps serving its previous weights. "
                    "Push again: the next push forms a new group."
                )
                logger.error("%s", error)
                raise error from e
        return sums

    def _verify(self, header: UpdateHeader, got: list[int], sums: torch.Tensor | None = None):
        """Every bucket's checksum (``got``: of the buffers, on the GPU for NCCL, one sync)
        against the sender's (``sums``: those that followed the buckets, else the
        header's); kept as the buffers' (the base of the next delta's)."""
        if sums is None:
            sent = [bucket.checksum for bucket in header.buckets]
        else:  # the sender's int64 words of the uint64 sums
            sent = [s % (1 << 64) for s in sums.tolist()]
        how = "received by broadcast" + (", after its delta" if header.base else "")
        verify_checksums(header.version, got, sent, how)
        self.sums = sent

    def _views(self, header: UpdateHeader) -> list[tuple[str, torch.Tensor]]:
        return [
            item
            for bucket, buf in zip(header.buckets, self.buffers, strict=False)
            for item in unpack(bucket, buf)
        ]

    def close_weight_broadcast(self) -> bool:
        """Leave the group (an NCCL one aborted: a receive stuck on a dead member ends)
        and drop the receive buffers; whether it was in one."""
        group, self.group = self.group, None
        if group is not None:
            end_group(self.backend, group.process_group)
        self.buffers, self.held, self.payload = [], None, None
        return group is not None


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``."""
    return tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))


def _sent(reads: SliceReads, header: UpdateHeader, runs, nbytes: int) -> SliceReads:
    """``reads`` (the plan's) with what a per-worker send moved: ``nbytes`` in all, and
    of the tensors read as slices, exactly their runs."""
    size = {s.name: torch_dtype(b.dtype).itemsize for b in header.buckets for s in b.tensors}
    sliced = sum((b - a) * size[name] for name in reads.views for a, b in runs[name])
    return dataclasses.replace(reads, received_bytes=nbytes, sliced_received=sliced)


def _buffer(kept: list[torch.Tensor], i: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """The receive buffer of bucket ``i``: the one kept from the last push when it has the
    size and device, else a new one (kept in its place). The load in the pause is done
    with it before the next push receives."""
    if i < len(kept) and kept[i].numel() == nbytes and kept[i].device == device:
        return kept[i]
    buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    if i < len(kept):
        kept[i] = buf
    else:
        kept.append(buf)
    return buf

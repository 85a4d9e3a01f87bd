"""Stream mode of the in-process runner (:func:`.inproc.run_threads` with ``streams=True``).

On one GPU every rank thread would otherwise compute and copy on the same stream, so nothing
a schedule overlaps can show. Here each rank computes on its own stream and receives on its
own transfer stream, as NCCL's separate stream does on a cluster: a message is copied there
once both sides are posted, after both sides' data are ready, and each side's ``wait`` makes
its current stream wait for the copy. Marker kernels name the streams in a trace
(:func:`stream_roles`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
import torch.distributed as dist

__all__ = [
    "stream_roles", "overlap_by_rank", "SPIN_CYCLES", "StreamWork", "mark", "copy_streamed", "synced", "COLLECTIVES",
    "LOCAL",
]  # fmt: skip

LOCAL = threading.local()
"""Per rank thread in stream mode: ``transfer``, the stream its incoming copies run on."""


def mark() -> torch.cuda.Event | None:
    """An event on the calling rank's current CUDA stream (stream mode on CUDA), else None."""
    if getattr(LOCAL, "transfer", None) is None:
        return None
    ev = torch.cuda.Event()
    ev.record()
    return ev


class StreamWork(dist.Work):
    """One side of a stream-mode transfer, as NCCL runs it: the copy goes on the receiver's
    transfer stream once both sides are posted and both sides' data are ready there (the
    sender's tensor written, the receiver's buffer free); :meth:`wait` returns once the copy is
    enqueued and makes the caller's current stream wait for it, so the copy overlaps whatever
    its rank computes in between. On CPU the copy is done at the match."""

    def __init__(self, posted: torch.cuda.Event | None, transfer: torch.cuda.Stream | None = None) -> None:
        super().__init__()
        self.posted, self.transfer = posted, transfer
        self._matched = threading.Event()
        self._done: torch.cuda.Event | None = None
        self._error: BaseException | None = None

    def finish(self, done: torch.cuda.Event | None, error: BaseException | None = None) -> None:
        self._done, self._error = done, error
        self._matched.set()

    def is_completed(self) -> bool:
        return self._matched.is_set()

    def wait(self, timeout=None) -> bool:
        seconds = 300.0 if not timeout else timeout.total_seconds()
        if not self._matched.wait(seconds):
            raise RuntimeError(f"mcx_threads: a stream-mode transfer not matched within {seconds}s")
        if self._error is not None:
            raise self._error
        if self._done is not None:
            torch.cuda.current_stream().wait_event(self._done)
        return True


def copy_streamed(buf: torch.Tensor, t: torch.Tensor, rwork: StreamWork, swork: StreamWork) -> None:
    """``buf <- t`` for a matched pair; on CUDA on the receiver's transfer stream, after both
    posting events."""
    if rwork.transfer is None:
        with torch.no_grad():
            buf.detach().copy_(t)
        done = None
    else:
        with torch.cuda.stream(rwork.transfer), torch.no_grad():
            for ev in (swork.posted, rwork.posted):
                if ev is not None:
                    rwork.transfer.wait_event(ev)
            buf.detach().copy_(t)
            done = torch.cuda.Event()
            done.record(rwork.transfer)
    rwork.finish(done)
    swork.finish(done)


COLLECTIVES = (
    "all_to_all_single", "alltoall", "allreduce", "allreduce_coalesced", "allgather", "all_gather_single",
    "all_gather_single_coalesced", "broadcast", "scatter", "gather", "reduce_scatter", "reduce_scatter_single",
    "reduce_scatter_single_coalesced", "barrier", "_allgather_base", "_reduce_scatter_base",
)  # fmt: skip


def synced(base: Callable) -> Callable:
    """A threaded collective that, in stream mode on CUDA, synchronises the device around it:
    the collective copies on the stream of whichever rank joins last, which no other rank's
    stream orders against (p2p, the mode's purpose, never pays this)."""

    def collective(self, *args, **kwargs):
        sync = getattr(LOCAL, "transfer", None) is not None
        if sync:
            torch.cuda.synchronize()
        work = base(self, *args, **kwargs)
        if sync:
            torch.cuda.synchronize()
        return work

    return collective


SPIN_CYCLES = 1000
"""Length of the marker kernels stream mode launches (``torch.cuda._sleep``)."""


def stream_roles(spins_per_stream: dict[int, int], world: int) -> dict[int, tuple[int, str]]:
    """``{stream id: (rank, "compute" | "transfer")}`` from the marker kernels counted per
    stream in a trace of a stream-mode run (:data:`SPIN_CYCLES`)."""
    roles = {}
    for sid, n in spins_per_stream.items():
        if 1 <= n <= world:
            roles[sid] = (n - 1, "compute")
        elif world < n <= 2 * world:
            roles[sid] = (n - 1 - world, "transfer")
    return roles


def overlap_by_rank(events, world: int) -> dict:
    """Per rank of a stream-mode trace: transfer time (copies on its transfer stream), its
    compute kernels' time, and how much of the transfer time its own compute overlapped, in
    µs; ``ratio`` is the overlap over the transfer time, all ranks together. ``events``: the
    profiler's events (``prof.events()``); kernels are told apart by ``device_resource_id``."""
    kern = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    spins: dict[int, int] = {}
    for e in kern:
        if "spin" in e.name.lower():
            spins[e.device_resource_id] = spins.get(e.device_resource_id, 0) + 1
    roles = stream_roles(spins, world)
    span = lambda e: (e.time_range.start, e.time_range.end)  # noqa: E731
    per: dict[int, dict] = {r: {"transfer": [], "compute": []} for r in range(world)}
    for e in kern:
        role = roles.get(e.device_resource_id)
        if role is None or "spin" in e.name.lower():
            continue
        rank, kind = role
        if kind == "compute" or "memcpy" in e.name.lower() or "copy" in e.name.lower():
            per[rank][kind].append(span(e))
    ranks = {}
    for r, d in per.items():
        over = sum(max(0, min(b, y) - max(a, x)) for a, b in d["transfer"] for x, y in d["compute"])
        ranks[r] = {
            "transfers": len(d["transfer"]), "transfer_us": sum(b - a for a, b in d["transfer"]),
            "compute_kernels": len(d["compute"]), "compute_us": sum(b - a for a, b in d["compute"]), "overlap_us": over,
        }  # fmt: skip
    moved = sum(v["transfer_us"] for v in ranks.values())
    hidden = sum(v["overlap_us"] for v in ranks.values())
    return {"ranks": ranks, "streams_named": len(roles), "ratio": hidden / moved if moved else 0.0}

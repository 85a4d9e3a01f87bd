"""Transfer buffers in flight, and the check that no allocator reuses one while it is in use.

A batch posted by :meth:`.comm.Peers.post` runs asynchronously: with NCCL on its own CUDA
stream, with gloo on a background thread. The caching allocator ties a block to the stream
that allocated it; if the last reference to a tensor a transfer still reads (a send) or
writes (a receive buffer) is dropped, the block can go to the next allocation of the compute
stream at once — reuse across streams while the transfer uses it. The package's rule: every
tensor handed to a transfer, exactly as the backend sees it (a ``contiguous()`` copy
included), is held by its :class:`.comm.Batch` until :meth:`.comm.Peers.wait`, which makes
the current stream wait for the transfer. Frees after that are ordered after the transfer, so
no ``record_stream`` is needed and nothing depends on the backend's own stashing
(``TORCH_NCCL_AVOID_RECORD_STREAMS``).

:func:`tracking` installs a :class:`Ledger` that records every post and wait under one
global sequence (address range, bytes, device, the current stream) and flags a batch released
before its wait. :func:`reuse_hazards` checks an allocator trace against the ledger's
in-flight windows: an allocation overlapping a buffer between its post and its wait, on any
stream, is a reuse. On CUDA the ledger tags allocations with its sequence number
(``torch.cuda.memory._set_memory_metadata`` where torch has it), so the trace of
``torch.cuda.memory._record_memory_history`` orders allocations against posts and waits. The
allocator keeps that tag per thread: an allocation tagged ``s`` came after its own thread's
tick ``s`` and before that thread's next tick, while other threads (the ranks of
:func:`.testing.inproc.run_threads`) may tick in between. So a reuse is reported only where
that whole interval lies inside the buffer's window: exact with one thread per process (every
rank's own reuse), and never a guess across threads. When no ledger is installed, posting costs
one list lookup.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch

__all__ = ["InFlight", "Ledger", "ACTIVE", "tracking", "reuse_hazards", "trace_allocs", "SEQ_TAG"]

ACTIVE: list[Ledger | None] = [None]
"""The installed ledger (:func:`tracking`), or None."""

SEQ_TAG = "mcx-seq:"
"""Prefix of the allocator metadata that carries the ledger's sequence number."""


@dataclass(frozen=True, kw_only=True)
class InFlight:
    """One tensor handed to a transfer."""

    batch: int
    """Ledger id of its batch."""
    role: str
    """``send`` or ``recv``."""
    addr: int
    """First byte (``data_ptr``)."""
    nbytes: int
    device: str
    stream: int
    """``torch.cuda.current_stream().stream_id`` at the post (0 off CUDA)."""
    posted: int
    """Sequence number of the post."""


class Ledger:
    """Posts and waits of every batch, in one sequence shared by all threads (ranks of
    :func:`.testing.inproc.run_threads` included)."""

    def __init__(self, tag_allocations: bool = True) -> None:
        self._lock = threading.Lock()
        self._seq = 0
        self._tag = tag_allocations and torch.cuda.is_available() and hasattr(torch.cuda.memory, "_set_memory_metadata")
        self.buffers: list[InFlight] = []
        self.waited: dict[int, int] = {}
        """Batch id -> sequence number of its wait."""
        self.thread_of: dict[int, int] = {}
        """Sequence number -> the thread that ticked it (allocation tags are per thread)."""
        self.violations: list[str] = []

    def _tick(self) -> int:  # under the lock
        self._seq += 1
        self.thread_of[self._seq] = threading.get_ident()
        if self._tag:
            torch.cuda.memory._set_memory_metadata(f"{SEQ_TAG}{self._seq}")
        return self._seq

    def post(self, batch: object, sends: list[torch.Tensor], recvs: list[torch.Tensor]) -> int:
        """Record a batch's tensors (as handed to the backend); returns its id."""
        with self._lock:
            seq = self._tick()
            for role, ts in (("send", sends), ("recv", recvs)):
                for t in ts:
                    stream = torch.cuda.current_stream(t.device).stream_id if t.is_cuda else 0
                    self.buffers.append(InFlight(batch=seq, role=role, addr=t.data_ptr(), nbytes=t.nbytes,
                                                 device=str(t.device), stream=stream, posted=seq))  # fmt: skip
        weakref.finalize(batch, self._released, seq)
        return seq

    def wait(self, bid: int) -> None:
        """The batch's transfers completed (its tensors may be released from now on)."""
        with self._lock:
            self.waited[bid] = self._tick()

    def _released(self, bid: int) -> None:
        with self._lock:
            if bid not in self.waited:
                self.violations.append(f"batch {bid} released before its wait: its buffers could be reused in flight")

    def windows(self) -> list[tuple[InFlight, int]]:
        """Each buffer with the sequence number of its batch's wait (``-1``: never waited)."""
        return [(b, self.waited.get(b.batch, -1)) for b in self.buffers]

    def next_ticks(self) -> dict[int, int]:
        """Sequence number -> the next one its thread ticked (absent for a thread's last): an
        allocation tagged ``s`` happened before ``next_ticks()[s]``."""
        last: dict[int, int] = {}
        out: dict[int, int] = {}
        for seq in sorted(self.thread_of):
            th = self.thread_of[seq]
            if th in last:
                out[last[th]] = seq
            last[th] = seq
        return out

    def summary(self) -> dict:
        batches = {b.batch for b in self.buffers}
        return {
            "batches": len(batches), "buffers": len(self.buffers), "bytes": sum(b.nbytes for b in self.buffers),
            "unwaited": sorted(batches - set(self.waited)), "violations": list(self.violations),
            "streams": sorted({b.stream for b in self.buffers}),
        }  # fmt: skip


@contextlib.contextmanager
def tracking(tag_allocations: bool = True) -> Iterator[Ledger]:
    """Record every transfer batch posted inside the block."""
    ledger = Ledger(tag_allocations)
    prev, ACTIVE[0] = ACTIVE[0], ledger
    try:
        yield ledger
    finally:
        ACTIVE[0] = prev
        if ledger._tag:
            torch.cuda.memory._set_memory_metadata("")


def trace_allocs(snapshot: dict) -> list[dict]:
    """``alloc`` events of a ``torch.cuda.memory._snapshot()`` with the ledger sequence number
    they follow (``seq``; None when untagged): ``{addr, size, stream, seq}``."""
    out = []
    for dev_trace in snapshot.get("device_traces", []):
        for e in dev_trace:
            if e.get("action") != "alloc":
                continue
            meta = e.get("user_metadata") or ""
            seq = int(meta[len(SEQ_TAG) :]) if meta.startswith(SEQ_TAG) else None
            out.append({"addr": int(e["addr"]), "size": int(e["size"]), "stream": int(e.get("stream", 0)), "seq": seq})
    return out


def reuse_hazards(
    windows: list[tuple[InFlight, int]], allocs: list[dict], next_ticks: dict[int, int] | None = None
) -> list[str]:
    """Allocations that overlap a buffer while it is in flight.

    An allocation tagged ``seq = s`` happened after ledger event ``s`` and before the next
    event of the thread that ticked ``s`` (``next_ticks``, :meth:`Ledger.next_ticks`; without
    it, before ``s + 1``: one thread); a buffer is in flight from its post ``p`` until its wait
    ``w`` (``-1``: never waited, in flight to the end), so ``p <= s`` and the allocation's next
    tick ``<= w`` with overlapping bytes is a reuse — across streams when the allocation's
    stream differs from the post's. Untagged allocations are skipped.
    """
    out = []
    for b, w in windows:
        for a in allocs:
            s = a["seq"]
            if s is None or s < b.posted:
                continue
            before = s + 1 if next_ticks is None else next_ticks.get(s)  # the allocation came before this
            if w >= 0 and (before is None or before > w):
                continue
            if a["addr"] < b.addr + b.nbytes and b.addr < a["addr"] + a["size"]:
                across = " across streams" if a["stream"] != b.stream else ""
                out.append(f"{b.role} buffer of batch {b.batch} ({b.nbytes} B at {b.addr:#x}) reused{across} by an "
                           f"allocation of {a['size']} B on stream {a['stream']} before its wait "
                           f"(posted at {b.posted}, allocated at {s}, waited at {w})")  # fmt: skip
    return out

"""Each rank's memory peaks on one GPU, from the caching allocator's own trace.

The one-GPU runner (:func:`.inproc.run_threads`) runs every rank in one process, so
``torch.cuda.max_memory_allocated`` sees the sum over ranks whose peaks need not coincide,
plus every rank's input shards and results. In stream mode each rank allocates on a compute
stream of its own, and the allocator's trace (``torch.cuda.memory._record_memory_history``)
names the stream of every block: replaying one stream's allocations and frees gives that
rank's live bytes over time, kernel workspaces and allocator rounding included — what the
dispatch-level accounting (:class:`.accounting.Tracker`) cannot see.

A rank delimits its phases by allocating marker blocks of sizes no tensor of the run has
(:func:`marker`): forward from the first to the second, backward from the second to the
third. A phase's peak is the most its stream's live bytes rose above their level at the
phase's start (blocks allocated before the trace began are freed as their size says).
"""

from __future__ import annotations

import torch

__all__ = ["MARKERS", "marker", "phase_growth", "record", "trace_of"]

MARKERS = tuple(512 * (104_729 + i) for i in range(3))
"""Marker block sizes (multiples of the allocator's 512-byte rounding; about 51 MiB, larger
than the small pool and no multiple of any shape the suite allocates)."""


def marker(phase: int, device: torch.device) -> None:
    """Allocate and free the marker block of ``phase`` (0 forward starts, 1 backward starts,
    2 backward ends) on the current stream: its trace entries mark the phase boundary."""
    torch.empty(MARKERS[phase], dtype=torch.uint8, device=device)


def record(enabled: bool) -> None:
    """Start (``True``) or stop the allocator trace: allocations and frees only, no stacks."""
    if enabled:
        torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python", max_entries=2_000_000)
    else:
        torch.cuda.memory._record_memory_history(enabled=None)


def trace_of(device: torch.device) -> list[dict]:
    """The allocator trace of ``device`` recorded so far."""
    snap = torch.cuda.memory._snapshot()
    index = device.index if device.index is not None else torch.cuda.current_device()
    return snap["device_traces"][index]


def phase_growth(trace: list[dict], stream: int) -> tuple[int, int] | None:
    """``(forward, backward)``: the most ``stream``'s live bytes rose above their level at the
    start of each phase (markers excluded); None where the stream's markers are missing."""
    live, phase, start = 0, -1, 0
    peaks = [0, 0]
    markers: set[int] = set()
    for e in trace:
        if e.get("stream") != stream:
            continue
        action, size, addr = e["action"], e["size"], e["addr"]
        if action == "alloc" and size in MARKERS:
            phase = MARKERS.index(size)
            start = live
            markers.add(addr)
            continue
        if action == "alloc":
            live += size
        elif action == "free_completed":
            if addr in markers:
                markers.discard(addr)
                continue
            live -= size
        else:
            continue
        if phase in (0, 1):
            peaks[phase] = max(peaks[phase], live - start)
    return (peaks[0], peaks[1]) if phase == 2 else None

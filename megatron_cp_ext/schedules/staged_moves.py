"""The staged ``p2p`` schedule's row maps (host, planned once per micro-batch with its stages,
:mod:`.staged_plan`): which rows of which buffer go where, as a few slices where they can.

* :class:`Moves` — own rows into the joined buffer (and a packed step's received rows);
* :class:`StepPieces` — one step's KV messages, cut so that each lands in one slice of the
  receiver's joined buffer: no receive buffer and no copy between, where few enough;
* :class:`KeyRuns` — where a joined call's dK/dV rows go in backward.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import torch

from ..plan import Layout, StepPlan

__all__ = ["Moves", "StepPieces", "KeyRuns", "cut_rows", "plan_keys", "MAX_RUNS", "MAX_PIECES"]

MAX_RUNS = 8
"""A move of at most this many contiguous runs is that many slice copies; more fragmented
moves are one indexed copy (gather or scatter)."""

MAX_PIECES = 16
"""A step's KV travels as one message per piece and tensor, each landing in place, where it
has at most this many pieces; more fragmented steps travel packed (one gather by the sender,
one copy into place by the receiver)."""


@dataclass
class Moves:
    """Rows ``src[i]`` of a source buffer go to rows ``dst[i]`` of the joined buffer."""

    src: np.ndarray
    dst: np.ndarray
    _dev: dict = field(default_factory=dict, repr=False)

    @functools.cached_property
    def runs(self) -> tuple[tuple[int, int, int], ...] | None:
        """``(src0, dst0, n)`` per maximal run contiguous on both sides, or None where there are
        more than :data:`MAX_RUNS` (the move is then indexed)."""
        if not len(self.src):
            return ()
        brk = np.flatnonzero((np.diff(self.src) != 1) | (np.diff(self.dst) != 1)) + 1
        if len(brk) + 1 > MAX_RUNS:
            return None
        first = np.concatenate([[0], brk])
        n = np.diff(np.concatenate([first, [len(self.src)]]))
        return tuple((int(self.src[a]), int(self.dst[a]), int(m)) for a, m in zip(first, n))

    @functools.cached_property
    def identity_src(self) -> bool:
        """Whether ``src`` is ``0 .. len(src) - 1``: the source buffer's leading rows in order (no
        gather on that side; the buffer may hold more rows, which the move leaves out)."""
        return bool(len(self.src) == 0 or (self.src[0] == 0 and (np.diff(self.src) == 1).all()))

    def on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(src, dst)`` index tensors on ``device`` (uploaded once)."""
        key = str(device)
        if key not in self._dev:
            up = lambda x: torch.from_numpy(np.ascontiguousarray(x)).to(device, non_blocking=True)  # noqa: E731
            self._dev[key] = (up(self.src), up(self.dst))
        return self._dev[key]

    def host(self) -> Moves:
        """Fill the host caches the hot path reads (at plan time, not in a layer)."""
        _ = self.runs, self.identity_src
        return self

    def __getstate__(self) -> dict:  # device copies never travel
        return {**self.__dict__, "_dev": {}}


@dataclass(frozen=True)
class StepPieces:
    """One step's KV messages in the staged schedule, as both ends plan them from the same
    rows (the ring plan's ``send`` of one end is the other's ``recv``) cut the same way
    (:func:`cut_rows`)."""

    send: tuple[tuple[int, int], ...]
    """Own rows ``(row0, n)`` sent as one message per piece and tensor (none if packed)."""
    recv: tuple[tuple[int, int], ...]
    """Joined rows ``(row0, n)`` each received piece lands in (none if packed)."""
    send_packed: bool
    recv_packed: bool
    recv_moves: Moves | None = None
    """A packed receive: its rows (in message order) -> joined rows."""


def cut_rows(ranges: np.ndarray, owner: Layout, chunk: int | None) -> np.ndarray:
    """Row ranges ``[m, 2]`` of a block laid out as ``owner`` cut where a range crosses a range
    of the layout or a chunk boundary: each piece is then contiguous positions of one unit,
    which the receiver's joined buffer holds in one run."""
    if not len(ranges):
        return np.zeros((0, 2), np.int64)
    ends = owner.row + (owner.end - owner.start)
    cuts = [ranges[:, 0], ranges[:, 1], owner.row, ends]
    if chunk is not None:  # rows where a position is a multiple of chunk, inside each range
        c0, c1 = -(-owner.start // chunk), (owner.end - 1) // chunk
        cnt = np.maximum(c1 - c0 + 1, 0)
        i = np.repeat(np.arange(len(cnt)), cnt)
        c = np.repeat(c0, cnt) + np.arange(len(i)) - np.repeat(np.cumsum(cnt) - cnt, cnt)
        cuts.append(owner.row[i] + c * chunk - owner.start[i])
    pts = np.unique(np.concatenate(cuts))
    a, b = pts[:-1], pts[1:]
    inside = np.searchsorted(ranges[:, 0], a, "right") > np.searchsorted(ranges[:, 1], a, "right")
    return np.stack([a[inside], b[inside]], axis=1)


@dataclass
class KeyRuns:
    """Where one joined call's dK/dV partial rows go: received rows to the home buffer (fp32,
    every received row in step order: they go home from there), own rows added to the own
    block's gradient. ``runs``: ``(kind, offset, dst, n)`` — rows ``[offset, offset + n)`` of
    the partial added to own rows from ``dst`` (kind 0), copied to home rows from ``dst``, the
    first to write them (kind 1), or added there (kind 2); None where more than
    :data:`MAX_RUNS` (then by index: ``own_pos``/``own_dst``, ``home_pos``/``home_dst``)."""

    runs: tuple[tuple[int, int, int, int], ...] | None
    own_pos: np.ndarray | None = None
    own_dst: np.ndarray | None = None
    home_pos: np.ndarray | None = None
    home_dst: np.ndarray | None = None
    _dev: dict = field(default_factory=dict, repr=False)

    def on(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """The index form on ``device`` (uploaded once)."""
        key = str(device)
        if key not in self._dev:
            up = lambda x: torch.from_numpy(np.ascontiguousarray(x)).to(device, non_blocking=True)  # noqa: E731
            self._dev[key] = tuple(up(x) for x in (self.own_pos, self.own_dst, self.home_pos, self.home_dst))
        return self._dev[key]

    def __getstate__(self) -> dict:  # device copies never travel
        return {**self.__dict__, "_dev": {}}


def _key_runs(rows: np.ndarray, own: np.ndarray, where: np.ndarray, written: np.ndarray) -> KeyRuns:
    """:class:`KeyRuns` of a call reading the joined ``rows`` (in its order); ``own``/``where``:
    per joined row, whether it is an own row and its own or home row; ``written``: home rows
    an earlier call wrote (updated here)."""
    dst = where[rows]
    home = ~own[rows]
    kind = np.where(home, np.where(written[np.where(home, dst, 0)], 2, 1), 0)
    written[dst[home]] = True
    if len(rows) == 0:
        return KeyRuns(())
    brk = np.flatnonzero((np.diff(kind) != 0) | (np.diff(dst) != 1)) + 1
    if len(brk) + 1 > MAX_RUNS or len(np.unique(rows)) < len(rows):
        pos = np.arange(len(rows), dtype=np.int64)
        return KeyRuns(None, pos[~home], dst[~home], pos[home], dst[home])
    first = np.concatenate([[0], brk])
    n = np.diff(np.concatenate([first, [len(rows)]]))
    return KeyRuns(tuple((int(kind[a]), int(a), int(dst[a]), int(m)) for a, m in zip(first, n)))


def plan_keys(joined: StepPlan, rows: int, own: Moves, recv: Moves, received: int) -> tuple[list[KeyRuns], bool]:
    """Every joined call's :class:`KeyRuns`, and whether the home buffer must be zeroed (a call
    adds by index: then every home write is an add)."""
    is_own = np.zeros(rows, bool)
    is_own[own.dst] = True
    where = np.zeros(rows, np.int64)
    where[own.dst], where[recv.dst] = own.src, recv.src
    written = np.zeros(received, bool)
    keys = []
    for c in joined.calls:
        r = np.arange(*c.k_slice, dtype=np.int64) if c.k_slice is not None else c.k_index.numpy().astype(np.int64)
        keys.append(_key_runs(r, is_own, where, written))
    if not written.all():
        raise AssertionError("staged p2p: a received row's gradient is never written")
    zero = any(k.runs is None for k in keys)
    if zero:
        for k in keys:
            if k.runs is not None:
                k.runs = tuple((2 if kind == 1 else kind, a, d, n) for kind, a, d, n in k.runs)
    return keys, zero

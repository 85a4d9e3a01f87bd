"""The head all-to-all without a permutation: each run of rows travels straight to where it lands.

An a2a group computes on its members' tokens in global (sequence, position) order, so that
every sequence is contiguous for the local calls. Members hold interleaved pieces of that
order, so an all-to-all (which receives member after member) must be followed by a row gather
into global order, and the output's way home by the inverse gather: each a full read and
write of the tensor. Here each maximal run of rows that is contiguous both in its owner's
tokens and in the group's order is one message of its own, posted into a view of the
destination, so the rows land in place and neither gather runs. The runs are planned on the
host once per micro-batch (:meth:`Route.of`); the messages go through :class:`..comm.Peers`.

Both ends walk the runs in group order, so the messages between two members are posted in
the same order on both sides. A member's own runs are copied, not sent. Used on the eager
path; a traced call keeps the all-to-all and its gathers (``all_to_all_single`` has a
traceable form, batched point-to-point has none).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..runtime.comm import Message, Peers, start_group

__all__ = ["Route", "routed", "worth", "to_group", "from_group", "MIN_BYTES", "CPU_MIN_BYTES"]

_TAG = 4
"""The head moves' tag (the ring's streams use 0 and 2)."""

MIN_BYTES = 1 << 20
"""On CUDA a move goes by route only where its mean message (a run's rows of one member's
heads) carries at least this many bytes: each message has a fixed cost that the gather it
saves (two passes over the tensor at HBM speed) must outweigh. Provisional: the suite's
``cp`` step times ``a2a`` both ways (``benchmarks/gpu_breakdown.py``) to set it."""
CPU_MIN_BYTES = 0
"""The same on CPU (gloo: the tests and CPU benchmarks route every move they can); the
traffic proxy sets it to :data:`MIN_BYTES` to decide as a GPU would."""

Range = tuple[int, int]


@dataclass(frozen=True, kw_only=True)
class Route:
    """Runs of the group's rows: run ``i`` is rows ``src[i] : src[i] + n[i]`` of member
    ``owner[i]``'s tokens and rows ``dst[i] : dst[i] + n[i]`` of the group's order."""

    owner: tuple[int, ...]
    src: tuple[int, ...]
    dst: tuple[int, ...]
    n: tuple[int, ...]
    members: int = 1
    rows: int = 0
    """``sum(n)``: the group's tokens."""

    @classmethod
    def of(cls, perm: np.ndarray, counts: list[int]) -> Route:
        """From the plan's ``perm`` (the member-ordered receive row of each row in group order)
        and the members' token counts."""
        perm = np.asarray(perm, dtype=np.int64)
        if not len(perm):
            return cls(owner=(), src=(), dst=(), n=(), members=len(counts), rows=0)
        ends = np.cumsum(counts)
        owner = np.searchsorted(ends, perm, side="right")
        local = perm - (ends - np.asarray(counts))[owner]
        cut = np.ones(len(perm), dtype=bool)
        cut[1:] = (owner[1:] != owner[:-1]) | (local[1:] != local[:-1] + 1)
        start = np.nonzero(cut)[0]
        n = np.diff(np.append(start, len(perm)))
        # plan time, on numpy: host ints for the hashable route
        return cls(owner=_ints(owner[start]), src=_ints(local[start]), dst=_ints(start), n=_ints(n),
                   members=len(counts), rows=len(perm))  # fmt: skip

    def runs(self):
        return zip(self.owner, self.src, self.dst, self.n)


def _ints(a: np.ndarray) -> tuple[int, ...]:
    return tuple(map(int, a))


def worth(route: Route, row_bytes: int, floor: int) -> bool:
    """Whether the mean message of a move by ``route`` carries at least ``floor`` bytes.
    ``row_bytes``: one token's bytes over all heads of the tensor moved (the same on every
    member, so every member decides alike); a message holds one member's share of the heads."""
    return bool(route.n) and route.rows * row_bytes >= floor * len(route.n) * route.members


def routed(route: Route | None, group, row_bytes: int, device: torch.device) -> bool:
    """Whether a move goes by :class:`Route` rather than all-to-all and gather: eager, with
    peers, and where its mean message is large enough (:func:`worth`: :data:`MIN_BYTES` on
    CUDA, :data:`CPU_MIN_BYTES` elsewhere)."""
    if route is None or group is None or torch.compiler.is_compiling():
        return False
    return worth(route, row_bytes, MIN_BYTES if device.type == "cuda" else CPU_MIN_BYTES)


_PEERS: dict = {}


def _peers(group, device: torch.device) -> Peers:
    p = _PEERS.get(id(group))
    if p is None or p.group is not group:
        p = _PEERS[id(group)] = Peers(group, _TAG)
    start_group(group, device)  # once per group and device type (every member routes the same moves)
    return p


def _exchange(group, sends: list[Message], recvs: list[Message], device: torch.device) -> None:
    Peers.wait(_peers(group, device).post(sends, recvs))


def to_group(xs: tuple[torch.Tensor, ...], parts: tuple[Range, ...], me: int, group, route: Route) -> torch.Tensor:
    """``xs`` (``[t, H, D_i]`` each, own tokens, all heads; several are packed side by side on
    the last dim) -> ``[rows, h_me, sum D_i]``: every member's tokens of this member's heads
    ``parts[me]``, in group order. Each other member's heads are packed once (one copy per
    tensor) and sent run by run; this member's runs are copied in place."""
    t, d = xs[0].shape[0], sum(x.shape[-1] for x in xs)
    a0, a1 = parts[me]
    out = xs[0].new_empty((route.rows, a1 - a0, d))
    pieces: list[torch.Tensor | None] = []
    for j, (a, b) in enumerate(parts):
        if j == me or b <= a:
            pieces.append(None)
            continue
        piece = xs[0].new_empty((t, b - a, d))
        _columns(piece, [x[:, a:b] for x in xs])
        pieces.append(piece)
    sends, recvs = [], []
    for o, s, r, n in route.runs():
        if o == me:
            sends += [Message(j, p[s : s + n], _TAG) for j, p in enumerate(pieces) if p is not None]
            _columns(out[r : r + n], [x[s : s + n, a0:a1] for x in xs])
        elif a1 > a0:
            recvs.append(Message(o, out[r : r + n], _TAG))
    _exchange(group, sends, recvs, xs[0].device)
    return out


def _columns(dst: torch.Tensor, xs: list[torch.Tensor]) -> None:
    """``dst[..., c_i]`` = ``xs[i]`` for consecutive column blocks (one copy each)."""
    if len(xs) == 1:
        dst.copy_(xs[0])
        return
    c = 0
    for x in xs:
        dst[..., c : c + x.shape[-1]].copy_(x)
        c += x.shape[-1]


def from_group(ys: list[torch.Tensor], parts: tuple[Range, ...], me: int, group, route: Route, t: int):
    """Inverse of :func:`to_group` for each of ``ys`` (``[rows, h_me, D_i]`` in group order,
    handed over: the list is emptied and each is freed once sent): per tensor, ``t`` rows of
    every member's heads as one flat buffer and its ``[t, h_j, D_i]`` views per member
    (``None`` for a member without heads), to be assembled by the caller."""
    mine = parts[me][1] > parts[me][0]
    bufs, views = [], []
    for y in ys:
        d, width = y.shape[2:], sum(b - a for a, b in parts)
        flat = y.new_empty(t * width * int(torch.Size(d).numel()))
        per, off = [], 0
        for a, b in parts:
            n = t * (b - a) * int(torch.Size(d).numel())
            per.append(flat[off : off + n].view(t, b - a, *d) if b > a else None)
            off += n
        bufs.append(flat)
        views.append(per)
    sends, recvs = [], []
    for o, s, r, n in route.runs():
        if o == me:
            for i, y in enumerate(ys):
                recvs += [Message(j, p[s : s + n], _TAG) for j, p in enumerate(views[i]) if p is not None and j != me]
                if mine:
                    views[i][me][s : s + n].copy_(y[r : r + n])
        elif mine:
            sends += [Message(o, y[r : r + n], _TAG) for y in ys]
    ys.clear()
    _exchange(group, sends, recvs, bufs[0].device)
    return bufs, views

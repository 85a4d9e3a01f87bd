"""Merging units of the same shape before :mod:`.estimate` joins pieces (exact, not an estimate).

A balance that cuts every document into many pieces (``dualchunk``: ``2 cp`` of them) makes
the (query piece, key piece) join grow as ``cp^2`` per document. Yet consecutive documents
usually look alike: same participants in the same position order, and each of the next
document's pieces stored right after this one's, in the same buffer. Such a *chain* of units
is priced as one unit whose pieces are the row unions:

* a unit qualifies when the mask inside it depends on position order only (a plain causal or
  full band, or a window wider than the unit) and, for a causal band, no piece is one row (its
  diagonal would be a full entry), so every pair of its pieces is either fully visible, the
  causal diagonal, or invisible, the same in every unit of the chain;
* the varlen calls do not change: the chain's per-unit entries of one (query piece, key piece)
  role follow one another in both row spaces (one slice run, as the merged entry), keep their
  level, and never fuse or compress (the next unit's piece always sits between two pieces of
  one unit, and it is needed whenever they are), so merged entries skip fusion and
  compression too; the rows each participant needs are the same unions;
* only the tile area is not additive (tiles are per entry), so the chain members' area is
  added separately from the members themselves (:func:`member_area`), per piece instead of per
  piece pair, and merged entries price zero area.

Where a rank's entries need the general interval partitioning (never for chain entries
themselves, but possible when other units' entries overlap), its calls depend on the order of
every single entry, so :func:`.entry_calls.price_entries` gives that rank its merged entries
back as the members' own (:func:`expand`); without that information the caller prices the
geometry again without merging.
"""

from __future__ import annotations

import numpy as np

from ..masks.geometry import BIG, TILE
from ..plan.calls import _Pieces

__all__ = ["Chains", "cat_pieces", "expand", "merge_chains", "member_area"]


class Chains:
    """Pieces with chains merged: ``pieces`` (merged ones last), ``fixed`` (a merged piece:
    its entries skip fusion and compression and price no area), ``lo`` / ``up`` per piece (the
    band the piece's unit is priced with) and the chain members' pieces (``member_unit``: a
    dense unit index, ``member_buf``, ``member_len``; in unit and position order)."""

    def __init__(self, pieces, fixed, lo, up, units, member_unit, member_buf, member_len, bidir) -> None:
        self.pieces, self.fixed, self.lo, self.up = pieces, fixed, lo, up
        self.units = units
        """Unit ids of every chain member (their pieces are replaced by the merged ones)."""
        self.member_unit, self.member_buf, self.member_len = member_unit, member_buf, member_len
        self.bidir = bidir
        """Merged units see keys on both sides (``up`` unbounded), else causal."""
        self.members = None
        """Per merged piece (they are the last ones of ``pieces``), its members as CSR
        ``(ptr, row offset from the merged piece's first row, length)``, in chain order."""


def _rank_in_group(head: np.ndarray) -> np.ndarray:
    idx = np.arange(len(head))
    return idx - np.maximum.accumulate(np.where(head, idx, 0))


def merge_chains(p: _Pieces, lo: int, up: int, *, merge: bool = True) -> Chains:
    """Chains of >= 2 consecutive same-shape units of ``p`` (sorted by buffer and row, as
    ``plan.calls._pieces`` returns them) merged into one unit each; see the module doc.
    ``merge=False``: ``p`` as it is."""
    n = len(p.unit)
    lo_arr, up_arr = np.full(n, lo, np.int64), np.full(n, up, np.int64)
    nothing = Chains(p, np.zeros(n, bool), lo_arr, up_arr, np.zeros(0, np.int64), *(np.zeros(0, np.int64),) * 3,
                     up != 0)  # fmt: skip
    if n < 2 or not merge:
        return nothing
    order = np.lexsort((p.start, p.unit))
    unit = p.unit[order]
    head = np.ones(n, bool)
    head[1:] = unit[1:] != unit[:-1]
    uid = np.empty(n, np.int64)  # dense unit index per piece (p order)
    uid[order] = np.cumsum(head) - 1
    pos = np.empty(n, np.int64)
    pos[order] = _rank_in_group(head)
    first = np.nonzero(head)[0]
    count = np.diff(np.append(first, n))
    span = np.maximum.reduceat(p.end[order], first) - p.start[order][first] - 1
    simple = ((lo >= BIG) | (span <= lo)) & ((up == 0) | (up >= BIG) | (span <= up))
    if up == 0:  # a one-row piece's causal diagonal is a full entry (it could fuse)
        simple &= np.minimum.reduceat(p.end[order] - p.start[order], first) >= 2
    # the piece stored right after each piece: the same-position piece of the next unit?
    length = p.end - p.start
    nxt = np.minimum(np.arange(n) + 1, n - 1)
    succ = np.full(len(first), -1)
    zero = np.nonzero(pos == 0)[0]
    succ[uid[zero]] = np.where(zero + 1 < n, uid[nxt[zero]], -1)
    ok = (
        (np.arange(n) + 1 < n) & (p.buf[nxt] == p.buf) & (p.row[nxt] == p.row + length) & (pos[nxt] == pos)
        & (uid[nxt] == succ[uid]) & (uid[nxt] != uid)
    )  # fmt: skip
    okunit = np.ones(len(first), bool)
    np.logical_and.at(okunit, uid, ok)
    s = np.maximum(succ, 0)
    link = okunit & (succ >= 0) & simple & simple[s] & (count == count[s])
    # chains follow the first pieces' order in p (a successor's first piece is the next one)
    uorder = np.argsort(_first_index(uid, pos, len(first)))
    lk = link[uorder]
    if not lk.any():
        return nothing
    new = np.ones(len(first), bool)
    new[1:] = ~lk[:-1]
    chain_of_sorted = np.cumsum(new) - 1
    size = np.bincount(chain_of_sorted)
    chain = np.empty(len(first), np.int64)
    chain[uorder] = chain_of_sorted
    member = size[chain] >= 2  # per dense unit
    mp = member[uid]  # per piece
    mo = order[member[uid[order]]]  # member pieces in unit, position order
    ch, ps = chain[uid[mo]], pos[mo]
    key = np.lexsort((p.row[mo], ps, ch))
    mk = mo[key]
    ghead = np.ones(len(mk), bool)
    ghead[1:] = (chain[uid[mk[1:]]] != chain[uid[mk[:-1]]]) | (pos[mk[1:]] != pos[mk[:-1]])
    gfirst = np.nonzero(ghead)[0]
    tot = np.add.reduceat(length[mk], gfirst)
    start = np.add.reduceat(p.start[mk], gfirst) + pos[mk][gfirst]  # a gap between pieces
    hk = mk[gfirst]
    merged = _Pieces(p.unit[hk], start, start + tot, p.row[hk], p.buf[hk])
    keep = ~mp
    pieces = cat_pieces(p, keep, merged)
    nm = len(hk)
    fixed = np.concatenate([np.zeros(int(keep.sum()), bool), np.ones(nm, bool)])
    lo_m, up_m = BIG, (0 if up == 0 else BIG)
    lo_arr = np.concatenate([lo_arr[keep], np.full(nm, lo_m)])
    up_arr = np.concatenate([up_arr[keep], np.full(nm, up_m)])
    units = np.unique(p.unit[mp])
    out = Chains(pieces, fixed, lo_arr, up_arr, units, uid[mo], p.buf[mo], length[mo], up_m != 0)
    out.members = (np.append(gfirst, len(mk)), p.row[mk] - np.repeat(p.row[hk], np.diff(np.append(gfirst, len(mk)))),
                   length[mk])  # fmt: skip
    return out


def expand(sel: np.ndarray, qm: np.ndarray, km: np.ndarray, members) -> tuple[np.ndarray, ...]:
    """The chain members' own entries of merged entries ``sel`` (indices; ``qm`` / ``km``:
    their query / key merged piece): ``(entry, q offset, q length, k offset, k length)`` per
    member entry, ``entry`` the merged entry it comes from."""
    ptr, off, length = members
    m = ptr[qm[sel] + 1] - ptr[qm[sel]]
    rep = np.repeat(sel, m)
    j = np.arange(len(rep)) - np.repeat(np.cumsum(m) - m, m)
    qx, kx = ptr[qm[rep]] + j, ptr[km[rep]] + j
    return rep, off[qx], length[qx], off[kx], length[kx]


def cat_pieces(a: _Pieces, keep: np.ndarray, b: _Pieces) -> _Pieces:
    """``a``'s pieces where ``keep``, then all of ``b``'s."""
    fields = ("unit", "start", "end", "row", "buf")
    return _Pieces(*(np.concatenate([getattr(a, f)[keep], getattr(b, f)]) for f in fields))


def _first_index(uid: np.ndarray, pos: np.ndarray, units: int) -> np.ndarray:
    """Per dense unit, the p index of its first (position 0) piece."""
    out = np.empty(units, np.int64)
    zero = np.nonzero(pos == 0)[0]
    out[uid[zero]] = zero
    return out


def member_area(c: Chains, n: int, by_buf: bool) -> np.ndarray:
    """Flash tile area of the chain members' own entries (what the merged entries stand for):
    ``[n, n]`` per (query participant, key participant) if ``by_buf``, else ``[n]`` against
    all keys in one buffer. Per piece: the tiles of the keys before it in its unit (and after
    it, for a two-sided band), times its own tiles; the diagonal is the causal triangle."""
    unit, buf = c.member_unit, c.member_buf
    t = (c.member_len + TILE - 1) // TILE
    if not len(unit):
        return np.zeros((n, n) if by_buf else n)
    head = np.ones(len(unit), bool)
    head[1:] = unit[1:] != unit[:-1]
    gid = np.cumsum(head) - 1
    first = np.nonzero(head)[0]
    diag = t * t if c.bidir else t * (t + 1) // 2
    if by_buf:
        w = np.zeros((len(unit), n), np.int64)
        w[np.arange(len(unit)), buf] = t
        cum = np.cumsum(w, axis=0)
        before = cum - w - (cum[first] - w[first])[gid]
        see = before + ((cum[np.append(first[1:], len(unit)) - 1][gid] - cum) if c.bidir else 0)
        flat = (buf[:, None] * n + np.arange(n)).ravel()
        area = np.bincount(flat, weights=(see * t[:, None]).ravel().astype(np.float64), minlength=n * n)
        area += np.bincount(buf * (n + 1), weights=diag.astype(np.float64), minlength=n * n)
        return area.reshape(n, n) * TILE * TILE
    cum = np.cumsum(t)
    before = cum - t - (cum[first] - t[first])[gid]
    see = before + ((cum[np.append(first[1:], len(unit)) - 1][gid] - cum) if c.bidir else 0)
    return np.bincount(buf, weights=(see * t + diag).astype(np.float64), minlength=n) * TILE * TILE

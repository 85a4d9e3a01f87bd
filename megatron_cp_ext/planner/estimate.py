"""Fast pricing of every comm type from one shared geometry (what ``comm_type="auto"`` uses).

:func:`~megatron_cp_ext.planner.cost.predict` prices a plan from its exact calls, which means
building every rank's plan for every candidate: about half a second per micro-batch at 128K
tokens on 16 ranks, paid on every rank. The candidates differ only in which (query, key)
piece pairs meet at which step and which rows travel, so this module computes the pairs once:

* one join of all ranks' (sequence, position) pieces under the mask gives, per pair of
  participants ``(u, o)`` (ranks, or a2a groups' token unions), the flash tile area of u's
  queries against o's keys, its mask alignments (each one a varlen call) and the rows of o's
  block u's queries see — vectorised in numpy, no per-rank plan;
* each candidate is then priced from those ``[n, n]`` matrices with the very rules of
  :mod:`.cost` (ring steps overlap the previous step's compute, collectives are exposed,
  the slowest rank sets the layer time), vectorised over ranks.

The entries are the plans' own (band blocks of piece pairs; fully visible neighbours fused and
a rank's own causal pieces compressed as :mod:`megatron_cp_ext.plan.calls` does) and
:mod:`.entry_calls` groups them into varlen calls as the plans do, so on the randomised
families tried it reproduces the full model's predictions to rounding; it remains an
estimate by construction (nothing checks it against the plans at run time), and
``tests/L0/test_auto_estimate.py`` pins that it picks the full model's winner (or one within
2% of it) and prices every candidate within 5%. It prices the ``flash`` kernel only (the
``reference`` kernel's padded rectangles need the exact ``cu_seqlens``: CPU profiles keep the
full model). Cost grows with the (query piece, key piece) pairs of each document: small for
``workload`` balance, which keeps documents whole; ``dualchunk`` cuts every document into
``2 cp`` pieces, so its pairs grow as ``cp^2`` per document. Runs of consecutive documents
of the same shape are therefore merged first (:mod:`.chains`, exact), which leaves ``cp^2``
pairs per run instead; what stays per document is a document the mask does not treat by
position order alone (a window shorter than it), a2a groups' unions (stored document by
document, so they never form runs), and a rank that needs the general interval partitioning
(its merged entries go back to the members' own, entry by entry).
"""

from __future__ import annotations

import functools

import numpy as np

from .. import schedules
from ..masks import MaskSpec
from ..masks.geometry import BIG, bounds
from ..plan.calls import Layout, _join, _Pieces, _pieces, merge_ranges
from ..schedules.heads import a2a_bytes, acc_bytes, split_heads
from ..schedules.staged_plan import staged_fits
from ..sharding import CPSharding
from .chains import member_area, merge_chains
from .cost import PHASES
from .entry_calls import Overlap, price_entries, starts
from .estimate_staged import local_share, staged_times
from .profiles import HardwareProfile

__all__ = ["Geometry", "geometry", "estimate_times"]

_split_heads = functools.lru_cache(maxsize=64)(split_heads)


class Geometry:
    """Pairwise work of ``n`` participants: ``area[u, o]`` flash tile entries per head of u's
    queries on o's keys, ``calls[u, o]`` varlen calls, ``need[u, o]`` rows of o's block u
    sees; ``area_all[u]``, ``calls_all[u]``: the same against all keys in one buffer."""

    def __init__(self, area, calls, need, area_all, calls_all) -> None:
        self.area, self.calls, self.need = area, calls, need
        self.area_all, self.calls_all = area_all, calls_all


def geometry(seg: np.ndarray, owner: np.ndarray, n: int, mask: MaskSpec, *, ring=True, gather=True) -> Geometry:
    """:class:`Geometry` of ``n`` participants: participant ``owner[i]`` holds ``seg[i]``
    (``(seq, start, end)``; ``owner`` ascending, each participant's rows in local order).
    ``ring`` / ``gather``: price the p2p buffers / the gathered buffer (else zeros)."""
    try:
        return _geometry(seg, owner, n, mask, ring, gather, merge=True)
    except Overlap:
        return _geometry(seg, owner, n, mask, ring, gather, merge=False)


def _geometry(seg, owner, n: int, mask: MaskSpec, ring: bool, gather: bool, merge: bool) -> Geometry:
    seg, owner = np.asarray(seg, np.int64).reshape(-1, 3), np.asarray(owner, np.int64)
    length = seg[:, 2] - seg[:, 1]
    at = np.cumsum(length) - length
    first = np.searchsorted(owner, owner, "left")
    lay = Layout(seg[:, 0], seg[:, 1], seg[:, 2], at - at[first] if len(at) else at, owner)
    lo, up = bounds(mask)
    p = _pieces(lay, mask.chunk, mask.muted)
    qi, ki = _join(p, p)
    # merging pays where units hold many pieces (the join is then much longer than p)
    ch = merge_chains(p, lo, up, merge=merge and len(qi) > 4 * len(p.unit))
    merged = len(ch.units) > 0
    if merged:
        p = ch.pieces
        qi, ki = _join(p, p)
    fixed = ch.fixed
    lo_of = (lambda i: ch.lo[i]) if merged else (lambda i: lo)  # noqa: E731
    up_of = (lambda i: ch.up[i]) if merged else (lambda i: up)  # noqa: E731
    qs, qe, ks, ke = p.start[qi], p.end[qi], p.start[ki], p.end[ki]
    u, o = p.buf[qi], p.buf[ki]
    # rows of o's block some query of u sees (what a p2p transfer carries)
    r0 = p.row[ki] + np.maximum(ks, qs - lo_of(qi)) - ks
    r1 = p.row[ki] + np.minimum(ke, qe + up_of(qi)) - ks
    key, ra, rb = merge_ranges(u * n + o, r0, r1)
    need = np.bincount(key, weights=rb - ra, minlength=n * n).astype(np.int64).reshape(n, n)
    np.fill_diagonal(need, 0)
    qi, ki, sq, sk, left, right, q0, kr = _band(p, p, qi, ki, lo_of(qi), up_of(qi))
    u, o, fx = p.buf[qi], p.buf[ki], fixed[qi]
    base = len(p.unit) - int(fixed.sum())  # merged pieces come last
    qm, km = qi - base, ki - base
    causal = lo >= BIG and up == 0  # plain causal: a unit's own pieces become one causal entry
    if causal:
        drop, extra = _compress(p, qi, skip=fixed)
        drop &= u == o
        cols = (u, o, q0, sq, kr, sk, left, right, fx, qm, km)
        u, o, q0, sq, kr, sk, left, right, fx, qm, km = _swap(drop, extra, cols)
    pair = u * n + o
    area, calls = np.zeros(n * n), np.zeros(n * n, np.int64)
    if ring:
        # p2p receives only the needed ranges, packed: key rows there
        code = key * BIG + ra
        at = np.maximum(np.searchsorted(code, pair * BIG + kr, "right") - 1, 0)
        packed = np.cumsum(rb - ra) - (rb - ra)
        packed -= packed[np.searchsorted(key, key)] if len(key) else 0
        kp = np.where(u == o, kr, kr - ra[at] + packed[at]) if len(key) else kr
        area, calls = price_entries(pair, n * n, n, q0, sq, kp, sk, left, right, fx.astype(bool), (qm, km, ch.members))
        area = area + member_area(ch, n, by_buf=True).ravel()
    area_all, calls_all = np.zeros(n), np.zeros(n, np.int64)
    if gather:
        area_all, calls_all = _gather_docs(lay, n, mask)
    return Geometry(area.reshape(n, n), calls.reshape(n, n), need, area_all, calls_all)


def _gather_docs(lay: Layout, n: int, mask: MaskSpec) -> tuple[np.ndarray, np.ndarray]:
    """Per rank, tile area and calls of ``all_gather``'s plan: its query pieces against the
    gathered keys it sees, kept in document order (``schedules.all_gather``). The keys of one
    (rank, unit) are taken as one range, the hull of what its pieces see (a window can leave
    gaps the plan drops: then it prices a little more area)."""
    lo, up = bounds(mask)
    p = _pieces(lay, mask.chunk, mask.muted)
    if not len(p.unit):
        return np.zeros(n), np.zeros(n, np.int64)
    units, inv = np.unique(p.unit, return_inverse=True)
    u_start = np.full(len(units), BIG, np.int64)
    u_end = np.zeros(len(units), np.int64)
    np.minimum.at(u_start, inv, p.start)
    np.maximum.at(u_end, inv, p.end)
    ks = np.maximum(u_start[inv], p.start - np.minimum(lo, BIG))
    ke = np.minimum(u_end[inv], p.end + np.minimum(up, BIG))
    key = p.buf * len(units) + inv  # one key range per (rank, unit), in document order per rank
    ukey, kinv = np.unique(key, return_inverse=True)
    h0 = np.full(len(ukey), BIG, np.int64)
    h1 = np.zeros(len(ukey), np.int64)
    np.minimum.at(h0, kinv, ks)
    np.maximum.at(h1, kinv, ke)
    h1 = np.maximum(h1, h0)
    kbuf = ukey // len(units)
    length = h1 - h0
    at = np.cumsum(length) - length
    first = np.searchsorted(kbuf, kbuf, "left")
    kp = _Pieces(units[ukey % len(units)], h0, h1, at - at[first], kbuf)
    qi = np.arange(len(p.unit))
    qi, ki, sq, sk, left, right, q0, kr = _band(p, kp, qi, kinv, lo, up)
    return price_entries(p.buf[qi], n, 1, q0, sq, kr, sk, left, right)


def _band(qp, kp, qi, ki, lo, up):
    """The band entry of each (query piece, key piece) pair that sees anything (as
    ``geometry.band_blocks``; ``lo``, ``up``: scalars or per pair): ``qi, ki, sq, sk, left, right`` and its
    first query and key rows."""
    qs, qe, ks, ke = qp.start[qi], qp.end[qi], kp.start[ki], kp.end[ki]
    a = np.maximum(qs, ks - up)
    b = np.minimum(qe, ke + lo)
    k0 = np.maximum(ks, a - lo)
    k1 = np.minimum(ke, b + up)
    keep = (a < b) & (k0 < k1)
    a, b, k0, k1, qi, ki = a[keep], b[keep], k0[keep], k1[keep], qi[keep], ki[keep]
    lo, up = (x[keep] if np.ndim(x) else x for x in (lo, up))
    sq, sk = b - a, k1 - k0
    c = sk - sq
    left = np.minimum(lo, BIG) + k1 - b
    right = np.minimum(up, BIG) + b - k1
    left = np.where((lo >= BIG) | ((sq - 1) + c - left <= 0), -1, left)
    right = np.where((up >= BIG) | (c + right >= sk - 1), -1, right)
    return qi, ki, sq, sk, left, right, qp.row[qi] + a - qp.start[qi], kp.row[ki] + k0 - kp.start[ki]


def _swap(drop, extra, cols):
    """Entries ``cols`` (``u, o, q0, sq, kr, sk, left, right, fixed, qm, km``; ``o`` may be None)
    without ``drop`` and with the compressed ``extra`` entries."""
    owner, q0, total, k0 = extra
    none = np.full(len(owner), -1)
    add = (owner, owner, q0, total, k0, total, none, none + 1, none + 1, none, none)
    return tuple(np.concatenate([c[~drop], x]).astype(np.int64) for c, x in zip(cols, add) if c is not None)


def _compress(p, qi, skip: np.ndarray):
    """``plan.calls._compressed``: a participant's >= 2 query pieces of one unit (at
    consecutive rows in position order) against the very same key pieces become one causal
    entry. Returns the entries to drop (by their query piece ``qi``) and the new ones
    ``(owner, q0, length, k0)`` in the participant's own block."""
    order = np.lexsort((p.start, p.unit, p.buf))
    buf, unit, start, end, row = p.buf[order], p.unit[order], p.start[order], p.end[order], p.row[order]
    head = starts([buf, unit])
    cont = head.copy()
    cont[1:] |= row[1:] == row[:-1] + end[:-1] - start[:-1]
    first = np.nonzero(head)[0]
    count = np.diff(np.append(first, len(buf)))
    ok = (count >= 2) & np.logical_and.reduceat(cont, first) & ~skip[order][first]
    total = np.add.reduceat(end - start, first)
    gid = np.empty(len(buf), np.int64)
    gid[order] = np.cumsum(head) - 1
    drop = ok[gid[qi]]
    sel = first[ok]
    return drop, (buf[sel], row[sel], total[ok], row[sel])


def _link(a: np.ndarray, b: np.ndarray, nbytes, prof: HardwareProfile) -> np.ndarray:
    same = a // prof.ranks_per_node == b // prof.ranks_per_node
    return nbytes / (np.where(same, prof.intra_gbps, prof.inter_gbps) * 1e9)


class _Shape:
    def __init__(self, hq, hkv, d, dv, es) -> None:
        self.hq, self.hkv, self.d, self.dv, self.es = hq, hkv, d, dv, es

    def compute_s(self, area, calls, heads, prof: HardwareProfile) -> dict[str, np.ndarray]:
        """Kernel time of calls over ``area`` tile entries per head with ``heads`` heads."""
        per = np.asarray(area, np.float64) * heads * 2
        flops = {"forward": per * (self.d + self.dv), "backward": per * (3 * self.d + 2 * self.dv)}
        rate = {"forward": prof.fwd_tflops * 1e12, "backward": prof.bwd_tflops * 1e12}
        return {p: flops[p] / rate[p] + np.asarray(calls) * prof.launch_us * 1e-6 for p in PHASES}


def _ring_times(geo: Geometry, part, cp_of, kv_row, grad_row, heads, sh: _Shape, prof, coll) -> dict:
    """Layer time per phase of the CP ranks ``cp_of(part)`` running the p2p ring over the
    participants (``part[i]``: the participant rank i plays; ``cp_of``: participant -> CP rank
    of the same a2a member), with the collectives ``coll`` before it."""
    n = geo.area.shape[0]
    cp_rank = cp_of(part)
    lat = prof.latency_us * 1e-6
    live = np.asarray(heads) > 0  # a member without heads makes no calls
    comp0 = sh.compute_s(geo.area[part, part], geo.calls[part, part] * live, heads, prof)
    shift = np.arange(1, n)[:, None]
    src, dst = (part - shift) % n, (part + shift) % n  # [step, rank]
    recv, send = geo.need[part, src], geo.need[dst, part]
    active = (recv > 0) | (send > 0)
    comp = sh.compute_s(geo.area[part, src], geo.calls[part, src] * live, heads, prof)
    csrc, cdst = cp_of(src), cp_of(dst)
    steps = [
        (active[i], recv[i], send[i], csrc[i], cdst[i], {ph: comp[ph][i] for ph in PHASES})
        for i in np.nonzero(active.any(axis=1))[0]
    ]
    out = {}
    for ph in PHASES:
        kstart, kend, cend = np.zeros(len(part)), comp0[ph].copy(), np.zeros(len(part))
        for active, recv, send, src, dst, comp in steps:
            if ph == "forward":
                sb, rb = send * kv_row, recv * kv_row
            else:
                sb, rb = send * kv_row + recv * grad_row, recv * kv_row + send * grad_row
            t = lat + np.maximum(_link(cp_rank, dst, sb, prof), _link(cp_rank, src, rb, prof))
            c2 = np.maximum(cend, kstart) + t  # posted when the previous step's compute starts
            k2 = np.maximum(kend, c2)
            cend = np.where(active, c2, cend)
            kstart = np.where(active, k2, kstart)
            kend = np.where(active, k2 + comp[ph], kend)
        out[ph] = coll[ph] + kend
    return out


def _collective_bw(ranks: np.ndarray, first: np.ndarray, last: np.ndarray, prof: HardwareProfile) -> np.ndarray:
    """Bytes per second of each rank's slowest link to the members ``[first, last]``."""
    node = ranks // prof.ranks_per_node
    cross = (first // prof.ranks_per_node != node) | (last // prof.ranks_per_node != node)
    return np.where(cross, prof.inter_gbps, prof.intra_gbps) * 1e9


def estimate_times(
    sharding: CPSharding,
    mask: MaskSpec,
    candidates: tuple[str, ...],
    *,
    a2a_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    v_head_dim: int,
    element_size: int,
    profile: HardwareProfile,
) -> dict[str, dict[str, float]]:
    """Per candidate, the estimated per-layer ``{"forward": s, "backward": s}`` (slowest rank)."""
    cp = sharding.cp_size
    sh = _Shape(num_heads, num_kv_heads, head_dim, v_head_dim, element_size)
    kv_row = num_kv_heads * (head_dim + v_head_dim) * element_size
    grad_row = num_kv_heads * (head_dim + v_head_dim) * acc_bytes(element_size)
    owner = np.repeat(np.arange(cp), np.diff(sharding.rank_ptr))
    counts = np.bincount(owner, weights=sharding.seg[:, 2] - sharding.seg[:, 1], minlength=cp).astype(np.int64)
    ranks = np.arange(cp)
    lat = profile.latency_us * 1e-6
    flat = None
    out: dict[str, dict[str, float]] = {}
    for ct in candidates:
        if ct in ("p2p", "all_gather"):
            if flat is None:
                lens = np.diff(np.asarray(sharding.cu_seqlens, np.int64))
                staged = "p2p" in candidates and schedules.P2P_SCHEDULE == "staged"
                staged = staged and staged_fits(sharding.seg, owner, lens, cp, mask)
                flat = geometry(sharding.seg, owner, cp, mask, ring="p2p" in candidates,
                                gather="all_gather" in candidates or staged)  # fmt: skip
            if ct == "p2p" and staged:
                local = local_share(sharding.seg, owner, counts, mask)
                bw = _collective_bw(ranks, np.zeros(cp, np.int64), np.full(cp, cp - 1), profile)
                t = staged_times(flat, local, kv_row, grad_row, num_heads, sh, profile, bw)
            elif ct == "p2p":
                zero = dict.fromkeys(PHASES, np.zeros(cp))
                t = _ring_times(flat, ranks, lambda j: j, kv_row, grad_row, num_heads, sh, profile, zero)
            else:
                block = (cp - 1) * int(counts.max())
                bw = _collective_bw(ranks, np.zeros(cp, np.int64), np.full(cp, cp - 1), profile)
                coll = {"forward": lat * (cp - 1) + block * kv_row / bw,
                        "backward": lat * (cp - 1) + block * (kv_row + grad_row) / bw}  # fmt: skip
                comp = sh.compute_s(flat.area_all, flat.calls_all, num_heads, profile)
                t = {p: coll[p] + comp[p] for p in PHASES}
        else:
            a = cp if ct == "a2a" else a2a_size
            t = _a2a_times(sharding, owner, mask, a, counts, sh, profile)
        out[ct] = {p: float(np.max(t[p])) for p in PHASES}
    return out


def _unions(seg: np.ndarray, group: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each group's segments in (sequence, position) order with adjacent ones joined (what
    ``schedules.a2a.group_union`` lays out), all groups at once: ``(seg, group)``."""
    keep = seg[:, 2] > seg[:, 1]
    seg, group = seg[keep], group[keep]
    order = np.lexsort((seg[:, 1], seg[:, 0], group))
    seg, group = seg[order], group[order]
    head = np.ones(len(seg), bool)
    head[1:] = (group[1:] != group[:-1]) | (seg[1:, 0] != seg[:-1, 0]) | (seg[1:, 1] != seg[:-1, 2])
    first = np.nonzero(head)[0]
    last = np.append(first[1:], len(seg))[: len(first)] - 1  # no segments: none
    return np.stack([seg[first, 0], seg[first, 1], seg[last, 2]], axis=1), group[first]


def _a2a_times(sharding: CPSharding, owner, mask: MaskSpec, a: int, counts: np.ndarray, sh: _Shape, prof) -> dict:
    cp = sharding.cp_size
    useg, ugroup = _unions(sharding.seg, owner // a)
    lens = np.diff(np.asarray(sharding.cu_seqlens, np.int64))
    staged = cp > a and schedules.P2P_SCHEDULE == "staged" and staged_fits(useg, ugroup, lens, cp // a, mask)
    geo = geometry(useg, ugroup, cp // a, mask, gather=staged)
    q_parts, kv_parts = _split_heads(sh.hq, sh.hkv, a)
    nq = np.array([y - x for x, y in q_parts])
    nkv = np.array([y - x for x, y in kv_parts])
    ranks = np.arange(cp)
    g, me = ranks // a, ranks % a
    tokens = counts
    gsum = counts.reshape(-1, a).sum(axis=1)[g]
    out_q = tokens * (nq.sum() - nq[me])
    out_kv = tokens * (nkv.sum() - nkv[me])
    in_q, in_kv = (gsum - tokens) * nq[me], (gsum - tokens) * nkv[me]
    fo, fi, bo, bi = a2a_bytes(out_q, out_kv, in_q, in_kv, sh.d, sh.dv, sh.es, sh.hkv < a)
    fwd, bwd = np.maximum(fo, fi), np.maximum(bo, bi)
    coll = dict.fromkeys(PHASES, np.zeros(cp))
    if a > 1:
        lat = prof.latency_us * 1e-6
        bw = _collective_bw(ranks, g * a, g * a + a - 1, prof)
        coll = {"forward": lat * (a - 1) + fwd / bw, "backward": lat * (a - 1) + bwd / bw}
    heads = nq[me]
    kv_row = nkv[me] * (sh.d + sh.dv) * sh.es * (heads > 0)  # without query heads: no ring across groups
    grad_row = nkv[me] * (sh.d + sh.dv) * acc_bytes(sh.es) * (heads > 0)
    if staged:
        return _staged_a2a(geo, local_share(useg, ugroup, gsum[::a], mask), a, nq, nkv, sh, prof, coll)
    return _ring_times(geo, g, lambda j: j * a + me, kv_row, grad_row, heads, sh, prof, coll)


def _staged_a2a(geo, local, a: int, nq, nkv, sh: _Shape, prof, coll: dict) -> dict:
    """a2a+p2p with its ring across the groups staged: per member index ``m``, the participants
    (groups) run :func:`.estimate_staged.staged_times` over its head shard, after the
    collectives ``coll``; a member without heads computes and sends nothing."""
    n = geo.area.shape[0]
    out = {p: np.array(coll[p], np.float64, copy=True) for p in PHASES}
    for m in range(a):
        if not nq[m]:
            continue
        cp_rank = np.arange(n) * a + m
        bw = _collective_bw(cp_rank, np.full(n, m), np.full(n, (n - 1) * a + m), prof)
        row = nkv[m] * (sh.d + sh.dv)
        t = staged_times(geo, local, row * sh.es, row * acc_bytes(sh.es), int(nq[m]), sh, prof, bw)
        for p in PHASES:
            out[p][cp_rank] += t[p]
    return out

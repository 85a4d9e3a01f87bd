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

It is an estimate: the exact plans fuse adjacent full blocks and compress a rank's own
causal pieces into one entry, which changes tile rounding and call counts a little. It
prices the ``flash`` kernel only (the ``reference`` kernel's padded rectangles depend on
the exact call grouping; CPU profiles keep the full model). ``tests/L0/test_auto_estimate.py``
checks on a randomised family that it picks the full model's winner or one within 2% of it.
"""

from __future__ import annotations

import numpy as np

from ..geometry import BIG, bounds, tile_area
from ..masks import MaskSpec
from ..plan.calls import MAX_SLICE_CALLS, Layout, _fuse, _join, _pieces, merge_ranges
from ..schedules.a2a import group_union
from ..schedules.heads import split_heads
from ..sharding import CPSharding
from .cost import PHASES
from .profiles import HardwareProfile

__all__ = ["Geometry", "geometry", "estimate_times"]


class Geometry:
    """Pairwise work of ``n`` participants: ``area[u, o]`` flash tile entries per head of u's
    queries on o's keys, ``calls[u, o]`` varlen calls, ``need[u, o]`` rows of o's block u
    sees; ``area_all[u]``, ``calls_all[u]``: the same against all keys in one buffer."""

    def __init__(self, area, calls, need, area_all, calls_all) -> None:
        self.area, self.calls, self.need = area, calls, need
        self.area_all, self.calls_all = area_all, calls_all


def _runs(keys: list[np.ndarray], out: np.ndarray, size: int) -> np.ndarray:
    """Per ``out`` id, the calls of entries grouped by ``keys`` (the last four: ``q0, q1, k0,
    k1`` rows), as :func:`~megatron_cp_ext.plan.calls.plan_steps` splits them: entries over the
    very same query rows go to separate calls (levels); a level whose entries form at most
    ``MAX_SLICE_CALLS`` runs of consecutive rows is that many slice calls, else one gather."""
    if not len(out):
        return np.zeros(size, np.int64)
    *group, q0, q1, k0, k1 = keys
    order = np.lexsort((k0, q1, q0, *group[::-1]))
    group, q0, q1, k0, k1, out = [g[order] for g in group], q0[order], q1[order], k0[order], k1[order], out[order]
    head = _starts(group)
    same_rows = _starts([*group, q0, q1])
    idx = np.arange(len(q0))
    level = idx - np.maximum.accumulate(np.where(same_rows, idx, 0))
    order = np.lexsort((k0, q0, level, *group[::-1]))
    group, q0, q1, k0, k1, out, level = ([g[order] for g in group], q0[order], q1[order], k0[order], k1[order],
                                         out[order], level[order])  # fmt: skip
    head = _starts([*group, level])
    brk = head.copy()
    brk[1:] |= (q0[1:] != q1[:-1]) | (k0[1:] != k1[:-1])
    first = np.nonzero(head)[0]
    runs = np.add.reduceat(brk, first)
    calls = np.where(runs <= MAX_SLICE_CALLS, runs, 1)
    return np.bincount(out[first], weights=calls, minlength=size).astype(np.int64)


def _starts(cols: list[np.ndarray]) -> np.ndarray:
    """Start flags of runs of equal rows of ``cols`` (sorted)."""
    flag = np.zeros(len(cols[0]), bool)
    flag[0] = True
    for c in cols:
        flag[1:] |= c[1:] != c[:-1]
    return flag


def geometry(parts: list[np.ndarray], mask: MaskSpec) -> Geometry:
    """:class:`Geometry` of participants holding ``parts[j]`` (``[k, 3]`` ``(seq, start, end)``)."""
    n = len(parts)
    lay = Layout.concat([Layout.packed(s[:, 0], s[:, 1], s[:, 2], buf=j) for j, s in enumerate(parts)])
    p = _pieces(lay, mask.chunk)
    qi, ki = _join(p, p)
    lo, up = bounds(mask)
    qs, qe, ks, ke = p.start[qi], p.end[qi], p.start[ki], p.end[ki]
    u, o = p.buf[qi], p.buf[ki]
    # rows of o's block some query of u sees (what a p2p transfer carries)
    r0 = p.row[ki] + np.maximum(ks, qs - lo) - ks
    r1 = p.row[ki] + np.minimum(ke, qe + up) - ks
    key, ra, rb = merge_ranges(u * n + o, r0, r1)
    need = np.bincount(key, weights=rb - ra, minlength=n * n).astype(np.int64).reshape(n, n)
    np.fill_diagonal(need, 0)
    # the band entries of each piece pair (as ``geometry.band_blocks``, inlined: no flash flags)
    a = np.maximum(qs, ks - up)
    b = np.minimum(qe, ke + lo)
    k0 = np.maximum(ks, a - lo)
    k1 = np.minimum(ke, b + up)
    keep = (a < b) & (k0 < k1)
    a, b, k0, k1, qi, u, o = a[keep], b[keep], k0[keep], k1[keep], qi[keep], u[keep], o[keep]
    sq, sk = b - a, k1 - k0
    c = sk - sq
    left = np.minimum(lo, BIG) + k1 - b
    right = np.minimum(up, BIG) + b - k1
    left = np.where((lo >= BIG) | ((sq - 1) + c - left <= 0), -1, left)
    right = np.where((up >= BIG) | (c + right >= sk - 1), -1, right)
    q0 = p.row[qi] + a - p.start[qi]
    kr = p.row[ki[keep]] + k0 - ks[keep]
    if lo >= BIG and up == 0:  # plain causal: a unit's own pieces become one causal entry
        u, o, q0, sq, kr, sk, left, right = _compress(p, u, o, qi, (q0, sq, kr, sk, left, right))
    pair = u * n + o
    # p2p receives only the needed ranges, packed: key rows there
    code = key * BIG + ra
    at = np.maximum(np.searchsorted(code, pair * BIG + kr, "right") - 1, 0)
    packed = np.cumsum(rb - ra) - (rb - ra)
    packed -= packed[np.searchsorted(key, key)] if len(key) else 0
    kp = np.where(u == o, kr, kr - ra[at] + packed[at]) if len(key) else kr
    area, calls = _price(pair, n * n, q0, sq, kp, sk, left, right)
    # all_gather: every rank's block at its own offset (never consecutive across ranks)
    area_all, calls_all = _price(u, n, q0, sq, kr + o * BIG, sk, left, right)
    return Geometry(area.reshape(n, n), calls.reshape(n, n), need, area_all, calls_all)


def _price(buf, size, q0, sq, k0, sk, left, right) -> tuple[np.ndarray, np.ndarray]:
    """Tile area and calls per ``buf`` id of entries ``[q0, q0 + sq) x [k0, k0 + sk)`` (rows)
    with flash windows ``(left, right)``, after fusing adjacent fully visible entries as
    ``plan.calls._entries`` does."""
    full = (left < 0) & (right < 0)
    f = [x[full] for x in (buf, q0, q0 + sq, k0, k0 + sk)]
    for _ in range(3):
        m = len(f[0])
        f = list(_fuse(*f, by_q=True))
        f = list(_fuse(*f, by_q=False))
        if len(f[0]) == m:
            break
    band = ~full
    none = np.full(len(f[0]), -1)
    buf, q0, q1, k0, k1 = (np.concatenate([x, y[band]]) for x, y in zip(f, (buf, q0, q0 + sq, k0, k0 + sk)))
    left, right = np.concatenate([none, left[band]]), np.concatenate([none, right[band]])
    area = np.bincount(buf, weights=tile_area(q1 - q0, k1 - k0, left, right), minlength=size)
    return area, _runs([buf, left, right, q0, q1, k0, k1], buf, size)


def _compress(p, u, o, qi, cols):
    """Replace the entries among a participant's own >= 2 pieces of one unit (at consecutive
    rows in position order) by one causal entry over them (``plan.calls._compressed``)."""
    order = np.lexsort((p.start, p.unit, p.buf))
    buf, unit, start, end, row = p.buf[order], p.unit[order], p.start[order], p.end[order], p.row[order]
    head = _starts([buf, unit])
    cont = head.copy()
    cont[1:] |= row[1:] == row[:-1] + end[:-1] - start[:-1]
    first = np.nonzero(head)[0]
    count = np.diff(np.append(first, len(buf)))
    ok = (count >= 2) & np.logical_and.reduceat(cont, first)
    gid = np.empty(len(buf), np.int64)
    gid[order] = np.cumsum(head) - 1
    drop = (u == o) & ok[gid[qi]]
    sel = first[ok]
    total = np.add.reduceat(end - start, first)[ok]
    q0, sq, kr, sk, left, right = (c[~drop] for c in cols)
    none = np.full(len(sel), -1)
    cat = lambda x, y: np.concatenate([x, y]).astype(np.int64)  # noqa: E731
    return (cat(u[~drop], buf[sel]), cat(o[~drop], buf[sel]), cat(q0, row[sel]), cat(sq, total), cat(kr, row[sel]),
            cat(sk, total), cat(left, none), cat(right, none + 1))  # fmt: skip


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
    steps = []
    for s in range(1, n):
        src, dst = (part - s) % n, (part + s) % n
        recv, send = geo.need[part, src], geo.need[dst, part]
        active = (recv > 0) | (send > 0)
        if active.any():
            comp = sh.compute_s(geo.area[part, src], geo.calls[part, src] * live, heads, prof)
            steps.append((active, recv, send, cp_of(src), cp_of(dst), comp))
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
    grad_row = num_kv_heads * (head_dim + v_head_dim) * 4
    counts = np.array(sharding.counts(), np.int64)
    ranks = np.arange(cp)
    lat = profile.latency_us * 1e-6
    flat = None
    out: dict[str, dict[str, float]] = {}
    for ct in candidates:
        if ct in ("p2p", "all_gather"):
            if flat is None:
                flat = geometry([sharding.rank_segments(r) for r in range(cp)], mask)
            if ct == "p2p":
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
            t = _a2a_times(sharding, mask, a, counts, sh, profile)
        out[ct] = {p: float(np.max(t[p])) for p in PHASES}
    return out


def _a2a_times(sharding: CPSharding, mask: MaskSpec, a: int, counts: np.ndarray, sh: _Shape, prof) -> dict:
    cp = sharding.cp_size
    unions = [group_union(sharding, range(g * a, (g + 1) * a))[0] for g in range(cp // a)]
    geo = geometry(unions, mask)
    q_parts, kv_parts = split_heads(sh.hq, sh.hkv, a)
    nq = np.array([y - x for x, y in q_parts])
    nkv = np.array([y - x for x, y in kv_parts])
    ranks = np.arange(cp)
    g, me = ranks // a, ranks % a
    tokens = counts
    gsum = counts.reshape(-1, a).sum(axis=1)[g]
    out_q = tokens * (nq.sum() - nq[me])
    out_kv = tokens * (nkv.sum() - nkv[me])
    in_q, in_kv = (gsum - tokens) * nq[me], (gsum - tokens) * nkv[me]
    es = sh.es
    q_w, o_w, kv_w = sh.d * es, sh.dv * es, (sh.d + sh.dv) * es
    fwd = np.maximum(out_q * q_w + out_kv * kv_w + in_q * o_w, in_q * q_w + in_kv * kv_w + out_q * o_w)
    bwd = np.maximum(out_q * o_w + in_q * q_w + in_kv * kv_w, in_q * o_w + out_q * q_w + out_kv * kv_w)
    coll = dict.fromkeys(PHASES, np.zeros(cp))
    if a > 1:
        lat = prof.latency_us * 1e-6
        bw = _collective_bw(ranks, g * a, g * a + a - 1, prof)
        coll = {"forward": lat * (a - 1) + fwd / bw, "backward": lat * (a - 1) + bwd / bw}
    heads = nq[me]
    kv_row = nkv[me] * (sh.d + sh.dv) * sh.es
    grad_row = nkv[me] * (sh.d + sh.dv) * 4
    return _ring_times(geo, g, lambda j: j * a + me, kv_row, grad_row, heads, sh, prof, coll)

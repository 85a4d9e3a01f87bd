"""The staged ``p2p`` schedule priced from :mod:`.estimate`'s shared geometry (what
``comm_type="auto"`` uses where the schedule runs, ``schedules.staged_plan.staged_fits``)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..masks import MaskSpec
from ..masks.geometry import bounds
from ..plan.calls import Layout, _join, _pieces, merge_ranges
from .profiles import HardwareProfile

__all__ = ["Local", "local_share", "staged_times"]


class Local(NamedTuple):
    """Per rank, how the staged schedule splits its query rows (:func:`local_share`)."""

    share: np.ndarray
    """Share of its query rows in the local stage (they see only own keys)."""
    local_runs: np.ndarray
    """Runs of local rows: the local stage's calls, about."""
    joined_runs: np.ndarray
    """Runs of joined rows (at most two): the joined stage's calls are at least these."""


def local_share(seg: np.ndarray, owner: np.ndarray, counts: np.ndarray, mask: MaskSpec) -> Local:
    """Per rank, the query rows that see some other rank's key, covered by at most two runs
    as the plan covers them (:func:`..schedules.staged_plan._remote_rows` and ``_two_runs``,
    all ranks at once); the rest are the local stage's."""
    seg = np.asarray(seg, np.int64).reshape(-1, 3)
    length = seg[:, 2] - seg[:, 1]
    at = np.cumsum(length) - length
    first = np.searchsorted(owner, owner, "left")
    p = _pieces(
        Layout(seg[:, 0], seg[:, 1], seg[:, 2], at - at[first] if len(at) else at, owner), mask.chunk, mask.muted
    )
    qi, ki = _join(p, p)
    qi, ki = qi[p.buf[qi] != p.buf[ki]], ki[p.buf[qi] != p.buf[ki]]
    lo, up = bounds(mask)
    p0 = np.maximum(p.start[qi], p.start[ki] - up)
    p1 = np.minimum(p.end[qi], p.end[ki] + lo)
    r0 = p.row[qi] + (p0 - p.start[qi])
    key, a, b = merge_ranges(p.buf[qi], r0, r0 + (p1 - p0))
    n = len(counts)
    runs = np.bincount(key, minlength=n)
    start = np.cumsum(runs) - runs
    last = start + np.maximum(runs, 1) - 1
    # the largest gap of each rank with three runs or more is left out (the two runs' hull)
    gap = np.full(len(a), -1, np.int64)
    same = np.zeros(len(a), bool)
    same[:-1] = key[1:] == key[:-1]
    gap[:-1] = np.where(same[:-1], a[1:] - b[:-1], -1)
    covered = np.bincount(key, weights=b - a, minlength=n)
    many = np.nonzero(runs > 2)[0]
    if len(many):
        order = np.lexsort((-gap, key))  # per rank, its largest gap first
        pick = order[np.searchsorted(key[order], many)]
        span = b[last[many]] - a[start[many]]
        covered[many] = span - gap[pick]
    kept = np.minimum(runs, 2)
    has = runs > 0
    head = has & (a[np.minimum(start, len(a) - 1)] > 0) if len(a) else has
    tail = has & (b[np.minimum(last, len(b) - 1)] < counts) if len(b) else has
    local_runs = np.where(has, head.astype(np.int64) + (kept - 1) + tail, counts > 0)
    share = np.where(counts > 0, 1.0 - covered / np.maximum(counts, 1), 1.0)
    return Local(share, local_runs.astype(np.int64), kept.astype(np.int64))


def staged_times(geo, local: Local, kv_row, grad_row, heads, sh, prof: HardwareProfile, bw: np.ndarray) -> dict:
    """Layer time per phase of the staged ``p2p`` schedule (:mod:`..schedules.staged`): one
    exchange with every peer, posted with the local stage and awaited by the joined stage;
    in backward the dK/dV partials then go home. An approximation (``auto`` prices the ring
    more exactly): the calls are priced as the gathered buffer's (``area_all``: document-
    ordered keys), the local stage as the own block's area (``area[u, u]``) times the share of
    rows that see only own keys (``local``), with a call per run of each stage's rows."""
    n = geo.area.shape[0]
    need = geo.need * (1 - np.eye(n, dtype=geo.need.dtype))
    recv, send = need.sum(axis=1), need.sum(axis=0)
    peers = ((need > 0) | (need.T > 0)).sum(axis=1)
    lat = prof.latency_us * 1e-6 * peers
    kv = np.where(peers > 0, lat + np.maximum(recv, send) * kv_row / bw, 0.0)
    home = np.where(peers > 0, lat + np.maximum(recv, send) * grad_row / bw, 0.0)
    area_local = np.minimum(np.diag(geo.area) * local.share, geo.area_all)
    c_local = sh.compute_s(area_local, np.where(local.share > 0, local.local_runs, 0), heads, prof)
    # the joined stage's calls: at least one per run of its rows, and as many as the gathered
    # buffer's entries break into where that is more (an estimate: the plan's own count
    # depends on how its entries group)
    joined = np.where(local.share < 1, np.maximum(geo.calls_all, local.joined_runs), 0)
    c_joined = sh.compute_s(geo.area_all - area_local, joined, heads, prof)
    return {
        "forward": np.maximum(c_local["forward"], kv) + c_joined["forward"],
        "backward": np.maximum(c_local["backward"], kv) + c_joined["backward"] + home,
    }

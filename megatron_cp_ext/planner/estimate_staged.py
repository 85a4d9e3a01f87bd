"""The staged ``p2p`` schedule priced from :mod:`.estimate`'s shared geometry (what
``comm_type="auto"`` uses where the schedule runs, ``schedules.staged_plan.staged_fits``)."""

from __future__ import annotations

import numpy as np

from ..geometry import bounds
from ..masks import MaskSpec
from ..plan.calls import Layout, _join, _pieces, merge_ranges
from .profiles import HardwareProfile

__all__ = ["local_share", "staged_times"]


def local_share(seg: np.ndarray, owner: np.ndarray, counts: np.ndarray, mask: MaskSpec) -> np.ndarray:
    """Per rank, the share of its query rows that see no other rank's key (the staged
    schedule's local stage; :func:`..schedules.staged_plan._remote_rows`, all ranks at once)."""
    seg = np.asarray(seg, np.int64).reshape(-1, 3)
    length = seg[:, 2] - seg[:, 1]
    at = np.cumsum(length) - length
    first = np.searchsorted(owner, owner, "left")
    p = _pieces(Layout(seg[:, 0], seg[:, 1], seg[:, 2], at - at[first] if len(at) else at, owner), mask.chunk)
    qi, ki = _join(p, p)
    qi, ki = qi[p.buf[qi] != p.buf[ki]], ki[p.buf[qi] != p.buf[ki]]
    lo, up = bounds(mask)
    p0 = np.maximum(p.start[qi], p.start[ki] - up)
    p1 = np.minimum(p.end[qi], p.end[ki] + lo)
    r0 = p.row[qi] + (p0 - p.start[qi])
    key, a, b = merge_ranges(p.buf[qi], r0, r0 + (p1 - p0))
    remote = np.bincount(key, weights=b - a, minlength=len(counts))
    return np.where(counts > 0, 1.0 - remote / np.maximum(counts, 1), 1.0)


def staged_times(geo, local, kv_row, grad_row, heads, sh, prof: HardwareProfile, bw: np.ndarray) -> dict:
    """Layer time per phase of the staged ``p2p`` schedule (:mod:`..schedules.staged`): one
    exchange with every peer, posted with the local stage and awaited by the joined stage;
    in backward the dK/dV partials then go home. An approximation (``auto`` prices the ring
    more exactly): the calls are priced as the gathered buffer's (``area_all``: document-
    ordered keys), the local stage as the own block's area (``area[u, u]``) times the share of
    rows that see only own keys (``local``), plus one call where both stages run."""
    n = geo.area.shape[0]
    need = geo.need * (1 - np.eye(n, dtype=geo.need.dtype))
    recv, send = need.sum(axis=1), need.sum(axis=0)
    peers = ((need > 0) | (need.T > 0)).sum(axis=1)
    lat = prof.latency_us * 1e-6 * peers
    kv = np.where(peers > 0, lat + np.maximum(recv, send) * kv_row / bw, 0.0)
    home = np.where(peers > 0, lat + np.maximum(recv, send) * grad_row / bw, 0.0)
    both = (local > 0) & (local < 1)
    area_local = np.minimum(np.diag(geo.area) * local, geo.area_all)
    c_local = sh.compute_s(area_local, both.astype(np.int64), heads, prof)
    c_joined = sh.compute_s(geo.area_all - area_local, geo.calls_all, heads, prof)
    return {
        "forward": np.maximum(c_local["forward"], kv) + c_joined["forward"],
        "backward": np.maximum(c_local["backward"], kv) + c_joined["backward"] + home,
    }

"""The exact tile step of the ``workload`` balance, side by side: the pick without it and with it.

    python benchmarks/tile_step.py [--count N] [--seed S]

On the batches of ``balance_family.py`` (same family for the same seed and count) under its six
masks, shards every batch with ``balance_pick.TILE_STEP`` off and on, one right after the
other (CPU times are then comparable on a shared machine), and prints per tokens-per-rank band
the share of batches meeting the tile goal; the largest work max/mean and its excess over
dual-chunk's; on how many batches the pick changed, the largest rank's exact tile area rose,
or the goal was newly met or newly missed; and the median and worst ``shard_sequences`` CPU
time (each the smaller of two runs above ``RECHECK_MS``, as ``balance_family.py`` measures).
Tile areas are :func:`megatron_cp_ext.tile_pick.rank_tiles`, which equal ``inspect_plan``'s.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from balance_family import MASKS, _shard, family

import megatron_cp_ext as mcx
from megatron_cp_ext import balance_pick
from megatron_cp_ext.balance_pick import rank_work
from megatron_cp_ext.batches import cu_seqlens
from megatron_cp_ext.masks import MaskSpec
from megatron_cp_ext.tile_pick import GOAL, GOAL_OF_ONE, rank_tiles

BANDS = ((0, 1024), (1024, 4096), (4096, float("inf")))
SIDES = ("off", "on")


def measure(batches) -> list[dict]:
    rows = []
    for lens, cp in batches:
        cu, lens_a = cu_seqlens(lens), np.asarray(lens, np.int64)
        for kw in MASKS.values():
            mask = MaskSpec.make(**kw)
            one = mcx.inspect_plan(mcx.shard_sequences(cu, 1, **kw), "p2p", **kw).tile_efficiency
            r, segs = {"per rank": cu[-1] / cp}, {}
            for side in SIDES:
                balance_pick.TILE_STEP = side == "on"
                sh, r[side + " ms"] = _shard(cu, cp, "workload", kw)
                segs[side] = [sh.rank_segments(k) for k in range(cp)]
            balance_pick.TILE_STEP = True
            dual = mcx.shard_sequences(cu, cp, "dualchunk", **kw)
            segs["dual"] = [dual.rank_segments(k) for k in range(cp)]
            for (side, s), area in zip(segs.items(), rank_tiles(list(segs.values()), mask), strict=True):
                w = rank_work(lens_a, s, mask)
                r[side + " work"] = float(w.max() / w.mean()) if w.mean() else 1.0
                eff = float(w.sum() / max(area.sum(), 1))
                r[side + " goal"] = eff >= GOAL or (one > 0 and eff / one >= GOAL_OF_ONE)
                r[side + " max"] = int(area.max())
            r["changed"] = not all(np.array_equal(a, b) for a, b in zip(segs["off"], segs["on"], strict=True))
            rows.append(r)
    return rows


def report(rows: list[dict]) -> list[str]:
    out = []
    for side in SIDES:
        shares = []
        for lo, hi in BANDS:
            band = [r[side + " goal"] for r in rows if lo <= r["per rank"] < hi]
            shares.append(f"{100 * np.mean(band):.0f} % of {len(band)}" if band else "-")
        ms = [r[side + " ms"] for r in rows]
        fair = [r[side + " work"] - r["dual work"] for r in rows if r["dual work"] <= balance_pick.WORK_BOUND]
        out.append(
            f"step {side}: tile goal met (< 1K / 1K-4K / >= 4K per rank) {' / '.join(shares)}; "
            f"work max {max(r[side + ' work'] for r in rows):.4f}, "
            f"minus dual-chunk's where that is within 1.03: {max(fair or [0.0]):+.4f}; "
            f"shard ms median {np.median(ms):.1f}, worst {max(ms):.1f}"
        )
    n = len(rows)
    out.append(
        f"{sum(r['changed'] for r in rows)} of {n} changed; largest rank's tile area rose on "
        f"{sum(r['on max'] > r['off max'] for r in rows)}, fell on {sum(r['on max'] < r['off max'] for r in rows)}; "
        f"goal newly met on {sum(r['on goal'] and not r['off goal'] for r in rows)}, "
        f"newly missed on {sum(r['off goal'] and not r['on goal'] for r in rows)}"
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=36, help="batches in the family")
    ap.add_argument("--seed", type=int, default=2024, help="family seed")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print("\n".join(report(measure(family(args.count, False, args.seed)))))


if __name__ == "__main__":
    main()

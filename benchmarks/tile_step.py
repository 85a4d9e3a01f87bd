"""A step of the ``workload`` balance, side by side: the pick without it and with it.

    python benchmarks/tile_step.py [--count N] [--seed S] [--step tile|reference] [--long] [--masks M,...]

``--step tile`` (default): the exact tile step (``balance.pick.TILE_STEP``); ``--step
reference``: the reference step (``balance.pick.PATH_STEP``: the contiguous or dual-chunk split
where it is shorter on every count of the critical path). On the batches of
``balance_family.py`` (same family for the same seed and count; ``--long``: a family of one to
three long documents instead, totals 16K-1M, the batches the reference step is for) under its
six masks (or ``--masks``), shards every batch with the step off and on, one right after the
other (CPU times are then comparable on a shared machine), and prints per tokens-per-rank band
the share of batches meeting the tile goal; the largest work max/mean and its excess over
dual-chunk's; on how many batches the pick changed, the largest rank's exact tile area rose,
or the goal was newly met or newly missed; for the changed ones the largest rank's tile area,
ring steps and rows sent after over before (median / worst); and the median and worst
``shard_sequences`` CPU time (each the smaller of two runs above ``RECHECK_MS``, as
``balance_family.py`` measures). Counts are :func:`megatron_cp_ext.balance.tile_pick.rank_paths`,
which equal ``inspect_plan``'s. ``--predict`` also prints, over the changed batches, the
cost model's p2p layer time (forward + backward) with the step over without it, for three head
shapes and with CP ranks over NVLink or all over InfiniBand (``mcx-plan``'s H100 profile).
``--examples`` prints, instead, six long-document batches under sliding windows with the
reference step off and on: the largest rank's calls, tile area and rows sent, work, tile
efficiency, and the cost model's p2p layer time (64/8 heads, d 128, bf16).
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from balance_family import MASKS, _shard, family, mask_kw

import megatron_cp_ext as mcx
from megatron_cp_ext.balance import pick as balance_pick
from megatron_cp_ext.balance.pick import rank_work
from megatron_cp_ext.balance.tile_pick import GOAL, GOAL_OF_ONE, rank_paths
from megatron_cp_ext.masks import MaskSpec
from megatron_cp_ext.planner.cost import predict
from megatron_cp_ext.planner.profiles import load_profile
from megatron_cp_ext.sharding.batches import cu_seqlens

BANDS = ((0, 1024), (1024, 4096), (4096, float("inf")))
SIDES = ("off", "on")
FLAGS = {"tile": "TILE_STEP", "reference": "PATH_STEP"}
SHAPES = (dict(num_heads=64, num_kv_heads=8, head_dim=128), dict(num_heads=32, num_kv_heads=8, head_dim=128),
          dict(num_heads=16, num_kv_heads=16, head_dim=64))  # fmt: skip
"""``--predict``'s head shapes (bf16): GQA 8:1 and 4:1, and MHA with small heads (the most
communication per FLOP)."""


def long_family(count: int, seed: int) -> list[tuple[list[int], int]]:
    """``count`` batches of one to three long documents: totals log-uniform 16K-1M, CP 2-64."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        total, cp, docs = int(2 ** rng.uniform(14, 20)), int(2 ** rng.integers(1, 7)), int(rng.integers(1, 4))
        cuts = np.sort(rng.choice(np.arange(1, total), size=docs - 1, replace=False)) if docs > 1 else []
        out.append((np.diff(np.concatenate([[0], cuts, [total]])).astype(int).tolist(), cp))
    return out


def _predicted(shardings: dict, kw: dict) -> list[float]:
    """Cost-model layer time with the step over without it, per shape and link layout."""
    profiles = (load_profile("h100-nvlink-ib400"), load_profile("h100-nvlink-ib400", ranks_per_node=1))
    out = []
    for shape in SHAPES:
        reps = {s: mcx.inspect_plan(sh, "p2p", dtype=torch.bfloat16, **shape, **kw) for s, sh in shardings.items()}
        out += [predict(reps["on"], p).total_s / predict(reps["off"], p).total_s for p in profiles]
    return out


def measure(batches, flag: str, masks: dict, with_predict: bool = False) -> list[dict]:
    rows = []
    for lens, cp in batches:
        cu, lens_a = cu_seqlens(lens), np.asarray(lens, np.int64)
        for kw in masks.values():
            mask = MaskSpec.make(**kw)
            one = mcx.inspect_plan(mcx.shard_sequences(cu, 1, **kw), "p2p", **kw).tile_efficiency
            r, segs, shs = {"per rank": cu[-1] / cp}, {}, {}
            for side in SIDES:
                setattr(balance_pick, flag, side == "on")
                shs[side], r[side + " ms"] = _shard(cu, cp, "workload", kw)
                segs[side] = [shs[side].rank_segments(k) for k in range(cp)]
            setattr(balance_pick, flag, True)
            dual = mcx.shard_sequences(cu, cp, "dualchunk", **kw)
            segs["dual"] = [dual.rank_segments(k) for k in range(cp)]
            paths = rank_paths(list(segs.values()), mask)
            for i, (side, s) in enumerate(segs.items()):
                w, area = rank_work(lens_a, s, mask), paths.area[i]
                r[side + " work"] = float(w.max() / w.mean()) if w.mean() else 1.0
                eff = float(w.sum() / max(area.sum(), 1))
                r[side + " goal"] = eff >= GOAL or (one > 0 and eff / one >= GOAL_OF_ONE)
                r[side + " max"] = int(area.max())
                r[side + " steps"] = int(paths.steps[i].max())
                r[side + " sent"] = int(paths.sent[i].max())
            r["changed"] = not all(np.array_equal(a, b) for a, b in zip(segs["off"], segs["on"], strict=True))
            r["predicted"] = _predicted(shs, kw) if with_predict and r["changed"] else []
            rows.append(r)
    return rows


def _ratio(rows: list[dict], key: str) -> str:
    x = [r["on " + key] / r["off " + key] for r in rows if r["changed"] and r["off " + key]]
    return f"{np.median(x):.3f} / {max(x):.3f}" if x else "-"


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
    out.append(
        f"changed, on / off (median / worst): largest rank's tile area {_ratio(rows, 'max')}, "
        f"ring steps {_ratio(rows, 'steps')}, rows sent {_ratio(rows, 'sent')}"
    )
    pred = np.array([r["predicted"] for r in rows if r["predicted"]])
    if len(pred):
        out.append(
            f"predicted p2p layer time, on / off, changed batches x {pred.shape[1]} shape-link cases: "
            f"median {np.median(pred):.3f}, worst {pred.max():.3f}, best {pred.min():.3f}; "
            f"slower in {int((pred > 1).sum())} of {pred.size}"
        )
    return out


EXAMPLES = (
    ("one 48K document", [48495], 64, 2048),
    ("one 181K document", [181389], 64, 2048),
    ("one 1M document", [1 << 20], 64, 4096),
    ("four 64K documents", [65536] * 4, 64, 2048),
    ("eight 128K documents", [131072] * 8, 64, 4096),
    ("twenty 20K documents", [20000] * 20, 32, 1024),
)


def examples() -> list[str]:
    shape = dict(num_heads=64, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    profile = load_profile("h100-nvlink-ib400")
    head = ("| batch | cp | window | calls (largest rank) | largest rank's tile area | rows sent (largest rank) "
            "| work max/mean | tile eff | predicted p2p layer ms (fwd + bwd) |")  # fmt: skip
    out = [head, "|---" * 9 + "|"]
    for name, lens, cp, w in EXAMPLES:
        kw, side = dict(causal=True, window_size=(w, -1)), {}
        for on in SIDES:
            balance_pick.PATH_STEP = on == "on"
            rep = mcx.inspect_plan(mcx.shard_sequences(cu_seqlens(lens), cp, **kw), "p2p", **kw, **shape)
            rr = rep.ranks.values()
            side[on] = (max(len(x.calls) for x in rr), max(x.tile_area for x in rr),
                        max(x.bytes_sent["forward"] for x in rr) // rep.kv_row_bytes, rep.work_imbalance,
                        rep.tile_efficiency, predict(rep, profile).total_s * 1e3)  # fmt: skip
        balance_pick.PATH_STEP = True
        a, b = side["off"], side["on"]
        out.append(f"| {name} | {cp} | {w} | {a[0]} → {b[0]} | {b[1] / a[1]:.2f}× | {a[2]} → {b[2]} | "
                   f"{a[3]:.4f} → {b[3]:.4f} | {a[4]:.3f} → {b[4]:.3f} | {a[5]:.2f} → {b[5]:.2f} |")  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=36, help="batches in the family")
    ap.add_argument("--seed", type=int, default=2024, help="family seed")
    ap.add_argument("--step", choices=FLAGS, default="tile")
    ap.add_argument("--long", action="store_true", help="one to three long documents per batch")
    ap.add_argument("--masks", default=None, help="comma-separated masks instead of the six, e.g. window2048,chunk4096")
    ap.add_argument("--predict", action="store_true", help="cost-model layer time of the changed batches")
    ap.add_argument("--examples", action="store_true", help="six named long-document batches, the reference step")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.examples:
        print("\n".join(examples()))
        return
    masks = MASKS if args.masks is None else {m: mask_kw(m) for m in args.masks.split(",")}
    batches = long_family(args.count, args.seed) if args.long else family(args.count, False, args.seed)
    print("\n".join(report(measure(batches, FLAGS[args.step], masks, args.predict))))


if __name__ == "__main__":
    main()

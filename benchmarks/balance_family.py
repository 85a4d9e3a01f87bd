"""Balances on a randomized family of batches: distributions, not a handful of named batches.

    python benchmarks/balance_family.py [--count N] [--big] [--seed S] [--masks M,...] [--doc docs/performance.md]

Each batch draws a total (log-uniform 4K-256K tokens; 4K-1M with ``--big``), a CP size (2-64,
at least 64 tokens per rank), a median length (log-uniform 256-16K) and a log-std (0-2) of
lognormal lengths; one batch in six is a single long document instead. Every batch is
sharded by ``workload`` and ``dualchunk`` under every mask and planned for p2p through
``inspect_plan``; printed per mask, over the family: median, 95th percentile and worst of

* ``tok``: largest per-rank tokens over the mean; ``spread`` largest minus smallest;
* ``work``: largest per-rank attention work over the mean, and ``work-dual`` workload's minus
  dualchunk's on the same batch (> 0: workload is less balanced; the goal allows
  ``balance.pick.WORK_SLACK``, one token's share of work on ranks of a few hundred tokens);
* ``tiles``: useful score entries over the tile area the kernels visit, and ``tiles/1`` the same
  over that of the batch unsharded (documents too short for full tiles bound both);
* ``sent/need``, ``gathered`` (largest rank), ``plan ms`` (slowest rank's plan build, as
  ``inspect_plan`` times it), ``shard ms`` (CPU time of ``shard_sequences``); a time over
  ``RECHECK_MS`` is measured once more and the smaller kept (the machine may be shared).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

import megatron_cp_ext as mcx
from megatron_cp_ext.balance.pick import WORK_SLACK
from megatron_cp_ext.balance.workload import _work
from megatron_cp_ext.sharding.batches import cu_seqlens, lognormal

MASKS = {
    "causal": dict(causal=True),
    "window1024": dict(causal=True, window_size=(1024, -1)),
    "window4096": dict(causal=True, window_size=(4096, -1)),
    "window8192": dict(causal=True, window_size=(8192, -1)),
    "chunk8192": dict(causal=True, chunk_size=8192),
    "nomask": dict(causal=False),
}
DENSE = ("causal", "nomask")


def mask_kw(name: str) -> dict:
    """``causal``, ``nomask``, ``window<N>`` (causal, N keys back) or ``chunk<N>`` as
    ``shard_sequences`` keywords: other masks than the default six for held-out runs."""
    if name in ("causal", "nomask"):
        return dict(causal=name == "causal")
    for prefix, kw in (("window", lambda n: dict(window_size=(n, -1))), ("chunk", lambda n: dict(chunk_size=n))):
        if name.startswith(prefix) and name[len(prefix) :].isdigit():
            return dict(causal=True, **kw(int(name[len(prefix) :])))
    raise SystemExit(f"--masks: unknown mask {name!r} (causal, nomask, window<N>, chunk<N>)")


"""Masks whose plans need no gathered rows (sliding windows and chunks may)."""
SHAPES = dict(num_heads=64, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
STATS = ["tok", "spread", "work", "work-dual", "tiles", "tiles/1", "sent/need", "gathered", "plan ms", "shard ms"]


def family(count: int, big: bool, seed: int) -> list[tuple[list[int], int]]:
    """``count`` random ``(lengths, cp)`` batches (see the module docstring)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        total = int(2 ** rng.uniform(12, 20 if big else 18))
        cp = int(2 ** rng.integers(1, 7))
        while cp > 2 and total < 64 * cp:
            cp //= 2
        if i % 6 == 5:
            lens = [total]
        else:
            median, sigma = int(2 ** rng.uniform(8, 14)), float(rng.uniform(0, 2))
            lens = lognormal(total, median=median, sigma=sigma, seed=int(rng.integers(1 << 30)))
        out.append((lens, cp))
    return out


RECHECK_MS = 20.0
"""Host times above this are measured once more and the smaller kept: the machine is shared,
and one busy moment should not stand for the code's cost."""


def _shard(cu, cp, balance, mask_kw):
    """``(sharding, ms)``: CPU time of ``shard_sequences`` (re-measured above RECHECK_MS)."""
    best = float("inf")
    for _ in range(2):
        _work.cache_clear()  # each run cold, as a fresh process would be
        t0 = time.process_time()
        sh = mcx.shard_sequences(cu, cp, balance, **mask_kw)
        best = min(best, (time.process_time() - t0) * 1e3)
        if best <= RECHECK_MS:
            break
    return sh, best


def _plan(cu, cp, balance, mask_kw) -> dict:
    sh, shard_ms = _shard(cu, cp, balance, mask_kw)
    rep = mcx.inspect_plan(sh, "p2p", **mask_kw, **SHAPES)
    ranks = list(rep.ranks.values())
    plan_ms = max(r.plan_ms for r in ranks)
    if plan_ms > RECHECK_MS:  # the slowest rank's build, each rank's smaller of two
        again = mcx.inspect_plan(sh, "p2p", **mask_kw, **SHAPES).ranks
        plan_ms = max(min(r.plan_ms, again[k].plan_ms) for k, r in rep.ranks.items())
    return {
        "tok": rep.token_imbalance,
        "spread": max(rep.tokens) - min(rep.tokens),
        "work": rep.work_imbalance,
        "tiles": rep.tile_efficiency,
        "sent/need": rep.sent_over_needed,
        "gathered": max(r.gathered_rows for r in ranks),
        "plan ms": plan_ms,
        "shard ms": shard_ms,
    }


def measure(batches, progress=None) -> dict[str, dict[str, list[dict]]]:
    """Per mask, per balance: one dict of counts per batch."""
    out = {m: {"workload": [], "dualchunk": []} for m in MASKS}
    for i, (lens, cp) in enumerate(batches):
        cu = cu_seqlens(lens)
        for mask, kw in MASKS.items():
            one = mcx.inspect_plan(mcx.shard_sequences(cu, 1, **kw), "p2p", **kw, **SHAPES).tile_efficiency
            res = {b: _plan(cu, cp, b, kw) for b in ("workload", "dualchunk")}
            for b, r in res.items():
                r["per rank"] = cu[-1] / cp
                r["work-dual"] = r["work"] - res["dualchunk"]["work"]
                r["work-dual-abs"] = res["dualchunk"]["work"]
                r["tiles-dual"] = r["tiles"] - res["dualchunk"]["tiles"]
                r["tiles/1"] = r["tiles"] / one if one else 1.0
                out[mask][b].append(r)
        if progress:
            progress(i + 1, len(batches), f"{cu[-1]} tokens, cp {cp}")
    return out


def _summary(values: list[float]) -> tuple[float, float, float, float]:
    """(median, p95, worst, best): worst is the max, except for tile efficiencies (the min)."""
    v = np.asarray(values, dtype=float)
    v = v[~np.isnan(v)] if len(v) else v
    if not len(v):
        return (float("nan"),) * 4
    return float(np.median(v)), float(np.percentile(v, 95)), float(v.max()), float(v.min())


def table(res, balance: str) -> list[str]:
    """One row per mask: median / p95 / worst of every statistic (tiles: median / p5 / worst)."""
    head = ["mask", *STATS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for mask, per in res.items():
        cells = [mask]
        for k in STATS:
            vals = [r[k] for r in per[balance]]
            med, p95, worst, best = _summary(vals)
            if k in ("tiles", "tiles/1"):
                p5 = float(np.percentile(vals, 5))
                cells.append(f"{med:.3f} / {p5:.3f} / {best:.3f}")
            elif k in ("gathered", "spread"):
                cells.append(f"{med:.0f} / {p95:.0f} / {worst:.0f}")
            elif k.endswith("ms"):
                cells.append(f"{med:.1f} / {p95:.1f} / {worst:.1f}")
            else:
                cells.append(f"{med:.4f} / {p95:.4f} / {worst:.4f}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def goals(res) -> list[str]:
    """The issue's goals over the family for ``workload``, met or missed."""
    wl = {m: per["workload"] for m, per in res.items()}
    allr = [r for rows in wl.values() for r in rows]
    tiles_ok = [r["tiles"] >= 0.90 or r["tiles/1"] >= 0.95 for r in allr]

    def share(lo: float, hi: float) -> float:
        got = [ok for ok, r in zip(tiles_ok, allr, strict=True) if lo <= r["per rank"] < hi]
        return float(np.mean(got)) if got else 1.0

    fair = [r["tiles-dual"] for r in allr if r["work-dual-abs"] <= 1.03]
    checks = [
        ("tokens max - min <= 1", max(r["spread"] for r in allr), "<=", 1),
        ("work max/mean <= 1.03 (every mask)", max(r["work"] for r in allr), "<=", 1.03),
        ("work not above dualchunk's + 0.0005 (worst excess)", max(r["work-dual"] for r in allr), "<=", WORK_SLACK),
        ("tile eff >= 0.90 or >= 0.95 of unsharded (share of batches)", float(np.mean(tiles_ok)), ">=", 1.0),
        ("  the same, batches with < 1K tokens per rank", share(0, 1024), ">=", 1.0),
        ("  the same, batches with 1K-4K tokens per rank", share(1024, 4096), ">=", 1.0),
        ("  the same, batches with >= 4K tokens per rank", share(4096, float("inf")), ">=", 1.0),
        ("tile eff not below dualchunk's (worst difference)", min(r["tiles-dual"] for r in allr), ">=", 0.0),
        ("  the same, where dualchunk's work is within 1.03", min(fair or [0.0]), ">=", 0.0),
        ("p2p bytes sent / needed", max(r["sent/need"] for r in allr if r["sent/need"] == r["sent/need"]), "<=", 1.0),
        ("gathered rows on dense masks", max([r["gathered"] for m in DENSE if m in wl for r in wl[m]] or [0]), "<=", 0),
        ("plan build ms per rank <= 100", max(r["plan ms"] for r in allr), "<=", 100),
    ]  # fmt: skip
    out = ["| goal (workload, whole family) | worst | met |", "|---|---|---|"]
    for text, worst, op, bound in checks:
        ok = worst >= bound if op == ">=" else worst <= bound + 1e-12
        out.append(f"| {text} | {worst:.4f} | {'yes' if ok else 'no'} |")
    return out


def report(res, count: int) -> list[str]:
    lines = [f"{count} batches x {len(MASKS)} masks; cells: median / p95 / worst (tiles: median / p5 / worst)", ""]
    lines += goals(res) + ["", "workload:", ""] + table(res, "workload") + ["", "dualchunk:", ""]
    return lines + table(res, "dualchunk")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=36, help="batches in the family")
    ap.add_argument("--big", action="store_true", help="totals up to 1M tokens (slow: minutes per batch at cp 64)")
    ap.add_argument("--seed", type=int, default=2024, help="family seed")
    ap.add_argument("--doc", help="replace the family table between the balance:family markers of this page")
    ap.add_argument("--masks", help="comma-separated masks instead of the six above, e.g. window2048,chunk4096")
    args = ap.parse_args()
    if args.masks:
        MASKS.clear()
        MASKS.update({m: mask_kw(m) for m in args.masks.split(",")})
    torch.set_num_threads(1)
    batches = family(args.count, args.big, args.seed)
    res = measure(batches, lambda i, n, s: print(f"\r{i}/{n} {s:<32}", end="", flush=True))
    print()
    lines = report(res, len(batches))
    print("\n".join(lines))
    if args.doc:
        text = open(args.doc).read()
        start, end = "<!-- balance:family -->", "<!-- /balance:family -->"
        a, b = text.index(start) + len(start), text.index(end)
        with open(args.doc, "w") as f:
            f.write(text[:a] + "\n" + "\n".join(lines) + "\n" + text[b:])


if __name__ == "__main__":
    main()

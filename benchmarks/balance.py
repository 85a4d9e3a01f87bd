"""Balances side by side: what every rank's plan computes, sends and costs to build.

    python benchmarks/balance.py [--quick] [--family N] [--big] [--markdown out.md]
                                 [--doc docs/performance.md docs/balance_tables.md]

For balance in {dualchunk, contiguous, workload} x comm types x masks (causal, window 4096,
chunk 8192) x batches (lognormal long-tail 128K at cp 8 and 32, one 64K document with 157
short ones at cp 32, lognormal 1M at cp 32 and 64), everything counted exactly from the
plans through ``inspect_plan`` (128x128 tiles; bf16, 64 q heads, 8 KV heads, d 128):

* ``tok``: largest per-rank token count over the mean (every balance deals equal counts);
* ``work``: largest per-rank attention work over the mean;
* ``pad``: pad rows added for the comm type (all ranks);
* ``tiles``: useful score entries over the area of the tiles the kernels visit;
* ``vs TE``: forward bytes sent over those of TransformerEngine's p2p ring on the same batch
  (every rank's dual-chunk block, each sequence padded to a multiple of 2cp, sent cp-1 times);
* ``sent/need``: forward bytes sent over the KV bytes the ranks' queries see;
* ``calls``, ``gathered``: forward varlen calls and gathered rows per layer (largest rank);
* ``plan ms``: host time of the slowest rank's plan; ``shard ms``: ``shard_sequences`` (the
  faster of two calls).

Exact counts, not timings, except the two build times (one core of this machine).

Then the same for ``workload`` and ``dualchunk`` over a randomized family of ``--family``
batches (``balance_family.py``: totals 4K-256K, or up to 1M with ``--big``; cp 2-64; medians
256-16K; log-std 0-2; single long documents), as median / p95 / worst per mask, with the
tokens per rank.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

import megatron_cp_ext as mcx
from megatron_cp_ext.sharding.batches import cu_seqlens, lognormal, long_short

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import balance_family  # noqa: E402 - the family benchmark next to this file

MASKS = {
    "causal": dict(causal=True),
    "window4096": dict(causal=True, window_size=(4096, -1)),
    "chunk8192": dict(causal=True, chunk_size=8192),
}
COMMS = [("p2p", None), ("all_gather", None), ("a2a", None), ("a2a+p2p", 8)]
SHAPES = dict(num_heads=64, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)


def batches(quick: bool) -> list[tuple[str, list[int], list[int]]]:
    out = [
        ("lognormal 128K", lognormal(1 << 17, seed=0), [8, 32]),
        ("64K + 157 short", long_short(1 << 17, long=1 << 16, count=157, seed=0), [32]),
    ]
    if not quick:
        out.append(("lognormal 1M", lognormal(1 << 20, seed=0), [32, 64]))
    return out


def te_ring_bytes(lens: list[int], cp: int, kv_row: int) -> int:
    """TransformerEngine's p2p ring: padded dual-chunk blocks, each sent cp - 1 times."""
    padded = sum(-(-n // (2 * cp)) * 2 * cp for n in lens)
    return (cp - 1) * padded * kv_row


class Progress:
    def __init__(self, total: int) -> None:
        self.total, self.done, self.t0 = total, 0, time.perf_counter()

    def step(self, label: str) -> None:
        self.done += 1
        width = 30
        filled = width * self.done // self.total
        elapsed = time.perf_counter() - self.t0
        bar = "#" * filled + "." * (width - filled)
        print(f"\r[{bar}] {self.done}/{self.total} {elapsed:5.0f}s {label:<48}", end="", file=sys.stderr, flush=True)
        if self.done == self.total:
            print(file=sys.stderr)


def measure(lens, cp, balance, mask_kw, comm, a2a) -> dict:
    cu = cu_seqlens(lens)
    shard_ms = float("inf")
    for _ in range(2):  # the faster of two: one sample on a shared CPU can carry a collection pause
        t0 = time.perf_counter()
        sh = mcx.shard_sequences(cu, cp, balance, **mask_kw)
        shard_ms = min(shard_ms, (time.perf_counter() - t0) * 1e3)
    rep = mcx.inspect_plan(sh, comm, a2a_size=a2a, **mask_kw, **SHAPES)
    ranks = list(rep.ranks.values())
    sent = sum(r.bytes_sent["forward"] for r in ranks)
    need = sum(r.bytes_needed["forward"] for r in ranks)
    return {
        "tok": rep.token_imbalance,
        "work": rep.work_imbalance,
        "pad": sum(r.padding for r in ranks),
        "tiles": rep.tile_efficiency,
        "vs TE": sent / te_ring_bytes(lens, cp, rep.kv_row_bytes),
        "sent/need": sent / need if need else float("nan"),
        "calls": max(len(r.calls) for r in ranks),
        "gathered": max(r.gathered_rows for r in ranks),
        "plan ms": max(r.plan_ms for r in ranks),
        "shard ms": shard_ms,
    }


COLUMNS = ["tok", "work", "pad", "tiles", "vs TE", "sent/need", "calls", "gathered", "plan ms", "shard ms"]


def fmt(key: str, v) -> str:
    if key in ("pad", "calls", "gathered"):
        return str(int(v))
    if key in ("plan ms", "shard ms"):
        return f"{v:.1f}"
    return "-" if v != v else f"{v:.3f}"  # nan: nothing is needed (one rank holds all)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="skip the 1M-token batch")
    ap.add_argument("--markdown", help="also write the tables to this file")
    ap.add_argument("--doc", nargs="+", help="replace the tables between the balance markers of these pages "
                    "(docs/performance.md docs/balance_tables.md)")  # fmt: skip
    ap.add_argument("--family", type=int, default=36, help="batches in the randomized family (0: skip it)")
    ap.add_argument("--big", action="store_true", help="family totals up to 1M tokens (much slower)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    mcx.shard_sequences([0, 300, 600], 2)  # warm up (imports) before anything is timed
    jobs = [(name, lens, cp, b, m, c, a) for name, lens, cps in batches(args.quick) for cp in cps
            for m in MASKS for b in ("dualchunk", "contiguous", "workload") for c, a in COMMS]  # fmt: skip
    bar = Progress(len(jobs))
    rows = []
    for name, lens, cp, balance, mask, comm, a2a in jobs:
        res = measure(lens, cp, balance, MASKS[mask], comm, a2a)
        rows.append((name, cp, mask, balance, comm, res))
        bar.step(f"{name} cp{cp} {mask} {balance} {comm}")
    fam = []
    bar_f = Progress(args.family)
    if args.family:
        batches_ = balance_family.family(args.family, args.big, 2024)
        res = balance_family.measure(batches_, lambda i, n, s: bar_f.step(s))
        fam = balance_family.report(res, len(batches_))
    text = "\n".join([*goals(rows), "", *table(rows, lambda c: c == "p2p"), "", *table(rows, lambda c: True), "", *fam])
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
    if args.doc:
        write_doc(args.doc, rows, fam)


def table(rows, keep) -> list[str]:
    head = ["batch", "cp", "mask", "balance", "comm", *COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, cp, mask, balance, comm, res in rows:
        if keep(comm):
            cells = [name, str(cp), mask, balance, comm, *(fmt(k, res[k]) for k in COLUMNS)]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def write_doc(paths: list[str], rows, fam: list[str]) -> None:
    """Put the measured tables between ``<!-- balance:NAME -->`` / ``<!-- /balance:NAME -->``,
    in whichever of the pages ``paths`` holds each block (every block must be in one)."""
    parts = {"goals": goals(rows), "p2p": table(rows, lambda c: c == "p2p"), "all": table(rows, lambda c: True)}
    if fam:
        parts["family"] = fam
    texts = {p: open(p).read() for p in paths}
    for name, lines in parts.items():
        start, end = f"<!-- balance:{name} -->", f"<!-- /balance:{name} -->"
        path = next((p for p, t in texts.items() if start in t), None)
        if path is None:
            raise SystemExit(f"no page of {paths} holds the {start} block")
        text = texts[path]
        a, b = text.index(start) + len(start), text.index(end)
        texts[path] = text[:a] + "\n" + "\n".join(lines) + "\n" + text[b:]
    for path, text in texts.items():
        with open(path, "w") as f:
            f.write(text)


def goals(rows) -> list[str]:
    """The workload goals at cp 32 and 64, met or missed, from the rows above."""
    mine = [(n, cp, m, c, r) for n, cp, m, b, c, r in rows if b == "workload" and cp >= 32]
    p2p = [(n, cp, m, r) for n, cp, m, c, r in mine if c == "p2p"]
    checks = [
        ("max/mean tokens <= 1.001 (every balance, cp)", max(r["tok"] for *_, r in rows), 1.001),
        ("max/mean work <= 1.03 (every comm type)", max(r["work"] for *_, r in mine), 1.03),
        ("padding rows == 0 (p2p)", max(r["pad"] for *_, r in p2p), 0),
        ("p2p tile efficiency >= 0.90", min(r["tiles"] for *_, r in p2p), 0.90),
        ("p2p KV moved vs TE ring <= 0.60 (causal)", max(r["vs TE"] for n, cp, m, r in p2p if m == "causal"), 0.60),
        ("p2p bytes sent / needed <= 1.05", max(r["sent/need"] for *_, r in p2p if not np.isnan(r["sent/need"])), 1.05),
        ("plan build ms per rank <= 100", max(r["plan ms"] for *_, r in mine), 100),
        ("shard_sequences ms <= 50", max(r["shard ms"] for *_, r in mine), 50),
    ]  # fmt: skip
    out = ["| goal (workload, cp 32 and 64) | worst | met |", "|---|---|---|"]
    for text, worst, bound in checks:
        ok = worst >= bound if ">=" in text else worst <= bound
        out.append(f"| {text} | {worst:.3f} | {'yes' if ok else 'no'} |")
    return out


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()

"""Host time of ``comm_type="auto"`` per micro-batch, and host CPU time per layer of ``p2p``.

1. ``auto``: CPU ms (``time.process_time``: numpy runs single-threaded here, so on an idle host
   this is the wall time, and it does not count other processes' load) of one
   ``choose_comm_type`` (cache cleared) on lognormal batches
   (``megatron_cp_ext.sharding.batches.lognormal``), median and worst over seeds and masks (causal,
   window 4096, chunk 8192), all four candidates (a2a+p2p with a2a groups of 2). Every rank pays
   this once per micro-batch. ``--full`` also times the full model (every rank's exact plan per
   candidate: the path before the shared-geometry estimate) and counts how often the two pick
   the same comm type; sizes above ``--full-max`` tokens skip it (it takes minutes there).
2. host ms per layer: ``p2p`` forward + backward with the plan cached, all ranks as threads
   of one process (:func:`~megatron_cp_ext.testing.inproc.run_threads`) with the flash-shaped
   stub kernels and tiny head shapes, so each rank's thread CPU time (``time.thread_time``) is
   the Python, dispatch and communication-call work a GPU step pays around its kernels. Two
   columns: all ranks running together (eight threads on this host's cores, the runner's
   copies and waits included), and each rank alone while the others are blocked, its sends
   and receives completing at once without moving anything — the package's own host work
   per layer, which is what the per-layer goal (<= 1 ms at CP 8, 512 tokens) is about; a
   communication library adds its own posting cost per batch (16 batches per layer here).

    python benchmarks/host_time.py                      # estimate only
    python benchmarks/host_time.py --full --seeds 3     # before/after
    python benchmarks/host_time.py --balance dualchunk --seeds 5 --repeat 3 --skip-host
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch
import torch.distributed as dist
from torch.testing._internal.distributed import multi_threaded_pg as _mt

import megatron_cp_ext as mcx
from megatron_cp_ext.masks import MaskSpec
from megatron_cp_ext.planner import auto
from megatron_cp_ext.planner.profiles import load_profile
from megatron_cp_ext.sharding import batches
from megatron_cp_ext.testing import inproc
from megatron_cp_ext.testing.accounting import flash_stub
from megatron_cp_ext.testing.inproc import run_threads

SIZES = ((16, 1 << 17), (8, 1 << 17), (32, 1 << 17), (64, 1 << 20))
MASKS = {"causal": {}, "window4096": dict(window_size=(4096, 0)), "chunk8192": dict(chunk_size=8192)}
CANDIDATES = ("a2a+p2p", "p2p", "all_gather", "a2a")


def _choose(sharding, mask, exact: bool) -> tuple[str, float]:
    sharding.__dict__.pop("_auto_choices", None)
    t0 = time.process_time()
    best, _ = auto.choose_comm_type(
        sharding, mask, candidates=CANDIDATES, a2a_size=2, num_heads=32, num_kv_heads=8, head_dim=128,
        v_head_dim=128, dtype=torch.bfloat16, profile=load_profile("h100-nvlink-ib400"), exact=exact,
    )  # fmt: skip
    return best, (time.process_time() - t0) * 1e3


def auto_table(args) -> None:
    print(f"auto per micro-batch (CPU ms; median / worst over {args.seeds} seeds x {len(MASKS)} masks; "
          f"balance {args.balance})")  # fmt: skip
    warm = mcx.shard_sequences(batches.cu_seqlens(batches.lognormal(1 << 14, seed=99)), 8, balance=args.balance)
    _choose(warm, MaskSpec.make(causal=True), exact=False)  # steady state: imports and first calls done
    print("| cp | tokens | estimate | full model | same choice |")
    print("|---|---|---|---|---|")
    for cp, tokens in args.sizes or SIZES:
        est, full, same, n = [], [], 0, 0
        for seed in range(args.seeds):
            cu = batches.cu_seqlens(batches.lognormal(tokens, seed=args.first_seed + seed))
            sharding = mcx.shard_sequences(cu, cp, balance=args.balance)
            for kw in MASKS.values():
                mask = MaskSpec.make(causal=True, **kw)
                runs = [_choose(sharding, mask, exact=False) for _ in range(args.repeat)]
                best, ms = runs[0][0], min(r[1] for r in runs)
                est.append(ms)
                if args.full and tokens <= args.full_max:
                    want, ms_full = _choose(sharding, mask, exact=True)
                    full.append(ms_full)
                    same, n = same + (best == want), n + 1
        cell = lambda xs: f"{statistics.median(xs):.1f} / {max(xs):.1f}" if xs else "-"  # noqa: E731
        print(f"| {cp} | {tokens} | {cell(est)} | {cell(full)} | {f'{same}/{n}' if n else '-'} |")


HOST_CU = [0, 204, 306, 382, 433, 458, 484, 512]
"""The per-layer table's batch: 512 tokens in seven documents."""


_SOLO = threading.local()
"""Per rank thread: ``on`` while its transfers are replaced by completed no-ops."""


def _null_transfers() -> None:
    """Let a rank's sends and receives complete at once, moving nothing, while ``_SOLO.on``
    (installed once; other threads' transfers are unchanged). They all return one completed
    work, so the runner's own bookkeeping (futures, mailboxes) is not counted either."""
    if getattr(inproc.ThreadGroup, "_mcx_null", False):
        return
    send, recv = inproc.ThreadGroup.send, inproc.ThreadGroup.recv
    done = _mt.ret_work([])

    def null_send(self, tensors, dst, tag=0):
        return done if getattr(_SOLO, "on", False) else send(self, tensors, dst, tag)

    def null_recv(self, tensors, src, tag=0):
        return done if getattr(_SOLO, "on", False) else recv(self, tensors, src, tag)

    inproc.ThreadGroup.send, inproc.ThreadGroup.recv, inproc.ThreadGroup._mcx_null = null_send, null_recv, True


def _host_worker(
    rank: int, world: int, iters: int, balance: str, turns: threading.Barrier, cu: list[int] = HOST_CU
) -> tuple[float, float]:
    """(median thread ms per layer with all ranks running, median ms of this rank alone)."""
    sharding = mcx.shard_sequences(cu, world, balance=balance)
    t = sharding.num_tokens(rank)
    g = torch.Generator().manual_seed(rank)
    q, dout = (torch.randn(t, 2, 8, generator=g) for _ in range(2))
    k, v = (torch.randn(t, 1, 8, generator=g) for _ in range(2))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    call = dict(cp_group=dist.group.WORLD, comm_type="p2p", sharding=sharding)
    for _ in range(3):  # plan built and cached, agreement done
        mcx.cp_attention(q, k, v, **call).backward(dout)
    times = []
    for _ in range(iters):
        dist.barrier()
        t0 = time.thread_time()
        mcx.cp_attention(q, k, v, **call).backward(dout)
        times.append(time.thread_time() - t0)
    solo = []
    for r in range(world):  # one rank at a time, the others blocked (not polling) in ``turns``
        turns.wait()
        if r != rank:
            continue
        _SOLO.on = True
        try:
            for _ in range(iters):
                t0 = time.thread_time()
                mcx.cp_attention(q, k, v, **call).backward(dout)
                solo.append(time.thread_time() - t0)
        finally:
            _SOLO.on = False
    turns.wait()
    return statistics.median(times) * 1e3, statistics.median(solo) * 1e3


HOST_BALANCES = ("dualchunk", "workload")
"""Balances of the per-layer table, measured in alternating rounds (the host's load drifts)."""


def host_table(args) -> None:
    ms: dict[str, list[float]] = {b: [] for b in HOST_BALANCES}
    solo: dict[str, list[float]] = {b: [] for b in HOST_BALANCES}
    calls: dict[str, int] = {}
    _null_transfers()
    with flash_stub():
        for _ in range(args.rounds):
            for b in HOST_BALANCES:
                per_rank = run_threads(8, _host_worker, args.iters, b, threading.Barrier(8))
                ms[b].append(statistics.median(x for x, _ in per_rank))
                solo[b].append(max(y for _, y in per_rank))
    for b in HOST_BALANCES:
        sh = mcx.shard_sequences(HOST_CU, 8, balance=b)
        calls[b] = max(len(r.calls) for r in mcx.inspect_plan(sh, "p2p").ranks.values())
    print("\nhost CPU ms per layer (p2p, cp 8, 512 tokens, fwd + bwd, plan cached, stub kernels;")
    print(f"{args.rounds} alternating rounds). `ranks together`: median rank, all eight threads running")
    print("(the in-process runner's copies and waits included); `alone`: slowest rank, run by itself")
    print("with its transfers completing at once (the package's own Python and dispatch)")
    print("| balance | ranks together, per round | alone, per round | best alone | forward calls (largest rank) |")
    print("|---|---|---|---|---|")
    for b in HOST_BALANCES:
        together = " / ".join(f"{x:.2f}" for x in ms[b])
        alone = " / ".join(f"{x:.2f}" for x in solo[b])
        print(f"| {b} | {together} | {alone} | {min(solo[b]):.2f} | {calls[b]} |")


def held_out_table(args) -> None:
    """The per-layer goal on batches it was not tuned on: ``--host-batches`` random 512-token
    batches (lognormal lengths, medians 16-256, log-std 0.5-1.5, seeded from ``--first-seed``),
    the default balance; each batch's slowest rank alone (median of ``--iters`` layers)."""
    import numpy as np

    _null_transfers()
    rng = np.random.default_rng(args.first_seed)
    alone, calls = [], []
    with flash_stub():
        for i in range(args.host_batches):
            lens = batches.lognormal(512, median=int(rng.integers(16, 257)), sigma=float(rng.uniform(0.5, 1.5)),
                                     seed=args.first_seed + i)  # fmt: skip
            cu = np.concatenate([[0], np.cumsum(lens)]).tolist()
            per_rank = run_threads(8, _host_worker, args.iters, "workload", threading.Barrier(8), cu)
            alone.append(max(y for _, y in per_rank))
            plans = mcx.inspect_plan(mcx.shard_sequences(cu, 8), "p2p").ranks.values()
            calls.append(max(len(r.calls) for r in plans))
    q = sorted(alone)
    p95 = q[min(len(q) - 1, int(0.95 * len(q)))]
    print(f"\nheld-out 512-token batches ({len(q)}, cp 8, workload, p2p): slowest rank alone, ms per layer")
    print("| median | p95 | worst | share <= 1 ms | forward calls (largest rank): median / worst |")
    print("|---|---|---|---|---|")
    share = sum(x <= 1.0 for x in q) / len(q)
    print(f"| {statistics.median(q):.2f} | {p95:.2f} | {q[-1]:.2f} | {share:.2f} | "
          f"{statistics.median(calls):.0f} / {max(calls)} |")  # fmt: skip


def _sizes(text: str) -> tuple[tuple[int, int], ...]:
    return tuple((int(a), int(b)) for a, b in (x.split(":") for x in text.split(",")))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--first-seed", type=int, default=100, help="batch seeds first-seed ... first-seed + seeds - 1")
    p.add_argument("--sizes", type=_sizes, default=None, help="cp:tokens,... instead of the four default sizes")
    p.add_argument("--balance", default="workload", choices=["workload", "dualchunk", "contiguous"])
    p.add_argument("--repeat", type=int, default=1, help="estimate: best of this many runs per batch (noisy hosts)")
    p.add_argument("--full", action="store_true", help="also time the full model (before)")
    p.add_argument("--full-max", type=int, default=1 << 17, help="largest batch the full model is timed on")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3, help="host table: alternating rounds per balance")
    p.add_argument("--skip-host", action="store_true")
    p.add_argument("--skip-auto", action="store_true")
    p.add_argument("--host-batches", type=int, default=0, help="also time this many random 512-token batches")
    args = p.parse_args()
    if not args.skip_auto:
        auto_table(args)
    if not args.skip_host:
        host_table(args)
    if args.host_batches:
        held_out_table(args)


if __name__ == "__main__":
    main()

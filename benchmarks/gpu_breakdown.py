"""Where a CP step's kernel time goes, and where its host time goes (the suite's ``cp`` step).

``kernel_breakdown``: a ``torch.profiler`` trace of one forward+backward of every rank (the
in-process runner, all ranks on the one GPU) sorted into attention kernels (time, calls, mean
query rows per call from the plans), merges, copies and packing, transfers (the runner's device
copies, apart: on a cluster NCCL moves them) and everything else; and of one direct call over
the whole batch. ``host_profile``: ``cProfile`` of one CP-1 forward+backward and of one rank's
forward+backward at CP 8, the functions with the most own time. Both print the issue's two
summary lines:

    kernel time ÷ one call (transfers excluded), causal, CP 8: p2p X, all_gather Y, a2a Z, a2a+p2p W
    CP 1 host ms per forward+backward: package P, direct D

On CPU (the suite's rehearsal) the profiler has no device kernels: aten ops' own CPU time
stands in, sorted by the same names.
"""

from __future__ import annotations

import cProfile
import io
import math
import pstats
import time

import numpy as np
import torch
from gpu_bench import Sizes, _batch, result
from torch.profiler import ProfilerActivity, profile

import megatron_cp_ext as mcx
from megatron_cp_ext.testing.inproc import run_threads

CATEGORIES = ("attention", "merges", "copies", "transfers", "other")
_ATTENTION = ("flash", "fmha", "sdpa", "cudnn", "attn_fwd", "attn_bwd", "cutlass", "mcx_testing")
_MERGES = ("merge_partial", "lerp", "logaddexp", "sigmoid", "nan_to_num")
_TRANSFERS = ("memcpy dtod", "memcpy htod", "memcpy dtoh", "nccl", "memcpy peer")
_COPIES = ("copy", "cat", "index_select", "indexselect", "gather_rows", "index_add", "index_copy", "scatter",
           "gather", "fill", "zero", "memset", "to_copy", "elementwise_kernel_with_index")  # fmt: skip


def category(name: str) -> str:
    """The category of a kernel (or, on CPU, an aten op) by its name."""
    n = name.lower()
    for cat, keys in (("transfers", _TRANSFERS), ("attention", _ATTENTION), ("merges", _MERGES),
                      ("copies", _COPIES)):  # fmt: skip
        if any(k in n for k in keys):
            return cat
    return "other"


def _spans(prof, cuda: bool) -> list[tuple[str, float]]:
    """(name, µs) of every device kernel, or on CPU of every aten op's own time."""
    if cuda:
        cuda = torch.autograd.DeviceType.CUDA
        return [(e.name, e.time_range.end - e.time_range.start) for e in prof.events() if e.device_type == cuda]
    return [(e.name, e.self_cpu_time_total) for e in prof.events() if e.name.startswith(("aten::", "mcx_testing"))]


def sort_kernels(spans: list[tuple[str, float]]) -> dict[str, dict[str, float]]:
    """``{category: {"us": total, "calls": n}}`` over ``spans``."""
    out = {c: {"us": 0.0, "calls": 0} for c in CATEGORIES}
    for name, us in spans:
        c = out[category(name)]
        c["us"] += us
        c["calls"] += 1
    return out


def _rank(rank: int, world: int, s: Sizes, comm: str, lens: list[int], full: list, prof_host: bool) -> dict:
    """One rank's measured step; ``comm`` ``p2p:staged`` / ``p2p:ring`` (``a2a+p2p:...`` too)
    forces how the ring runs."""

    from megatron_cp_ext.testing.cases import p2p_schedule

    comm, _, schedule = comm.partition(":")
    with p2p_schedule(schedule):
        return _rank_step(rank, world, s, comm, lens, full, prof_host)


def _rank_step(rank: int, world: int, s: Sizes, comm: str, lens: list[int], full: list, prof_host: bool) -> dict:
    import torch.distributed as dist

    group = mcx.hierarchical_cp_groups(2) if comm == "a2a+p2p" else dist.group.WORLD
    sh = mcx.shard_sequences([0, *np.cumsum(lens).tolist()], world, causal=True)
    q, k, v, dout = (sh.shard(x, rank) for x in full)
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))

    def step():
        out = mcx.cp_attention(q, k, v, cp_group=group, comm_type=comm, sharding=sh, causal=True)
        torch.autograd.grad(out, (q, k, v), dout)

    step()  # plan built and agreed
    if s.device == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    if prof_host and rank == 0:
        pr = cProfile.Profile()
        pr.enable()
        step()
        pr.disable()
        return {"host": _top(pr)}
    step()
    rep = mcx.inspect_plan(sh, comm, a2a_size=2 if comm == "a2a+p2p" else None, num_heads=s.hq,
                           num_kv_heads=s.hkv, head_dim=s.d, causal=True)  # fmt: skip
    calls = rep.ranks[rank].calls
    return {"calls": len(calls), "rows": sum(int(c.cu_seqlens_q[-1]) for c in calls)}


def _top(pr: cProfile.Profile, n: int = 12) -> str:
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(n)
    lines = [ln for ln in buf.getvalue().splitlines() if ln.strip()]
    start = next((i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls")), 0)
    return "\n".join(lines[start : start + n + 1])


def kernel_breakdown(
    s: Sizes,
    comms=("p2p", "p2p:staged", "p2p:ring", "all_gather", "a2a", "a2a+p2p", "a2a+p2p:staged", "a2a+p2p:ring"),
    cps=(8,),
) -> None:
    """Kernel time by category per comm type and CP size against one call over the batch;
    ``p2p`` and ``a2a+p2p`` as the package chooses per batch, ``:staged`` / ``:ring`` each
    way of running their ring forced."""
    lens, cu, q, k, v = _batch(s)
    full = [q, k, v, torch.randn_like(q)]
    cuda = s.device == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    from megatron_cp_ext.backends import get_backend

    mod = get_backend(torch.device(s.device), "auto")
    cu_d, mx = cu.to(s.device), max(lens)
    args = (cu_d, cu_d, mx, mx, True, (-1, 0), 1 / math.sqrt(s.d))

    def direct():
        o, lse = mod.attn_fwd(q, k, v, *args)
        mod.attn_bwd(o, q, k, v, o, lse, *args)

    direct()
    with profile(activities=acts) as prof:
        direct()
        if cuda:
            torch.cuda.synchronize()
    one = sort_kernels(_spans(prof, cuda))
    one_us = sum(c["us"] for n, c in one.items() if n != "transfers")
    print(f"\none call over the batch: {one_us / 1e3:.2f} ms of kernels ({one['attention']['calls']} attention)")
    print("\n| comm | CP | attention ms | calls | mean rows | merges ms | copies ms | transfers ms | other ms "
          "| ÷ one call (transfers excluded) |\n|---|---|---|---|---|---|---|---|---|---|")  # fmt: skip
    ratios = {}
    for cp in cps:
        for comm in comms:
            run_threads(cp, _rank, s, comm, lens, full, False, device=s.device, timeout=240)  # warm
            with profile(activities=acts) as prof:
                out = run_threads(cp, _rank, s, comm, lens, full, False, device=s.device, timeout=240)
                if cuda:
                    torch.cuda.synchronize()
            b = sort_kernels(_spans(prof, cuda))
            # each rank ran its step twice (plan + measured) inside the trace: half is one step
            b = {n: {"us": c["us"] / 2, "calls": c["calls"] / 2} for n, c in b.items()}
            rows = sum(o["rows"] for o in out) / max(sum(o["calls"] for o in out), 1)
            excl = sum(c["us"] for n, c in b.items() if n != "transfers")
            ratios[(comm, cp)] = excl / max(one_us, 1e-9)
            ms = {n: b[n]["us"] / 1e3 for n in CATEGORIES}
            print(f"| {comm} | {cp} | {ms['attention']:.2f} | {b['attention']['calls']:.0f} | {rows:.0f} | "
                  f"{ms['merges']:.2f} | {ms['copies']:.2f} | {ms['transfers']:.2f} | {ms['other']:.2f} | "
                  f"{ratios[(comm, cp)]:.3f} |")  # fmt: skip
            result(step="breakdown", comm=comm, cp=cp, mean_rows=rows, ratio=ratios[(comm, cp)],
                   **{f"{n}_ms": ms[n] for n in CATEGORIES})  # fmt: skip
    top = max(cps)
    main = ("p2p", "all_gather", "a2a", "a2a+p2p")
    line = ", ".join(f"{c} {ratios[(c, top)]:.3f}" for c in main if (c, top) in ratios)
    print(f"\nkernel time ÷ one call (transfers excluded), causal, CP {top}: {line}")
    forced = ", ".join(f"{c} {ratios[(c, top)]:.3f}" for c in comms if ":" in c and (c, top) in ratios)
    if forced:
        print(f"rings by schedule, kernel time ÷ one call (transfers excluded), CP {top}: {forced}")


def route_choice(s: Sizes, cp: int = 8) -> None:
    """``a2a`` at CP ``cp`` with its head moves by route (every move run by run into place) and by
    all-to-all + gather (none routed), side by side: kernel time by category and wall time per
    forward+backward — the measurement that sets ``schedules/route.py``'s ``MIN_BYTES``."""
    from gpu_bench import _rank_step

    from megatron_cp_ext.schedules import route

    lens, cu, q, k, v = _batch(s)
    full = [q, k, v, torch.randn_like(q)]
    cuda = s.device == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    print(f"\n| a2a moves, CP {cp} | kernel ms (transfers excluded) | copies ms | transfers ms | wall ms |")
    print("|---|---|---|---|---|")
    saved = route.MIN_BYTES, route.CPU_MIN_BYTES
    try:
        for name, floor in (("by route", 0), ("all-to-all + gather", 1 << 62)):
            route.MIN_BYTES = route.CPU_MIN_BYTES = floor
            run_threads(cp, _rank, s, "a2a", lens, full, False, device=s.device, timeout=240)  # warm
            with profile(activities=acts) as prof:
                run_threads(cp, _rank, s, "a2a", lens, full, False, device=s.device, timeout=240)
                if cuda:
                    torch.cuda.synchronize()
            b = {n: c["us"] / 2e3 for n, c in sort_kernels(_spans(prof, cuda)).items()}  # two steps per rank
            out = run_threads(cp, _rank_step, s, "a2a", "causal", lens, full, s.iters, device=s.device, timeout=240)
            wall = max(o["seconds"] for o in out) / s.iters * 1e3
            excl = sum(ms for n, ms in b.items() if n != "transfers")
            print(f"| {name} | {excl:.2f} | {b['copies']:.2f} | {b['transfers']:.2f} | {wall:.2f} |")
            result(step="route", moves=name, cp=cp, kernel_ms=excl, copies_ms=b["copies"],
                   transfers_ms=b["transfers"], wall_ms=wall)  # fmt: skip
    finally:
        route.MIN_BYTES, route.CPU_MIN_BYTES = saved


def host_profile(s: Sizes, cp: int = 8) -> None:
    lens, cu, q, k, v = _batch(s)
    from megatron_cp_ext.backends import get_backend

    mod = get_backend(torch.device(s.device), "auto")
    cu_d, mx = cu.to(s.device), max(lens)
    args = (cu_d, cu_d, mx, mx, True, (-1, 0), 1 / math.sqrt(s.d))
    sh1 = mcx.shard_sequences(cu, 1, causal=True)
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    dout = torch.randn_like(q)

    def direct():
        o, lse = mod.attn_fwd(q, k, v, *args)
        mod.attn_bwd(dout, q, k, v, o, lse, *args)

    def cp1():
        torch.autograd.grad(mcx.cp_attention(qg, kg, vg, cp_group=None, sharding=sh1, causal=True), (qg, kg, vg), dout)

    host = {}
    for name, fn in (("direct", direct), ("package", cp1)):
        fn()
        if s.device == "cuda":
            torch.cuda.synchronize()
        best = float("inf")
        for _ in range(5):  # enqueue time only: no synchronization inside
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
            if s.device == "cuda":
                torch.cuda.synchronize()
        host[name] = best * 1e3
    pr = cProfile.Profile()
    pr.enable()
    cp1()
    pr.disable()
    print("\nCP 1 forward+backward, functions by own host time:\n" + _top(pr))
    out = run_threads(cp, _rank, s, "p2p", lens, [q, k, v, dout], True, device=s.device, timeout=240)
    print(f"\nCP {cp} p2p, rank 0's forward+backward, functions by own host time:\n" + out[0]["host"])
    print(f"\nCP 1 host ms per forward+backward: package {host['package']:.3f}, direct {host['direct']:.3f}")
    result(step="host", package_ms=host["package"], direct_ms=host["direct"])

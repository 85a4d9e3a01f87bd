"""Where the GPU time of a CP layer goes: ``torch.profiler`` tables of one forward+backward.

    python benchmarks/gpu_profile.py [--dry-run] [--runs p2p:8,a2a:2]

Profiles, on the suite's 128K-token causal batch (``gpu_bench.GPU``): the direct backend call
(forward + backward), the same work through ``cp_attention`` at CP 1, and one rank set of
``--comm`` at ``--cp`` through the in-process runner. Each table lists the kernels by their
own device time, with launch counts, so the CP 1 and one-GPU CP overheads of the suite's ``cp``
step can be read kernel by kernel.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import gpu_bench as gb  # noqa: E402

import megatron_cp_ext as mcx  # noqa: E402
from megatron_cp_ext.backends import get_backend  # noqa: E402
from megatron_cp_ext.testing.inproc import run_threads  # noqa: E402


def _table(prof, title: str, s: gb.Sizes, rows: int = 18) -> None:
    """The kernels of one profile by own device time; their total and launch count."""
    cuda = s.device == "cuda"
    events = [e for e in prof.key_averages() if (e.self_device_time_total > 0 if cuda else e.self_cpu_time_total > 0)]
    if cuda:  # kernels and copies only: an aten op's row repeats its kernels' device time
        events = [e for e in events if not e.key.startswith("aten::") and e.key != "Activity Buffer Request"]
    key = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    events.sort(key=key, reverse=True)
    total = sum(key(e) for e in events)
    launches = sum(e.count for e in events)
    print(f"\n### {title}: {total / 1e3:.2f} ms of {'kernels' if cuda else 'CPU ops'}, {launches} events\n")
    print("| kernel / op | calls | ms | share |\n|---|---|---|---|")
    for e in events[:rows]:
        print(f"| {e.key[:90]} | {e.count} | {key(e) / 1e3:.3f} | {key(e) / max(total, 1):.3f} |")


def _profiled(fn, s: gb.Sizes):
    fn()  # warm-up: plans, handles, allocator
    if s.device == "cuda":
        torch.cuda.synchronize()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if s.device == "cuda" else [])
    with profile(activities=acts) as prof:
        fn()
        if s.device == "cuda":
            torch.cuda.synchronize()
    return prof


def _host_and_wall(fn, s: gb.Sizes, iters: int = 10) -> tuple[float, float]:
    """Host seconds to enqueue one call (no synchronization inside), and wall seconds per call
    over ``iters`` calls ending in a synchronization: a wall above the kernels' device time with
    a small host time means the device waited (a synchronization or an allocator stall)."""
    sync = torch.cuda.synchronize if s.device == "cuda" else (lambda: None)
    fn()
    sync()
    t0 = time.perf_counter()
    fn()
    host = time.perf_counter() - t0
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return host, (time.perf_counter() - t0) / iters


def _rank(rank: int, world: int, s: gb.Sizes, comm: str, lens: list[int], full: list) -> dict:
    import torch.distributed as dist

    group = mcx.hierarchical_cp_groups(2) if comm == "a2a+p2p" else dist.group.WORLD
    cu = [0, *np.cumsum(lens).tolist()]
    sh = mcx.shard_sequences(cu, world, causal=True)
    q, k, v, dout = (sh.shard(x, rank) for x in full)
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    for _ in range(2):
        out = mcx.cp_attention(q, k, v, cp_group=group, comm_type=comm, sharding=sh, causal=True)
        torch.autograd.grad(out, (q, k, v), dout)
    return {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--runs", default="p2p:8", help="comma-separated comm:cp entries")
    args = ap.parse_args()
    s = gb.sizes(args.dry_run)
    lens, cu, q, k, v = gb._batch(s)
    mod = get_backend(torch.device(s.device), "flash" if s.device == "cuda" else "reference")
    cu_d, mx = cu.to(s.device), max(lens)
    fargs = (cu_d, cu_d, mx, mx, True, (-1, 0), 1 / math.sqrt(s.d))
    dout = torch.randn_like(q)

    def direct():
        o, lse = mod.attn_fwd(q, k, v, *fargs)
        mod.attn_bwd(dout, q, k, v, o, lse, *fargs)

    sh1 = mcx.shard_sequences(cu, 1, causal=True)
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))

    def cp1():
        torch.autograd.grad(mcx.cp_attention(qg, kg, vg, cp_group=None, sharding=sh1, causal=True), (qg, kg, vg), dout)

    print(f"{len(lens)} documents, {s.tokens} tokens, heads {s.hq}/{s.hkv}, d {s.d}, {s.dtype}, causal")
    for name, fn in (("direct", direct), ("cp_attention CP 1", cp1)):
        host, wall = _host_and_wall(fn, s)
        print(f"{name}: host {host * 1e3:.3f} ms per fwd+bwd (enqueue only), wall {wall * 1e3:.2f} ms (synchronized)")
    _table(_profiled(direct, s), "direct backend call, fwd+bwd", s)
    _table(_profiled(cp1, s), "cp_attention at CP 1, fwd+bwd", s)
    full = [q, k, v, dout]
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if s.device == "cuda" else [])
    for entry in args.runs.split(","):
        comm, cp = entry.split(":")
        run_threads(int(cp), _rank, s, comm, lens, full, device=s.device, timeout=240)  # warm
        with profile(activities=acts) as prof:
            run_threads(int(cp), _rank, s, comm, lens, full, device=s.device, timeout=240)
            if s.device == "cuda":
                torch.cuda.synchronize()
        _table(prof, f"{comm} at CP {cp}, all ranks, 2 x fwd+bwd", s, rows=25)


if __name__ == "__main__":
    main()

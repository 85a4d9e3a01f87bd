"""The measuring steps of ``gpu_suite.py``: kernels, local attention, one-GPU CP, memory,
calibration. Each also runs alone and prints markdown tables:

    python benchmarks/gpu_bench.py {kernels,attention,cp,calibration} [--dry-run]

Every function takes a :class:`Sizes`; ``--dry-run`` runs the same code on the CPU with tiny
sizes (the torch fallbacks and the reference backend stand in for the CUDA kernels), which is
how CI keeps this file working without a GPU. Each step prints ``RESULT <json>`` lines that
``gpu_suite.py`` collects into the device report.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import megatron_cp_ext as mcx  # noqa: E402
from megatron_cp_ext.runtime import ops  # noqa: E402
from megatron_cp_ext.testing.inproc import run_threads  # noqa: E402


@dataclass(frozen=True, kw_only=True)
class Sizes:
    """Problem sizes of one suite run (the GPU program, or its tiny CPU rehearsal)."""

    device: str
    """``cuda`` or ``cpu``."""
    dtype: torch.dtype
    """Attention input dtype (bf16 on the GPU; fp32 on the CPU, where the reference runs)."""
    tokens: int
    """Packed tokens of the attention batch."""
    median_len: int
    """Median of the lognormal document lengths."""
    hq: int
    hkv: int
    d: int
    window: int
    """Left window of the windowed mask."""
    rows: int
    """Rows moved by the kernel benchmark."""
    iters: int
    """Timed repetitions (after one warm-up)."""
    cp_sizes: tuple[int, ...]
    """CP sizes of the one-GPU CP benchmark."""
    pick_tokens: tuple[int, ...]
    """Batch sizes (tokens) the local-attention step times each candidate at (the pick table's
    size buckets)."""


GPU = Sizes(device="cuda", dtype=torch.bfloat16, tokens=128 * 1024, median_len=2048, hq=32, hkv=8, d=128,
            window=4096, rows=1 << 20, iters=10, cp_sizes=(2, 4, 8), pick_tokens=(16384, 128 * 1024))  # fmt: skip
# The CPU rehearsal checks code paths, not figures: CP 2 and 8 take every path CP 4 would.
DRY = Sizes(device="cpu", dtype=torch.float32, tokens=384, median_len=64, hq=4, hkv=2, d=16, window=32,
            rows=4096, iters=1, cp_sizes=(2, 8), pick_tokens=(96, 384))  # fmt: skip
MASKS = {"causal": dict(causal=True), "nomask": dict(causal=False), "window": None}  # window: per Sizes


def sizes(dry_run: bool) -> Sizes:
    return DRY if dry_run else GPU


def result(**fields) -> None:
    """One machine-readable line for the suite's report."""
    print("RESULT " + json.dumps(fields), flush=True)


def timed(fn: Callable[[], object], s: Sizes) -> float:
    """Seconds per call: one warm-up, then the mean of ``s.iters`` (CUDA events on the GPU)."""
    fn()
    if s.device == "cuda":
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(s.iters):
            fn()
        b.record()
        torch.cuda.synchronize()
        return a.elapsed_time(b) / 1e3 / s.iters
    t0 = time.perf_counter()
    for _ in range(s.iters):
        fn()
    return (time.perf_counter() - t0) / s.iters


def lognormal_lengths(total: int, median: int, seed: int = 0) -> list[int]:
    """Document lengths (lognormal, sigma 1) that add up to exactly ``total``."""
    rng = np.random.default_rng(seed)
    out: list[int] = []
    while sum(out) < total:
        out.append(max(1, int(rng.lognormal(math.log(median), 1.0))))
    out[-1] -= sum(out) - total
    return [n for n in out if n > 0]


def mask_kw(name: str, s: Sizes) -> dict:
    return dict(causal=True, window_size=(s.window, -1)) if name == "window" else MASKS[name]


def visible_pairs(lens: list[int], causal: bool, left: int) -> int:
    """Query-key pairs the mask lets through (the useful work a TFLOP/s figure counts)."""
    total = 0
    for n in lens:
        if not causal:
            total += n * n
        elif left < 0:
            total += n * (n + 1) // 2
        else:
            w = min(n, left + 1)
            total += w * (w + 1) // 2 + (n - w) * w
    return total


# ---- kernels ----------------------------------------------------------------------------------
def bench_kernels(s: Sizes) -> None:
    """Row gather / scatter-add, merge and accumulate vs a device-to-device copy of the same bytes."""
    dev, n, h, d = s.device, s.rows // 8, 8, 128 if s.device == "cuda" else 16
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(n, h, d, device=dev, generator=g).to(torch.bfloat16)
    idx = torch.randperm(n, device=dev, generator=g)
    acc = torch.zeros(n, h, d, device=dev)
    out, lse = torch.zeros(n, h, d, device=dev), torch.full((n, h), float("-inf"), device=dev)
    part, plse = torch.randn(n, h, d, device=dev, generator=g), torch.randn(n, h, device=dev, generator=g)
    cases = {  # name: (kernel path, fallback, bytes read + written)
        "gather_rows bf16": (lambda: ops.gather_rows(x, idx), lambda: ops.gather_rows_torch(x, idx), 2 * x.nbytes),
        "index_add_rows fp32+=bf16": (
            lambda: ops.index_add_rows(acc, idx, x), lambda: ops.index_add_rows_torch(acc, idx, x),
            x.nbytes + 2 * acc.nbytes,
        ),
        "merge_partial fp32": (
            lambda: ops.merge_partial(out, lse, part, plse, idx),
            lambda: ops.merge_partial_torch(out, lse, part, plse, idx), 3 * out.nbytes + 3 * lse.nbytes,
        ),
        "accumulate slice fp32": (lambda: acc.add_(part), lambda: acc.add_(part), 3 * acc.nbytes),
    }  # fmt: skip
    print(f"csrc kernels built: {ops.HAS_CUDA_EXT}; device {dev}; rows {n} x {h} x {d}")
    print("| op | csrc GB/s | fallback GB/s | copy GB/s | csrc / copy | fallback / copy |\n|---|---|---|---|---|---|")
    for name, (kern, fall, nbytes) in cases.items():
        src = torch.empty(nbytes // 2, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        t_copy = timed(lambda dst=dst, src=src: dst.copy_(src), s)
        t_k, t_f = timed(kern, s), timed(fall, s)
        gbs = [nbytes / t / 1e9 for t in (t_k, t_f, t_copy)]
        print(
            f"| {name} | {gbs[0]:.3g} | {gbs[1]:.3g} | {gbs[2]:.3g} | {gbs[0] / gbs[2]:.2f} | {gbs[1] / gbs[2]:.2f} |"
        )
        result(step="kernels", op=name, csrc_gbs=gbs[0], fallback_gbs=gbs[1], copy_gbs=gbs[2],
               csrc_ratio=gbs[0] / gbs[2], fallback_ratio=gbs[1] / gbs[2], csrc=ops.HAS_CUDA_EXT)  # fmt: skip


# ---- local attention ---------------------------------------------------------------------------
def candidates(s: Sizes) -> dict:
    """Local kernel candidates (:data:`megatron_cp_ext.backends.pick.KERNELS`) that run here."""
    from megatron_cp_ext.backends import pick

    return {n: pick.KERNELS[n] for n in sorted(pick.available_kernels(torch.device(s.device)))}


def _batch(s: Sizes, seed: int = 0, tokens: int | None = None):
    tokens = tokens or s.tokens
    lens = lognormal_lengths(tokens, s.median_len, seed)
    cu = torch.tensor([0, *lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    g = torch.Generator(device=s.device).manual_seed(seed)
    shapes = ((s.hq, s.d), (s.hkv, s.d), (s.hkv, s.d))
    q, k, v = (torch.randn(tokens, h, d, device=s.device, generator=g).to(s.dtype) for h, d in shapes)
    return lens, cu, q, k, v


def bench_attention(s: Sizes, write: bool = False) -> None:
    """Local varlen attention TFLOP/s per candidate kernel, forward and backward, at each size of
    ``s.pick_tokens``; the fastest per mask and size becomes this device class's entry of the
    kernel pick table (``megatron_cp_ext/backends/kernel_table.json``)."""
    from megatron_cp_ext.backends import pick

    kernels, timings = candidates(s), []
    print("| kernel | mask | tokens | fwd ms | bwd ms | fwd TFLOP/s | bwd TFLOP/s | first fwd+bwd ms |")
    print("|---|---|---|---|---|---|---|---|")
    for tokens in s.pick_tokens:
        lens, cu, q, k, v = _batch(s, tokens=tokens)
        cu_d, mx = cu.to(s.device), max(lens)
        print(f"{len(lens)} documents, median {int(np.median(lens))}, max {mx}, {tokens} tokens; "
              f"heads {s.hq}/{s.hkv}, d {s.d}, {s.dtype}")  # fmt: skip
        for kname, kern in kernels.items():
            for mname in MASKS:
                kw = mask_kw(mname, s)
                causal, win = kw["causal"], kw.get("window_size", (-1, -1))
                window = (win[0], 0 if causal else win[1])
                args = (cu_d, cu_d, mx, mx, causal, window, 1 / math.sqrt(s.d))
                shape = pick.call_shape(q, k, v, mx, causal, window)
                if not kern.supports(shape):
                    print(f"| {kname} | {mname} | {tokens} | not expressible | | | |")
                    continue
                try:
                    sync = torch.cuda.synchronize if s.device == "cuda" else (lambda: None)
                    t0 = time.perf_counter()
                    o, lse = kern.fwd(q, k, v, *args)
                    dout = torch.randn_like(o)
                    kern.bwd(dout, q, k, v, o, lse, *args)
                    sync()
                    first = time.perf_counter() - t0  # graph builds / JIT compiles included
                    t_f = timed(lambda: kern.fwd(q, k, v, *args), s)  # noqa: B023
                    t_b = timed(lambda: kern.bwd(dout, q, k, v, o, lse, *args), s)  # noqa: B023
                except Exception as exc:  # noqa: BLE001 - a failing candidate is reported, not picked
                    print(f"| {kname} | {mname} | {tokens} | failed: {type(exc).__name__}: {str(exc)[:80]} | | | |")
                    continue
                fl = 4.0 * visible_pairs(lens, causal, win[0]) * s.hq * s.d
                tf, tb = fl / t_f / 1e12, 2.5 * fl / t_b / 1e12
                print(f"| {kname} | {mname} | {tokens} | {t_f * 1e3:.2f} | {t_b * 1e3:.2f} | {tf:.3g} | {tb:.3g} | "
                      f"{first * 1e3:.0f} |")  # fmt: skip
                result(step="attention", kernel=kname, mask=mname, tokens=tokens, fwd_ms=t_f * 1e3,
                       bwd_ms=t_b * 1e3, fwd_tflops=tf, bwd_tflops=tb, first_ms=first * 1e3)  # fmt: skip
                timings.append({**{f: getattr(shape, f) for f in ("dtype", "d", "dv", "gqa", "mask")},
                                "kernel": kname, "tokens": tokens, "seconds": t_f + t_b})  # fmt: skip
    cls = pick.device_class(torch.device(s.device))
    where = torch.cuda.get_device_name() if s.device == "cuda" else "cpu"
    entry = pick.entry_from_measurements(timings, f"benchmarks/gpu_suite.py on {where}, torch {torch.__version__}")
    print(f"kernel pick table entry for device class {cls!r}:\n" + json.dumps({cls: entry}, indent=2))
    result(step="pick", device_class=cls, entry=entry)
    if write and s.device == "cuda":
        pick.write_entry(cls, entry)
        print(f"written to {pick.TABLE}: copy this entry into the repository's file")


# ---- cuDNN graph reuse ---------------------------------------------------------------------------
def _builds():
    """The graph and JIT-compile counts (``gpu_builds.py``, imported late: it imports this module)."""
    import gpu_builds

    return gpu_builds


def _breakdown():
    """Kernel time by category and host profiles (``gpu_breakdown.py``, imported late: it imports this module)."""
    import gpu_breakdown

    return gpu_breakdown


def _memory():
    """Per-rank peaks, allocator against accounting (``gpu_memory.py``, imported late: it imports this module)."""
    import gpu_memory

    return gpu_memory


def _goal_cp(s: Sizes) -> tuple[int, ...]:
    """CP sizes of the kernel breakdown and the memory table: the largest, the goals' CP 8. At
    every size the breakdown's profiled runner calls (8 comm variants, 2 calls each) would
    outlast the step's budget on a GPU after the CP table itself."""
    return s.cp_sizes[-1:]


# ---- one-GPU CP and memory ------------------------------------------------------------------------
def _rank_step(rank: int, world: int, s: Sizes, comm: str, mask: str, lens: list[int], full: list, reps: int) -> dict:
    """One rank: ``reps`` forward+backward calls of its planned work (plan built before).
    ``full``: the global q, k, v, dout on the device (shared by the threads, never copied)."""
    import torch.distributed as dist

    a2a = 2 if comm == "a2a+p2p" else 0
    group = mcx.hierarchical_cp_groups(a2a) if a2a else dist.group.WORLD
    cu = [0, *np.cumsum(lens).tolist()]
    sh = mcx.shard_sequences(cu, world, **mask_kw(mask, s))
    q, k, v, dout = (sh.shard(x, rank) for x in full)
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))

    def call():  # gradients returned, not accumulated into .grad (as the one call they are compared with)
        out = mcx.cp_attention(q, k, v, cp_group=group, comm_type=comm, sharding=sh, **mask_kw(mask, s))
        torch.autograd.grad(out, (q, k, v), dout)

    call()  # builds the plan and agrees on it
    ideal = sum(x.nbytes for x in (q, k, v)) + q.nbytes + q.shape[0] * s.hq * 4  # q k v out lse
    sync = torch.cuda.synchronize if s.device == "cuda" else (lambda: None)
    sync()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        call()
    sync()  # the whole device: every rank's work, as all ranks share it
    dist.barrier()
    return {"ideal": ideal, "seconds": time.perf_counter() - t0}


def bench_cp(s: Sizes) -> None:
    """One-GPU CP: all ranks' planned work through the in-process runner ÷ one call over the
    whole batch; CP 1 through ``cp_attention`` ÷ the direct call; peak memory vs ideal."""
    lens, cu, q, k, v = _batch(s)
    from megatron_cp_ext.backends import get_backend

    mod = get_backend(torch.device(s.device), "auto")  # the kernel cp_attention picks (MCX_KERNEL too)
    cu_d, mx = cu.to(s.device), max(lens)
    print("| comm | mask | CP | ms (fwd+bwd, all ranks) | ÷ one call | peak MiB / rank | ÷ ideal |")
    print("|---|---|---|---|---|---|---|")
    for mname in ("causal", "nomask"):
        kw = mask_kw(mname, s)
        args = (cu_d, cu_d, mx, mx, kw["causal"], (-1, 0 if kw["causal"] else -1), 1 / math.sqrt(s.d))

        def direct():
            o, lse = mod.attn_fwd(q, k, v, *args)  # noqa: B023
            mod.attn_bwd(o, q, k, v, o, lse, *args)  # noqa: B023

        t_one = timed(direct, s)
        sh1 = mcx.shard_sequences(cu, 1, **kw)
        qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
        # gradients returned, not accumulated into .grad: the direct call adds nothing either
        t_cp1 = timed(lambda: torch.autograd.grad(mcx.cp_attention(qg, kg, vg, cp_group=None, sharding=sh1, **kw),  # noqa: B023
                                                  (qg, kg, vg), qg.detach()), s)  # noqa: B023 # fmt: skip
        print(f"| cp_attention | {mname} | 1 | {t_cp1 * 1e3:.2f} | {t_cp1 / t_one:.3f} | | |")
        result(step="cp", comm="cp1", mask=mname, cp=1, ms=t_cp1 * 1e3, ratio=t_cp1 / t_one)
        for comm in ("p2p", "all_gather", "a2a", "a2a+p2p"):
            for cp in s.cp_sizes:
                _cp_row(s, comm, mname, cp, lens, [q, k, v, torch.randn_like(q)], t_one)


def _cp_row(s: Sizes, comm: str, mname: str, cp: int, lens: list[int], full: list, t_one: float) -> None:
    if s.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    out = run_threads(cp, _rank_step, s, comm, mname, lens, full, s.iters, device=s.device, timeout=240)
    per = max(o["seconds"] for o in out) / s.iters  # from the barrier before to the barrier after
    ideal = sum(o["ideal"] for o in out) / cp
    peak = (torch.cuda.max_memory_allocated() - base) / cp if s.device == "cuda" else float("nan")
    print(
        f"| {comm} | {mname} | {cp} | {per * 1e3:.2f} | {per / t_one:.3f} | {peak / 2**20:.1f} | {peak / ideal:.2f} |"
    )
    result(step="cp", comm=comm, mask=mname, cp=cp, ms=per * 1e3, ratio=per / t_one, peak_mib=peak / 2**20,
           peak_ratio=peak / ideal)  # fmt: skip


# ---- calibration ---------------------------------------------------------------------------------
def bench_calibration(s: Sizes, write: bool) -> None:
    """Kernel constants for the cost model (``benchmarks/kernel_throughput.py``'s measure)."""
    import kernel_throughput as kt

    from megatron_cp_ext.planner.profiles import CALIBRATION

    shapes = kt.SHAPES if s.device == "cuda" else [([32] * 4, 4, 2, 16)]
    backend = "flash" if s.device == "cuda" else "reference"
    entry = kt.measure(shapes, s.iters, device=s.device, dtype=s.dtype, backend=backend)
    name = "h200-nvlink-ib400" if s.device == "cuda" and "H200" in torch.cuda.get_device_name() else "h100-nvlink-ib400"
    print(json.dumps({name: entry}, indent=2))
    result(step="calibration", profile=name, **entry)
    if write and s.device == "cuda":
        kt.write_entry(name, entry)
        print(f"written to {CALIBRATION}: copy this entry into the repository's file")


STEPS = {
    "kernels": bench_kernels,
    "attention": lambda s: (bench_attention(s, write=True), _builds().bench_graphs(s)),
    "graphs": lambda s: _builds().bench_graphs(s),  # also run by the suite's attention step
    "cp": lambda s: (
        bench_cp(s),
        _breakdown().kernel_breakdown(s, cps=_goal_cp(s)),
        _memory().memory_by_rank(s, cps=_goal_cp(s)),
        _breakdown().route_choice(s, cp=s.cp_sizes[-1]),
        _breakdown().host_profile(s),
    ),
    "memory": lambda s: _memory().memory_by_rank(s, cps=_goal_cp(s)),
    "breakdown": lambda s: (_breakdown().kernel_breakdown(s, cps=_goal_cp(s)), _breakdown().host_profile(s)),
    "calibration": lambda s: bench_calibration(s, write=True),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("step", choices=list(STEPS))
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes (what CI runs)")
    args = ap.parse_args()
    s = sizes(args.dry_run)
    if s.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device (or --dry-run)")
    torch.manual_seed(0)
    STEPS[args.step](s)


if __name__ == "__main__":
    main()

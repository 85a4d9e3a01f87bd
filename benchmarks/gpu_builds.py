"""Graph and kernel builds of the local kernel candidates over random micro-batches (the
suite's attention step): cuDNN graphs and FA4 JIT configurations, each with the goal of none
after the first 10 of 50 micro-batches."""

from __future__ import annotations

import math
import time

import torch
from gpu_bench import Sizes, _batch, result, timed


def builds_per_batch(s: Sizes, mod, counts) -> list[int]:
    """Graphs or kernels ``mod`` (a candidate module) builds in each of 50 random micro-batches
    of whole-batch calls, causal and unmasked, forward and backward (``counts()``: its running
    ``{"fwd": n, "bwd": n, ...}``)."""
    tokens, built, sc = s.pick_tokens[0], [], 1 / math.sqrt(s.d)
    for seed in range(50):
        lens, cu, q, k, v = _batch(s, seed=100 + seed, tokens=tokens)
        cu_d, mx = cu.to(s.device), max(lens)
        before = counts()
        for causal, window in ((True, (-1, 0)), (False, (-1, -1))):
            o, lse = mod.attn_fwd(q, k, v, cu_d, cu_d, mx, mx, causal, window, sc)
            mod.attn_bwd(o, q, k, v, o, lse, cu_d, cu_d, mx, mx, causal, window, sc)
        after = counts()
        built.append(after["fwd"] + after["bwd"] - before["fwd"] - before["bwd"])
    torch.cuda.synchronize()
    return built


def bench_fa4_configs(s: Sizes) -> None:
    """FA4 kernel configurations met (each a JIT compile the first time) over 50 random
    micro-batches (CP 1 calls, causal and unmasked, forward and backward; goal: none after the
    first 10)."""
    from megatron_cp_ext.backends import fa4

    if s.device != "cuda" or not fa4.available():
        print("fa4 candidate not available here: no kernels to count")
        result(step="fa4_configs", available=False)
        return
    tokens, t0 = s.pick_tokens[0], time.perf_counter()
    built = builds_per_batch(s, fa4, fa4.compile_counts)
    print(f"fa4 kernel configurations met per micro-batch ({tokens} tokens): {built}; "
          f"first 10: {sum(built[:10])}, last 40: {sum(built[10:])}; {fa4.compile_counts()}")  # fmt: skip
    result(step="fa4_configs", available=True, tokens=tokens, built=built, first10=sum(built[:10]),
           last40=sum(built[10:]), seconds=time.perf_counter() - t0,
           refused=fa4.compile_counts()["refused"])  # fmt: skip


def bench_graphs(s: Sizes) -> None:
    """cuDNN graphs built over 50 random micro-batches (CP 1 calls, causal and unmasked, forward
    and backward; goal: none after the first 10), and what a looser length bucket costs."""
    from megatron_cp_ext.backends import cudnn

    bench_fa4_configs(s)
    if s.device != "cuda" or not cudnn.available():
        print("cudnn candidate not available here: no graphs to count")
        result(step="graphs", available=False)
        return
    tokens, sc = s.pick_tokens[0], 1 / math.sqrt(s.d)
    built = builds_per_batch(s, cudnn, cudnn.graph_counts)
    c = cudnn.graph_counts()
    print(f"graphs built per micro-batch ({tokens} tokens, lognormal median {s.median_len}): {built}")
    print(f"first 10: {sum(built[:10])}, last 40: {sum(built[10:])}; all graphs so far {c}")
    lens, cu, q, k, v = _batch(s)
    cu_d, mx = cu.to(s.device), max(lens)
    t = {
        f: timed(lambda f=f: cudnn.attn_fwd(q, k, v, cu_d, cu_d, f * mx, f * mx, True, (-1, 0), sc), s) for f in (1, 2)
    }
    print(
        f"forward causal at {s.tokens} tokens: length bound = longest {t[1] * 1e3:.2f} ms, twice it {t[2] * 1e3:.2f} ms"
    )
    result(step="graphs", available=True, tokens=tokens, built=built, first10=sum(built[:10]),
           last40=sum(built[10:]), build_s=c["build_s"], refused=c["refused"], fwd_ms_bound1=t[1] * 1e3,
           fwd_ms_bound2=t[2] * 1e3)  # fmt: skip

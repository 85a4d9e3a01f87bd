"""Does the cost model rank comm types the way they measure? gloo CPU ranks, one run.

    python benchmarks/cost_model_check.py [--world-size 4] [--iters 3]

First a microbenchmark calibrates the ``cpu-gloo`` profile on this machine, with every rank
busy at once as in the real runs: forward and backward attention throughput over the tile
area its reference kernel visits in one long causal call, the fixed cost of a tiny call, and gloo's pairwise bandwidth
and latency. Then, per case, every comm type runs forward + backward (best of the
iterations, slowest rank) and the table prints predicted vs measured time and rank, and
whether the predicted winner and the whole order agree. Cases: ``compute-bound`` (long
documents, many query heads per KV head), ``comm-bound`` (8-token documents cut across ranks,
8 KV heads of dim 128: bytes dominate) and ``overhead-bound`` (short documents, tiny heads:
per-step host work dominates, which the model does not price).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.distributed as dist

import megatron_cp_ext as mcx
from megatron_cp_ext.inspect import inspect_plan
from megatron_cp_ext.planner.cost import call_area, call_flops, predict
from megatron_cp_ext.planner.profiles import load_profile
from megatron_cp_ext.testing.spawn import bench_main

COMMS = [("p2p", None), ("all_gather", None), ("a2a", None), ("a2a+p2p", 2)]
CASES = {  # name: (seqlens, balance, hq, hkv, d)
    "compute-bound": ([2048, 1024, 1024], "workload", 8, 1, 64),
    "comm-bound": ([8] * 512, "dualchunk", 8, 8, 128),
    "overhead-bound": ([256] * 16, "dualchunk", 2, 2, 16),
}


def _max(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _timed(fn, iters: int) -> float:
    best = float("inf")
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        best = min(best, _max(time.perf_counter() - t0))
    return best


def _calibrate(rank: int, world: int, iters: int):
    """cpu-gloo constants measured with every rank busy at once."""
    n, h, d = 1024, 4, 64
    q, k, v = (torch.randn(n, h, d, requires_grad=True) for _ in range(3))
    sh = mcx.shard_sequences([0, n], 1)
    fwd = _timed(lambda: mcx.cp_attention(q, k, v, cp_group=None, sharding=sh), iters)
    out = mcx.cp_attention(q, k, v, cp_group=None, sharding=sh)
    both = _timed(lambda: mcx.cp_attention(q, k, v, cp_group=None, sharding=sh).sum().backward(), iters)
    del out
    base = load_profile("cpu-gloo")
    calls = inspect_plan(sh, "p2p", num_heads=h, num_kv_heads=h, head_dim=d).ranks[0].calls
    fl = call_flops(sum(call_area(c, base) for c in calls), h, d, d)
    q1, k1, v1 = (torch.randn(1, 1, 8, requires_grad=True) for _ in range(3))
    sh1 = mcx.shard_sequences([0, 1], 1)
    launch = _timed(lambda: mcx.cp_attention(q1, k1, v1, cp_group=None, sharding=sh1).sum().backward(), iters) / 2
    big, small = torch.zeros(4 << 20, dtype=torch.uint8), torch.zeros(1, dtype=torch.uint8)
    peer = rank ^ 1

    def ping(x):
        if peer >= world:
            return
        ops = [dist.P2POp(dist.isend, x, peer), dist.P2POp(dist.irecv, torch.empty_like(x), peer)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()

    lat = _timed(lambda: ping(small), iters * 3)
    bw = big.numel() / max(_timed(lambda: ping(big), iters) - lat, 1e-9)
    return load_profile(
        base, fwd_tflops=fl["forward"] / fwd / 1e12, bwd_tflops=fl["backward"] / max(both - fwd, 1e-9) / 1e12,
        launch_us=launch * 1e6, intra_gbps=bw / 1e9, inter_gbps=bw / 1e9, latency_us=lat * 1e6,
    )  # fmt: skip


def _measure(rank, world, case, groups, iters):
    seqlens, balance, hq, hkv, d = case
    cu = np.cumsum([0, *seqlens]).tolist()
    sh = mcx.shard_sequences(cu, world, balance)
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(cu[-1], h, d, generator=g) for h in (hq, hkv, hkv)]
    q, k, v = (sh.shard(x, rank).requires_grad_() for x in full)
    out = {}
    for comm, a in COMMS:
        group = groups[a] if a else dist.group.WORLD

        def run(group=group, comm=comm):
            mcx.cp_attention(q, k, v, cp_group=group, comm_type=comm, sharding=sh).sum().backward()

        run()  # builds and caches the plan
        out[comm] = _timed(run, iters)
    return sh, out


def _order(times: dict[str, float]) -> list[str]:
    return sorted(times, key=times.get)


def _bench(rank: int, world: int, args: argparse.Namespace) -> None:
    prof = _calibrate(rank, world, args.iters)
    groups = {a: mcx.hierarchical_cp_groups(a) for _, a in COMMS if a}
    lines = []
    agree = []
    for name, case in CASES.items():
        sh, measured = _measure(rank, world, case, groups, args.iters)
        _, _, hq, hkv, d = case
        pred = {}
        for comm, a in COMMS:
            rep = inspect_plan(sh, comm, a2a_size=a, num_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=torch.float32)
            pred[comm] = predict(rep, prof).total_s
        po, mo = _order(pred), _order(measured)
        for comm, _ in COMMS:
            lines.append(
                f"| {name} | {comm} | {pred[comm] * 1e3:.1f} | {po.index(comm) + 1} "
                f"| {measured[comm] * 1e3:.1f} | {mo.index(comm) + 1} |"
            )
        slower = measured[po[0]] / measured[mo[0]] - 1
        verdict = "agree" if po[0] == mo[0] else f"DISAGREE, predicted winner measured {slower:.0%} slower"
        agree.append(f"{name}: predicted winner {po[0]}, measured {mo[0]} ({verdict}); order "
                     f"{'agrees' if po == mo else 'differs'}")  # fmt: skip
    if rank == 0:
        print(f"world {world}, gloo CPU; calibrated cpu-gloo: fwd {prof.fwd_tflops * 1e3:.2f} GFLOP/s, "
              f"bwd {prof.bwd_tflops * 1e3:.2f} GFLOP/s, launch {prof.launch_us:.0f} us, "
              f"link {prof.intra_gbps:.2f} GB/s, latency {prof.latency_us:.0f} us")  # fmt: skip
        print("| case | comm type | predicted fwd+bwd ms | predicted rank | measured fwd+bwd ms | measured rank |")
        print("|---|---|---|---|---|---|")
        print("\n".join(lines))
        print("\n".join(agree))


def main() -> None:
    bench_main(_bench, __doc__, iters=3)


if __name__ == "__main__":
    main()

"""Side-by-side timing of every comm type on CPU ranks over gloo (one run, same inputs).

    python benchmarks/bench_comm_types.py [--world-size 4] [--seqlens 2048,511,1,700] [--iters 3]

Prints, per comm type and mask, forward+backward ms per call (best of the iterations, max
over ranks), the ratio to p2p measured in the same run, and the first call's time, which
also builds the plan (consistency exchange + host plan) that later layers and the
backward reuse. CPU numbers rank schedules by host overhead and comm volume; GPU
kernel speed is measured with the same script on a CUDA machine (``--device cuda``, NCCL).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

import megatron_cp_ext as mcx
from megatron_cp_ext.testing.spawn import bench_main

COMMS = [("p2p", 0), ("all_gather", 0), ("a2a", 0), ("a2a+p2p", 2)]
MASKS = {
    "causal": dict(causal=True),
    "nomask": dict(causal=False),
    "window128": dict(causal=True, window_size=(128, -1)),
}


def _time_one(args, rank, world, comm, a2a_size, mask_kw, groups, dev):
    seqlens = [int(x) for x in args.seqlens.split(",")]
    cu = torch.tensor([0, *seqlens]).cumsum(0)
    g = torch.Generator().manual_seed(0)
    t = int(cu[-1])
    shapes = ((args.heads, args.head_dim), (args.kv_heads, args.head_dim), (args.kv_heads, args.head_dim))
    full = [torch.randn(t, h, d, generator=g) for h, d in shapes]
    sharding = mcx.shard_sequences(cu, world)
    q, k, v = (sharding.shard(x, rank).to(dev).requires_grad_() for x in full)
    group = groups.get(a2a_size, dist.group.WORLD) if comm == "a2a+p2p" else dist.group.WORLD
    call = lambda: mcx.cp_attention(q, k, v, cp_group=group, comm_type=comm, sharding=sharding, **mask_kw)  # noqa: E731
    dist.barrier()
    t0 = time.perf_counter()
    call().sum().backward()  # first call: builds and caches the plan
    first = time.perf_counter() - t0
    times = []
    for _ in range(args.iters):
        dist.barrier()
        t0 = time.perf_counter()
        call().sum().backward()
        times.append(time.perf_counter() - t0)
    steady = min(times)
    both = torch.tensor([steady, first], dtype=torch.float64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    return both.tolist()


def _bench(rank: int, world: int, args: argparse.Namespace) -> None:
    dev = torch.device(args.device)
    groups = {a: mcx.hierarchical_cp_groups(a) for _, a in COMMS if a}
    rows = []
    for mask_name, mask_kw in MASKS.items():
        base = None
        for comm, a2a_size in COMMS:
            steady, plan = _time_one(args, rank, world, comm, a2a_size, mask_kw, groups, dev)
            base = steady if base is None else base
            rows.append(
                (
                    mask_name,
                    comm if not a2a_size else f"{comm}({a2a_size}x{world // a2a_size})",
                    steady,
                    plan,
                    steady / base,
                )
            )
    if rank == 0:
        heads = f"heads {args.heads}/{args.kv_heads}, d {args.head_dim}"
        print(f"world {world}, seqlens {args.seqlens}, {heads}, {args.device}")
        print(f"{'mask':<10}{'comm_type':<18}{'fwd+bwd ms':>12}{'vs p2p':>8}{'1st call ms':>12}")
        for mask_name, comm, steady, plan, ratio in rows:
            print(f"{mask_name:<10}{comm:<18}{steady * 1e3:>12.1f}{ratio:>8.2f}{plan * 1e3:>12.1f}")


def main() -> None:
    bench_main(_bench, __doc__, iters=5)


if __name__ == "__main__":
    main()

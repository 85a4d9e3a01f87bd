"""What check mode (``cp_attention(check=True)``) costs per attention call.

    python benchmarks/bench_check_mode.py [--world-size 4] [--seqlens 1024,255,1,600,0,97] [--iters 20]

Without check mode the consistency exchange runs once per new signature (the first call of a
micro-batch); with it, on every call. Prints, per comm type: forward+backward ms per call
with and without check mode (median over iterations, max over ranks), the difference, and the
exchange alone (one signature all-gather and the comparison, median). On CPU/gloo the
difference is the exchange's latency; on GPU/NCCL the exchange also ends in a host sync
(``.tolist()`` of the gathered signatures), which drains the queue of kernels the host had
run ahead with — measure it there with ``--device cuda`` on a multi-GPU machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import megatron_cp_ext as mcx
from megatron_cp_ext.runtime import agreement
from megatron_cp_ext.runtime.groups import ranks_crc
from megatron_cp_ext.testing.spawn import bench_main

COMMS = [("p2p", 0), ("all_gather", 0), ("a2a", 0), ("a2a+p2p", 2)]


def _max_over_ranks(ms: float) -> float:
    t = torch.tensor([ms], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _medians_ms(fns: list, iters: int) -> list[float]:
    """Median ms per call of each function, alternating them so load drifts hit all alike."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(iters):
        for i, fn in enumerate(fns):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - t0)
    return [_max_over_ranks(statistics.median(t) * 1e3) for t in times]


def _bench(rank: int, world: int, args: argparse.Namespace) -> None:
    dev = torch.device(args.device)
    torch.manual_seed(0)
    cu = torch.tensor([0, *map(int, args.seqlens.split(","))]).cumsum(0)
    sharding = mcx.shard_sequences(cu, world)
    shapes = ((args.heads, args.head_dim), (args.kv_heads, args.head_dim), (args.kv_heads, args.head_dim))
    q, k, v = (sharding.shard(torch.randn(int(cu[-1]), h, d), rank).to(dev).requires_grad_() for h, d in shapes)
    pair = mcx.hierarchical_cp_groups(2) if world % 2 == 0 else None
    rows = []
    for comm, a2a_size in COMMS:
        if a2a_size and pair is None:
            continue
        group = pair if comm == "a2a+p2p" else dist.group.WORLD
        kw = dict(cp_group=group, comm_type=comm, sharding=sharding, causal=True)
        calls = [
            lambda kw=kw, check=check: mcx.cp_attention(q, k, v, check=check, **kw).sum().backward()
            for check in (False, True)
        ]
        for call in calls:
            call()  # builds the plan and agrees once
        rows.append((comm, *_medians_ms(calls, args.iters)))
    members = dict(a2a_members=ranks_crc([rank]), p2p_members=ranks_crc(range(world)), a2a_name=0, p2p_name=0)
    sig = agreement.signature(error=0, global_rank=rank, cp_rank=rank, cp_size=world, a2a_size=1, **members)
    path = agreement.exchange_path(None, world)
    (exchange,) = _medians_ms([lambda: agreement.agree(sig, path)], args.iters * 5)
    if rank == 0:
        print(f"world {world}, seqlens {args.seqlens}, heads {args.heads}/{args.kv_heads}, d {args.head_dim}, {dev}")
        print(f"{'comm_type':<12}{'check off ms':>14}{'check on ms':>13}{'extra ms':>10}{'extra %':>9}")
        for comm, off, on in rows:
            print(f"{comm:<12}{off:>14.2f}{on:>13.2f}{on - off:>10.2f}{100 * (on - off) / off:>9.1f}")
        print(f"exchange alone (signature all-gather + comparison): {exchange:.3f} ms per call")


def main() -> None:
    bench_main(_bench, __doc__, iters=20)


if __name__ == "__main__":
    main()

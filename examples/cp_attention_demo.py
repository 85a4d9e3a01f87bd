"""Run cp_attention on CPU ranks over gloo (p2p, all_gather, a2a, a2a+p2p); print error and time per call.

    python examples/cp_attention_demo.py                 # spawns 4 ranks itself
    torchrun --nproc-per-node 4 examples/cp_attention_demo.py

Each rank holds its shard of a packed batch of variable-length sequences (the default
``workload`` balance); rank 0 gathers the output and compares it with a dense fp64 attention
over the whole batch. ``a2a+p2p`` runs with a2a groups of 2 ranks (an even world of 4 or more).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

import megatron_cp_ext as mcx
from megatron_cp_ext.runtime.comm import all_gather_padded
from megatron_cp_ext.testing.reference import dense_attention
from megatron_cp_ext.testing.spawn import spawn_ranks

COMM_TYPES = ["p2p", "all_gather", "a2a", "a2a+p2p"]


def _bench(rank: int, world: int, args: argparse.Namespace) -> None:
    seqlens = [int(x) for x in args.seqlens.split(",")]
    cu = torch.tensor([0, *seqlens]).cumsum(0)
    g = torch.Generator().manual_seed(0)
    t = int(cu[-1])
    q, k, v = (torch.randn(t, h, args.head_dim, generator=g) for h in (args.heads, args.kv_heads, args.kv_heads))
    sharding = mcx.shard_sequences(cu, world)
    ql, kl, vl = (sharding.shard(x, rank).requires_grad_() for x in (q, k, v))
    ref = dense_attention(q, k, v, cu, causal=True) if rank == 0 else None
    if rank == 0:
        print(
            f"{world} ranks, sequences {seqlens}, heads {args.heads}/{args.kv_heads}, local tokens {sharding.counts()}"
        )
        print(f"{'comm_type':<12}{'max |err| fwd':>16}{'fwd+bwd ms/call':>18}")
    hierarchical = world >= 4 and world % 2 == 0
    pair = mcx.hierarchical_cp_groups(2) if hierarchical else None  # collective: every rank builds it
    for comm in COMM_TYPES:
        if comm == "a2a+p2p" and not hierarchical:
            if rank == 0:
                print(f"{comm:<12}{'needs an even world of 4 or more':>34}")
            continue
        group = pair if comm == "a2a+p2p" else dist.group.WORLD
        run = lambda comm=comm, group=group: mcx.cp_attention(
            ql, kl, vl, cp_group=group, comm_type=comm, sharding=sharding
        )
        out = run()
        out.sum().backward()  # warm-up (plan build happens here, once)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(args.iters):
            run().sum().backward()
        dist.barrier()
        ms = (time.perf_counter() - start) / args.iters * 1e3
        pad = max(sharding.counts())
        full = all_gather_padded(out.detach(), pad, dist.group.WORLD)
        parts = [full[r * pad : r * pad + n] for r, n in enumerate(sharding.counts())]
        if rank == 0:
            err = (sharding.unshard(parts).double() - ref).abs().max().item()
            print(f"{comm:<12}{err:>16.2e}{ms:>18.1f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=4, help="ranks to spawn when not under torchrun")
    p.add_argument("--seqlens", default="517,1,0,1030,77,256", help="comma-separated sequence lengths")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--iters", type=int, default=3)
    args = p.parse_args()
    if os.environ.get("MCX_DEMO_SHORT"):  # CI smoke run
        args.iters = 1
    if "RANK" in os.environ:  # torchrun
        dist.init_process_group("gloo")
        torch.set_num_threads(1)
        _bench(dist.get_rank(), dist.get_world_size(), args)
        dist.destroy_process_group()
        return
    spawn_ranks(_bench, args.world_size, args)


if __name__ == "__main__":
    main()

"""Host work inside the ``p2p`` ring (forward + backward) of layer 1 against layers 2 and 3.

Runs CPU ranks (gloo) with the flash-shaped kernel stub, 16/4 heads, d 64, fp32, dualchunk,
the batch of ``memory_launches.py``. The ring's and the staged schedule's forward and
backward are wrapped in cProfile, so only the schedule is counted: layer 1's plan is built by the same
``cp_attention`` call before the schedule starts. Per layer, max over ranks: numpy calls,
``torch.from_numpy`` / ``Tensor.to`` calls (uploads, or casts), all profiled Python/C calls,
and the schedule's thread CPU ms (noisy; the counts are exact).

    python benchmarks/first_layer_host.py --comm p2p --world-size 4
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch
import torch.distributed as dist
from memory_launches import _seqlens

import megatron_cp_ext as mcx
from megatron_cp_ext.schedules import p2p, staged
from megatron_cp_ext.testing.accounting import flash_stub
from megatron_cp_ext.testing.spawn import spawn_ranks


def _counts(prof: cProfile.Profile) -> tuple[int, int, int]:
    st = pstats.Stats(prof)
    rows = [(f, name, v[1]) for (f, _, name), v in st.stats.items()]
    numpy = sum(n for f, name, n in rows if "numpy" in f or "numpy" in name)
    moves = sum(n for _, name, n in rows if "from_numpy" in name or "method 'to' of" in name)
    return numpy, moves, st.total_calls


def _worker(rank: int, world: int, args) -> None:
    group = mcx.hierarchical_cp_groups(2) if args.comm == "a2a+p2p" else dist.group.WORLD
    cu = [0]
    for n in _seqlens(args.tokens):
        cu.append(cu[-1] + n)
    sharding = mcx.shard_sequences(cu, world, balance="dualchunk")
    t = sharding.num_tokens(rank)
    q, k, v = (torch.randn(t, h, 64, requires_grad=True) for h in (16, 4, 4))
    dout = torch.randn(t, 16, 64)
    state = {}

    def wrap(fn):
        def inner(*a, **kw):
            if state["depth"]:  # a schedule calling another (a2a+p2p's ring): counted once
                return fn(*a, **kw)
            t0 = time.thread_time()
            state["depth"] += 1
            state["prof"].enable()
            try:
                return fn(*a, **kw)
            finally:
                state["prof"].disable()
                state["depth"] -= 1
                state["cpu"] += time.thread_time() - t0

        return inner

    # the ring and its staged form (the default where every rank receives at most two blocks)
    p2p.forward, p2p._backward = wrap(p2p.forward), wrap(p2p._backward)
    staged.forward, staged.backward = wrap(staged.forward), wrap(staged.backward)
    staged.backward_packed = wrap(staged.backward_packed)
    state["depth"] = 0
    rows = []
    with flash_stub():
        for _ in range(3):
            state["prof"], state["cpu"] = cProfile.Profile(), 0.0
            mcx.cp_attention(q, k, v, cp_group=group, comm_type=args.comm, sharding=sharding).backward(dout)
            rows.append((*_counts(state["prof"]), state["cpu"] * 1e3))
    out = [None] * world
    dist.all_gather_object(out, rows)
    if rank == 0:
        print(f"{args.comm} cp {world}, {args.tokens} tokens (max over ranks)")
        print("| layer | numpy calls | from_numpy / to | Python/C calls | schedule CPU ms |")
        print("|---|---|---|---|---|")
        for i in range(3):
            vals = [max(r[i][j] for r in out) for j in range(4)]
            print(f"| {i + 1} | {vals[0]} | {vals[1]} | {vals[2]} | {vals[3]:.1f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--comm", default="p2p", choices=["p2p", "a2a+p2p"])
    args = p.parse_args()
    spawn_ranks(_worker, args.world_size, args)


if __name__ == "__main__":
    main()

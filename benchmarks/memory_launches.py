"""Per rank: memory peaks, saved bytes and aten ops of one ``cp_attention`` layer, per comm type.

Runs on CPU ranks (gloo) with the flash-shaped kernel stub and the dispatch tracker of
:mod:`megatron_cp_ext.testing.accounting`, so the numbers are what a GPU run would allocate
and launch around the kernels (the kernels' own outputs included, their workspaces not).
``ideal`` is the local q, k, v, output and fp32 lse; ``saved`` what autograd keeps for
backward plus the output (which the next layer keeps anyway); forward peak counts q, k, v and all
that the call allocates; backward peak counts what forward saved, the output, dout, and
all that backward allocates (dq, dk, dv included) — q, k, v themselves only where forward
saved them (p2p, all_gather: a2a saves head-sharded copies instead, and a training step
frees inputs nobody saved).
``calls``/``bwd_calls``: kernel calls forward/backward; ``fwd_comms``/``bwd_comms``:
collectives. ``--a2a-groups N`` caps plain a2a's backward head groups at N regardless of the
size rule (``schedules/a2a_groups.py``), to compare the counts side by side; ``--p2p-groups N``
the same for p2p's backward (``p2p.head_groups``).

    python benchmarks/memory_launches.py --world-size 4 --tokens 8192
    python benchmarks/memory_launches.py --world-size 8 --tokens 512 --host-ms

``--seed S [--median M]`` takes a lognormal batch (``megatron_cp_ext.sharding.batches``) instead of
the fixed one, to check a figure on batches it was not measured on.

``--breakdown`` also prints, for the worst rank of each comm type, every storage alive at the
forward and backward peaks (size as a multiple of the ideal, allocating op and source line).

``--host-ms`` also prints host CPU ms per layer (forward + backward, plan cached) with the
stub kernels, i.e. the Python and dispatch overhead a GPU step would pay.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

import megatron_cp_ext as mcx
from megatron_cp_ext.schedules import a2a_groups, p2p
from megatron_cp_ext.sharding import batches
from megatron_cp_ext.testing.accounting import Tracker, add_storage, flash_stub, saved_bytes
from megatron_cp_ext.testing.spawn import spawn_ranks

COMMS = ("p2p", "all_gather", "a2a", "a2a+p2p")
LAYERS = 3
"""Layers measured per comm type; each peak is the least of them."""


def _seqlens(tokens: int) -> list[int]:
    """A packed batch: one long document, some medium, a few short ones."""
    lens, left = [], tokens
    for frac in (0.4, 0.2, 0.15, 0.1, 0.05, 0.05):
        lens.append(int(tokens * frac))
        left -= lens[-1]
    return lens + [left] if left else lens


def _layer(rank, world, args, comm, group, sharding):
    dtype = getattr(torch, args.dtype)
    t = sharding.num_tokens(rank)
    g = torch.Generator().manual_seed(rank)
    q = torch.randn(t, args.heads, args.head_dim, generator=g).to(dtype).requires_grad_()
    k = torch.randn(t, args.kv_heads, args.head_dim, generator=g).to(dtype).requires_grad_()
    v = torch.randn(t, args.kv_heads, args.head_dim, generator=g).to(dtype).requires_grad_()
    dout = torch.randn(t, args.heads, args.head_dim, generator=g).to(dtype)
    call = dict(cp_group=group, comm_type=comm, sharding=sharding)
    mcx.cp_attention(q, k, v, **call).backward(dout)  # plan built and cached, agreement done
    q.grad = k.grad = v.grad = None
    ideal = sum(x.numel() * x.element_size() for x in (q, k, v, dout)) + t * args.heads * 4
    # the least of LAYERS layers: gloo's own thread releases a collective's buffer an op late in
    # some layers (it holds the tensors of a finished op a moment longer), which NCCL does not
    best = None
    for _ in range(LAYERS):
        tr = Tracker(where=args.breakdown)
        tr.track(q, k, v)
        refs: dict = {}
        with tr, saved_bytes(refs=refs) as saved:
            out = mcx.cp_attention(q, k, v, **call)
        add_storage(saved, out)  # an output projection saves the output: count it once
        fwd = (tr.peak, tr.num_ops, tr.kernels, tr.live_at_peak, tr.comms)
        tr.ops.clear()
        tr.kernels = tr.comms = 0
        tr.restart(refs, dout, out)  # q, k, v count only where saved: a training step frees them
        with tr:
            out.backward(dout)
        q.grad = k.grad = v.grad = None
        if best is None:
            best = [fwd, tr, saved]
        best[0] = min(best[0], fwd, key=lambda x: x[0])
        best[1] = min(best[1], tr, key=lambda x: x.peak)
    (fwd_peak, fwd_ops, fwd_kernels, fwd_live, fwd_comms), tr, saved = best
    res = dict(fwd=fwd_peak / ideal, bwd=tr.peak / ideal, saved=sum(saved.values()) / ideal)
    res.update(fwd_ops=fwd_ops, bwd_ops=tr.num_ops, calls=fwd_kernels)
    res.update(fwd_comms=fwd_comms, bwd_comms=tr.comms, bwd_calls=tr.kernels)
    if args.breakdown:
        res["live"] = {"fwd": [(n / ideal, lab) for n, lab in fwd_live]}
        res["live"]["bwd"] = [(n / ideal, lab) for n, lab in tr.live_at_peak]
    if args.host_ms:
        res["host_ms"] = _host_ms(q, k, v, dout, call, args.iters)
    return res


def _host_ms(q, k, v, dout, call, iters: int) -> float:
    """Host CPU time of the calling thread per layer (forward + backward) with the stub kernels,
    plan cached: the Python and dispatch work a GPU step would pay (gloo's own threads excluded)."""
    best = float("inf")
    for _ in range(iters):
        dist.barrier()
        t0 = time.thread_time()
        mcx.cp_attention(q, k, v, **call).backward(dout)
        best = min(best, time.thread_time() - t0)
    return best * 1e3


def _worker(rank: int, world: int, args) -> None:
    torch.manual_seed(0)
    a2a_groups.GROUPS = args.a2a_groups
    p2p.GROUPS = args.p2p_groups
    a2a_size = 2 if world % 2 == 0 and world > 2 else world
    pair = mcx.hierarchical_cp_groups(a2a_size) if world > 1 else None
    if args.seed is None:
        lens = _seqlens(args.tokens)
    else:
        lens = batches.lognormal(args.tokens, median=args.median, seed=args.seed)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    sharding = mcx.shard_sequences(cu, world, balance=args.balance)
    rows = []
    with flash_stub():
        for comm in args.comm.split(","):
            group = pair if comm == "a2a+p2p" else dist.group.WORLD
            rows.append((comm, _layer(rank, world, args, comm, group, sharding)))
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        _print(world, args, gathered)


def _print(world: int, args, gathered) -> None:
    print(f"cp {world}, {args.tokens} tokens, {args.heads}/{args.kv_heads} heads, d {args.head_dim}, {args.dtype}, "
          f"balance {args.balance} (worst rank; peaks and saved as multiples of the ideal)")  # fmt: skip
    cols = ["fwd", "bwd", "saved", "fwd_ops", "bwd_ops", "calls", "bwd_calls", "fwd_comms", "bwd_comms"]
    cols += ["host_ms"] if args.host_ms else []
    print("| comm | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for i, (comm, _) in enumerate(gathered[0]):
        vals = [max(r[i][1][c] for r in gathered) for c in cols]
        print(f"| {comm} | " + " | ".join(f"{x:.2f}" if isinstance(x, float) else str(x) for x in vals) + " |")
    if args.breakdown:
        for i, (comm, _) in enumerate(gathered[0]):
            for phase in ("fwd", "bwd"):
                rank = max(range(world), key=lambda r: gathered[r][i][1][phase])
                res = gathered[rank][i][1]
                print(f"\n{comm} {phase} peak {res[phase]:.2f} on rank {rank}, alive:")
                for x, lab in res["live"][phase]:
                    print(f"  {x:.3f}  {lab}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--balance", default="dualchunk", choices=["dualchunk", "workload", "contiguous"])
    p.add_argument("--comm", default=",".join(COMMS))
    p.add_argument("--seed", type=int, default=None, help="a lognormal batch of this seed instead of the fixed one")
    p.add_argument("--median", type=int, default=2048, help="--seed: the lognormal batch's median document length")
    p.add_argument("--breakdown", action="store_true", help="list what is alive at each peak")
    p.add_argument("--host-ms", action="store_true")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument(
        "--a2a-groups", type=int, default=None, help="a2a backward head groups: at most this many (default: chosen)"
    )
    p.add_argument(
        "--p2p-groups", type=int, default=None, help="p2p backward head groups: at most this many (default: chosen)"
    )
    args = p.parse_args()
    spawn_ranks(_worker, args.world_size, args)


if __name__ == "__main__":
    main()

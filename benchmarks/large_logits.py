"""fp32 accuracy as logits grow: ``cp_attention`` at CP N on random fp32 inputs scaled so that
the largest scaled logit reaches a few thousand, against dense fp64 attention over the same
(fp32-rounded) inputs, beside fp32 ``scaled_dot_product_attention``'s own output error.

    python benchmarks/large_logits.py [--cp 4] [--comm p2p,all_gather]

The merge weighs partials by fp32 log-sum-exps (docs/algorithms.md, "Precision and autocast"):
the table shows what that rounding costs beside one fp32 softmax.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import megatron_cp_ext as mcx  # noqa: E402
from megatron_cp_ext.testing.pool import run_on_ranks  # noqa: E402
from megatron_cp_ext.testing.reference import dense_attention  # noqa: E402

SEQLENS = [0, 1, 17, 5, 33, 0, 2]
HQ, HKV, D = 4, 2, 8


def _inputs(mag: float) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(8)
    t = sum(SEQLENS)
    q, k, v = (torch.randn(t, h, D, generator=g) for h in (HQ, HKV, HKV))
    return [q * mag, k * mag, v]


def _worker(rank: int, world: int, comm: str, mag: float) -> tuple:
    cu = [0, *torch.tensor(SEQLENS).cumsum(0).tolist()]
    sharding = mcx.shard_sequences(cu, world)
    group = mcx.hierarchical_cp_groups(2) if comm == "a2a+p2p" else dist.group.WORLD
    local = [sharding.shard(x, rank).requires_grad_() for x in _inputs(mag)]
    out = mcx.cp_attention(*local, cp_group=group, comm_type=comm, sharding=sharding)
    out.backward(torch.ones_like(out))
    return out.detach(), local[0].grad, sharding.global_index(rank)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cp", type=int, default=4)
    ap.add_argument("--comm", default="p2p,all_gather")
    args = ap.parse_args(argv)
    cu = [0, *torch.tensor(SEQLENS).cumsum(0).tolist()]
    print(f"CP {args.cp}, fp32, documents {SEQLENS}, {HQ}/{HKV} heads of {D}: max |error| against dense fp64")
    print("| largest logit | comm | out | dq | fp32 SDPA out |")
    print("|---|---|---|---|---|")
    for mag in (1.0, 3.0, 10.0, 30.0):
        q, k, v = (x.double().requires_grad_() for x in _inputs(mag))
        want = dense_attention(q, k, v, cu, causal=True)
        want.backward(torch.ones_like(want))
        kk = k.detach().repeat_interleave(HQ // HKV, 1)
        top = (torch.einsum("qhd,khd->hqk", q.detach(), kk) / math.sqrt(D)).abs().max().item()
        sdpa = []
        for a, b in zip(cu[:-1], cu[1:]):
            if b > a:
                qs, ks, vs = (x.detach()[a:b].float().transpose(0, 1) for x in (q, kk, v.repeat_interleave(2, 1)))
                sdpa.append(
                    torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1)
                )
        sdpa_err = (torch.cat(sdpa).double() - want.detach()).abs().max().item()
        for comm in args.comm.split(","):
            err_o = err_q = 0.0
            for out, dq, idx in run_on_ranks(args.cp, _worker, comm, mag):
                idx = torch.as_tensor(idx)
                err_o = max(err_o, (out.double() - want.detach()[idx]).abs().max().item())
                err_q = max(err_q, (dq.double() - q.grad[idx]).abs().max().item())
            print(f"| {top:.0f} | {comm} | {err_o:.1e} | {err_q:.1e} | {sdpa_err:.1e} |", flush=True)


if __name__ == "__main__":
    main()

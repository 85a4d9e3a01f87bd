"""Bytes moved around the attention kernels per layer, per comm type and CP size (the CPU proxy
of ``megatron_cp_ext.testing.traffic``): forward and backward bytes read and written by every op
outside the kernels ÷ the ideal (the layer's own tensors and gradients plus the bytes it sends
and receives), launches, and the ops that move most, for the worst rank.

    python benchmarks/traffic.py                       # 16K tokens, 32/8 heads, d 128, bf16
    python benchmarks/traffic.py --tokens 2048 --heads 8 --kv-heads 2 --head-dim 64
    python benchmarks/traffic.py --comm a2a --cp 8 --route-floor 0   # a2a's moves all by route

a2a's head moves go run by run into place (``schedules/route.py``) where a GPU's would
(mean message of at least ``route.MIN_BYTES``), unless ``--route-floor`` says otherwise.

Gloo ranks on CPU with flash-shaped stub kernels: exact counts, the same on every run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_cp_ext.sharding import batches  # noqa: E402
from megatron_cp_ext.testing.pool import run_on_ranks  # noqa: E402
from megatron_cp_ext.testing.traffic import layer_traffic  # noqa: E402

COMMS = ("p2p", "all_gather", "a2a", "a2a+p2p")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--median", type=int, default=2048, help="lognormal document median")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--cp", default="2,4,8")
    ap.add_argument("--balance", default="workload")
    ap.add_argument("--comm", default=",".join(COMMS),
                    help="comma-separated; p2p:staged / p2p:ring (a2a+p2p:...) force how rings run")  # fmt: skip
    ap.add_argument("--route-floor", type=int, default=None, help="a2a: route messages of at least this many bytes")
    args = ap.parse_args(argv)
    lens = batches.lognormal(args.tokens, median=args.median, seed=args.seed)
    shape = (args.heads, args.kv_heads, args.head_dim)
    print(f"{len(lens)} documents, {args.tokens} tokens, heads {args.heads}/{args.kv_heads}, d {args.head_dim}, "
          f"{args.dtype}, {args.balance}; worst rank\n")  # fmt: skip
    print("| cp | comm | fwd ÷ ideal | bwd ÷ ideal | fwd launches | bwd launches | most bytes (fwd; bwd) |")
    print("|---|---|---|---|---|---|---|")
    for cp in map(int, args.cp.split(",")):
        for comm in args.comm.split(","):
            if comm.split(":")[0] == "a2a+p2p" and (cp < 4 or cp % 2):
                continue
            res = run_on_ranks(
                cp, layer_traffic, comm, lens, shape, args.dtype, args.balance, args.route_floor, timeout=900
            )
            worst = max(res, key=lambda r: r["fwd"] + r["bwd"])
            top = "; ".join(", ".join(name for name, _ in worst["top"][p][:3]) for p in ("fwd", "bwd"))
            print(f"| {cp} | {comm} | {max(r['fwd'] for r in res):.2f} | {max(r['bwd'] for r in res):.2f} | "
                  f"{max(r['fwd_launches'] for r in res)} | {max(r['bwd_launches'] for r in res)} "
                  f"| {top} |")  # fmt: skip


if __name__ == "__main__":
    main()

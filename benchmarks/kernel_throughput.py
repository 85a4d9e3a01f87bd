"""Measure this GPU's attention kernel constants for the cost model's named profile.

    python benchmarks/kernel_throughput.py --profile h100-nvlink-ib400 [--write]

Times the local varlen kernels at CP 1 (``cp_attention`` with the flash backend, bf16) on
packed causal batches, forward and forward + backward, and divides the FLOPs the cost model
counts for the same calls (``planner.cost.call_flops`` over the visited tile area) by the time:
the throughputs ``predict`` then uses are what this machine sustains on exactly that measure.
A batch of one-token documents gives the fixed cost per call. ``--write`` records the result in
``megatron_cp_ext/planner/calibration.json`` under ``--profile`` (commit it); links are not
measured here (one GPU), they stay datasheet values. Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

import megatron_cp_ext as mcx
from megatron_cp_ext.inspect import inspect_plan
from megatron_cp_ext.planner.cost import call_flops
from megatron_cp_ext.planner.profiles import CALIBRATION, PROFILES

SHAPES = [  # (document lengths, query heads, KV heads, head dim)
    ([8192] * 4, 32, 8, 128),
    ([2048] * 16, 32, 8, 128),
    ([512] * 64, 32, 8, 128),
]


def _time(fn, iters: int, device: str = "cuda") -> float:
    fn()
    if device != "cuda":  # the suite's CPU rehearsal
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def _case(
    lens: list[int], hq: int, hkv: int, d: int, iters: int, device="cuda", dtype=torch.bfloat16, backend="flash"
) -> tuple[float, float, dict[str, float]]:
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    sh = mcx.shard_sequences(cu, 1)
    opts = dict(device=device, dtype=dtype, requires_grad=True)
    q, k, v = (torch.randn(cu[-1], h, d, **opts) for h in (hq, hkv, hkv))

    def fwd():
        return mcx.cp_attention(q, k, v, cp_group=None, sharding=sh, causal=True, backend=backend)

    t_fwd = _time(fwd, iters, device)
    t_both = _time(lambda: fwd().backward(torch.ones_like(q)), iters, device)
    rep = inspect_plan(sh, "p2p", causal=True, num_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=dtype)
    area = sum(c.tile_area for c in rep.ranks[0].calls)
    return t_fwd, t_both - t_fwd, call_flops(area, hq, d, d)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="h100-nvlink-ib400", choices=[p for p in PROFILES if p != "cpu-gloo"])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--write", action="store_true", help=f"record the result in {CALIBRATION}")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("kernel_throughput.py needs a CUDA device")
    name = PROFILES[args.profile].name
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; profile {name}")
    entry = measure(SHAPES, args.iters)
    print(json.dumps({name: entry}, indent=2))
    if args.write:
        write_entry(name, entry)
        print(f"written to {CALIBRATION}")


def measure(shapes, iters: int, device: str = "cuda", dtype=torch.bfloat16, backend: str = "flash") -> dict:
    """The calibration entry (printing a table per shape); also ``gpu_suite.py``'s step."""
    print("| documents | heads q/kv | d | fwd ms | bwd ms | fwd TFLOP/s | bwd TFLOP/s |")
    print("|---|---|---|---|---|---|---|")
    fwd_rates, bwd_rates = [], []
    for lens, hq, hkv, d in shapes:
        tf, tb, fl = _case(lens, hq, hkv, d, iters, device, dtype, backend)
        fwd_rates.append(fl["forward"] / tf / 1e12)
        bwd_rates.append(fl["backward"] / tb / 1e12)
        print(f"| {len(lens)} x {lens[0]} | {hq}/{hkv} | {d} | {tf * 1e3:.3f} | {tb * 1e3:.3f} "
              f"| {fwd_rates[-1]:.4g} | {bwd_rates[-1]:.4g} |")  # fmt: skip
    tiny_f, tiny_b, _ = _case([1] * 8, 1, 1, 64, iters, device, dtype, backend)
    where = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    return {
        "fwd_tflops": round(min(fwd_rates), 4),  # the slowest shape: a conservative sustained rate
        "bwd_tflops": round(min(bwd_rates), 4),
        "launch_us": round((tiny_f + tiny_b) / 2 * 1e6, 1),
        "source": f"benchmarks/kernel_throughput.py on {where}, torch {torch.__version__}",
    }


def write_entry(name: str, entry: dict) -> None:
    """Record ``entry`` under profile ``name`` in ``planner/calibration.json``."""
    data = {}
    if os.path.isfile(CALIBRATION):
        with open(CALIBRATION) as f:
            data = json.load(f)
    data[name] = entry
    with open(CALIBRATION, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    main()

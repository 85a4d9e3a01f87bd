"""GPU probe of the cuDNN candidate (``backends/cudnn.py``) on the attention step's 128K batch:
the band anchored bottom-right (entries given as two tensors) against top-left (one tensor:
every entry has as many queries as keys), causal and windowed, forward and backward; and what
looser graph buckets cost (length bound and entry count above the call's own).

    python3 benchmarks/gpu_probe_cudnn.py
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import gpu_bench as gb  # noqa: E402

from megatron_cp_ext.backends import cudnn  # noqa: E402


def main() -> None:
    s = gb.GPU
    lens, cu, q, k, v = gb._batch(s)
    cu_d, mx, sc = cu.cuda(), max(lens), 1 / math.sqrt(s.d)
    print(f"{len(lens)} documents, {s.tokens} tokens, longest {mx}; heads {s.hq}/{s.hkv}, d {s.d}")
    print("| case | fwd ms | bwd ms | fwd TFLOP/s | bwd TFLOP/s |\n|---|---|---|---|---|")

    def row(name: str, cu_q, cu_k, bound: int, causal: bool, left: int) -> None:
        fl = 4.0 * gb.visible_pairs(lens, causal, left) * s.hq * s.d
        args = (cu_q, cu_k, bound, bound, causal, (left, 0 if causal else -1), sc)
        try:
            o, lse = cudnn.attn_fwd(q, k, v, *args)
            dout = torch.randn_like(o)
            t_f = gb.timed(lambda: cudnn.attn_fwd(q, k, v, *args), s)
            t_b = gb.timed(lambda: cudnn.attn_bwd(dout, q, k, v, o, lse, *args), s)
        except Exception as exc:  # noqa: BLE001 - reported
            print(f"| {name} | failed: {type(exc).__name__}: {str(exc)[:200]} | | | |")
            return
        print(f"| {name} | {t_f * 1e3:.2f} | {t_b * 1e3:.2f} | {fl / t_f / 1e12:.0f} | {2.5 * fl / t_b / 1e12:.0f} |")

    two = cu_d.clone()
    for mask, causal, left in (("causal", True, -1), ("window 4096", True, s.window), ("no mask", False, -1)):
        row(f"{mask}, bottom-right (two tensors)", cu_d, two, mx, causal, left)
        row(f"{mask}, top-left (one tensor)", cu_d, cu_d, mx, causal, left)
    for f in (4, 16):
        row(f"causal, top-left, length bound x{f}", cu_d, cu_d, f * mx, True, -1)
    more = torch.cat([cu_d, cu_d[-1:].expand(3 * len(lens))])  # 4x the entries, the extra ones empty
    row("causal, top-left, entries x4", more, more, mx, True, -1)
    print(f"graphs: {cudnn.graph_counts()}")


if __name__ == "__main__":
    main()

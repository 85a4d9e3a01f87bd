"""GPU probe: the flash wrappers (``backends/flash.py``) against the reference backend on single
calls of known shape (square and non-square entries, causal, windows with open sides, empty and
one-row entries), forward and backward; rows that see no key must carry lse -inf.

    python3 benchmarks/gpu_probe.py     # one line per case: max errors
"""

from __future__ import annotations

import sys

import torch

sys.path.insert(0, ".")
from megatron_cp_ext.backends import flash, reference  # noqa: E402

KERN = {"aten_flash": (flash.aten_fwd, flash.aten_bwd)}


def run(name, sq, sk, causal, window, h=8, hk=2, d=64, dv=64):
    fwd, bwd = KERN[name]
    g = torch.Generator(device="cuda").manual_seed(0)
    cq = torch.tensor([0, *torch.tensor(sq).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    ck = torch.tensor([0, *torch.tensor(sk).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    n, m = sum(sq), sum(sk)
    q = torch.randn(n, h, d, device="cuda", generator=g, dtype=torch.bfloat16)
    k = torch.randn(m, hk, d, device="cuda", generator=g, dtype=torch.bfloat16)
    v = torch.randn(m, hk, dv, device="cuda", generator=g, dtype=torch.bfloat16)
    do = torch.randn(n, h, dv, device="cuda", generator=g, dtype=torch.bfloat16)
    sc = d**-0.5
    args = (cq, ck, max(sq), max(sk), causal, window, sc)
    ro, rl = reference.attn_fwd(q.double(), k.double(), v.double(), *args)
    rg = reference.attn_bwd(do.double(), q.double(), k.double(), v.double(), ro, rl, *args)
    try:
        o, lse = fwd(q, k, v, *args)
        gr = bwd(do, q, k, v, o, lse, *args)
    except Exception as e:  # noqa: BLE001
        return f"ERROR {type(e).__name__}: {str(e)[:200]}"
    fin = rl.isfinite()
    errs = {
        "out": (o.double() - ro).abs().max().item(),
        "lse": (lse.double()[fin] - rl[fin]).abs().max().item() if fin.any() else 0.0,
        "empty_rows_ok": bool((lse[~fin] == float("-inf")).all().item()) and bool(lse[fin].isfinite().all().item()),
        "lse_shape": tuple(lse.shape),
    }
    for nm, a, b in zip(("dq", "dk", "dv"), gr, rg):
        errs[nm] = (a.double() - b).abs().max().item()
    return " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in errs.items())


CASES = [
    ("square causal", [100, 37], [100, 37], True, (-1, 0)),
    ("sq<sk causal", [50, 20], [100, 37], True, (-1, 0)),
    ("sq>sk causal", [100, 37], [50, 20], True, (-1, 0)),
    ("square window L20 causal", [100, 37], [100, 37], True, (20, 0)),
    ("sq<sk window L20 causal", [50, 20], [100, 37], True, (20, 0)),
    ("sq>sk window L20 causal", [100, 37], [50, 20], True, (20, 0)),
    ("square window 10,5", [100, 37], [100, 37], False, (10, 5)),
    ("sq<sk window 10,5", [50, 20], [100, 37], False, (10, 5)),
    ("sq<sk window 70,-1", [50, 20], [100, 37], False, (70, -1)),
    ("nomask square", [100, 37], [100, 37], False, (-1, -1)),
    ("nomask sq<sk", [50, 20], [100, 37], False, (-1, -1)),
    ("nomask with 0/1 rows", [0, 1, 64, 5], [3, 7, 64, 0], False, (-1, -1)),
    ("causal with 0/1 rows", [0, 1, 64, 5], [3, 7, 64, 5], True, (-1, 0)),
    ("window with 0/1 rows", [0, 1, 64, 5], [3, 7, 64, 5], True, (8, 0)),
    ("sq=1 entries gqa window", [1, 1, 1], [40, 3, 9], True, (4, 0)),
    ("sq>sk window 0,-1", [50], [13], False, (0, -1)),
    ("sq>sk window 5,-1 multi", [50, 7, 30], [13, 9, 2], False, (5, -1)),
    ("sq>sk window -1,3", [50, 7], [13, 9], False, (-1, 3)),
    ("sq=1 and 0 nomask gqa", [1, 0, 1], [5, 3, 7], False, (-1, -1)),
]

if __name__ == "__main__":
    for name in KERN:
        for label, sq, sk, causal, win in CASES:
            print(f"{name:10s} {label:28s} {run(name, sq, sk, causal, win)}", flush=True)
    for name in KERN:
        print(name, "mla", run(name, [50, 20], [100, 37], False, (-1, -1), h=8, hk=1, d=64, dv=32))

"""The flash wrappers on random call shapes of the kind ring steps emit, against the reference.

``test_flash_backend.py`` covers entries with at least as many keys as queries. A ring step's
calls also hold entries with more queries than keys (a window's lower edge), one-query calls
under GQA, and right window sides at or beyond every entry's keys:
exactly where FlashAttention-2 reads its window and ``max_seqlen`` arguments as if queries ==
keys (``flash._kernel_args``). ``tests/L0/test_flash_args.py`` emulates those rules on CPU;
this runs the kernels themselves (PyTorch's copy always, flash-attn's when installed), forward
and backward, on many random draws.
"""

import math
import random

import pytest
import torch

from megatron_cp_ext.backends import flash, reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

KERNELS = [("aten", flash.aten_fwd, flash.aten_bwd)]
if flash.HAS_FLASH_ATTN:
    KERNELS.append(("flash_attn", flash.fa_fwd, flash.fa_bwd))

HEADS = [(8, 8, 64, 64), (8, 2, 64, 64), (4, 1, 128, 64)]
"""(query heads, KV heads, D, Dv): MHA, GQA, MQA with a narrower V (MLA-like)."""


def _draw(rng: random.Random) -> tuple[list[int], list[int], bool, tuple[int, int]]:
    """One call: per-entry query/key lengths and a mask, biased to the shapes FA2 misreads.

    Every entry has a query and a key: plans never emit empty entries (checked on 112K calls
    of random plans)."""
    n = rng.randint(1, 5)
    kind = rng.choice(["more_q", "one_q", "mixed"])
    if kind == "one_q":
        lq = [1] * n
    else:
        lq = [rng.choice([1, rng.randint(2, 40), rng.randint(40, 200)]) for _ in range(n)]
    if kind == "more_q":
        lk = [rng.randint(1, max(1, x // 3)) for x in lq]
    else:
        lk = [rng.choice([1, rng.randint(1, 60), x + rng.randint(0, 90)]) for x in lq]
    causal = rng.random() < 0.3
    sides = [-1, 0, 1, 5, 37, 300]  # 300: beyond every entry's keys
    left = rng.choice(sides)
    right = 0 if causal else rng.choice(sides)
    return lq, lk, causal, (left, right)


def _cu(lengths: list[int], dev: torch.device) -> torch.Tensor:
    return torch.tensor([0, *lengths], device=dev).cumsum(0).to(torch.int32)


def check(fwd, bwd, heads: tuple[int, int, int, int], dev: torch.device, trials: int = 60) -> list:
    """The calls (of ``trials`` random ones) where ``fwd``/``bwd`` are off the reference."""
    hq, hkv, d, dv = heads
    rng = random.Random(hq * 1000 + hkv * 100 + d + dv)
    failures = []
    for trial in range(trials):
        lq, lk, causal, window = _draw(rng)
        g = torch.Generator(device=dev).manual_seed(trial)
        q = torch.randn(sum(lq), hq, d, device=dev, generator=g).to(torch.bfloat16)
        k = torch.randn(sum(lk), hkv, d, device=dev, generator=g).to(torch.bfloat16)
        v = torch.randn(sum(lk), hkv, dv, device=dev, generator=g).to(torch.bfloat16)
        dout = torch.randn(sum(lq), hq, dv, device=dev, generator=g).to(torch.bfloat16)
        args = (_cu(lq, dev), _cu(lk, dev), max(lq), max(lk), causal, window, 1 / math.sqrt(d))
        out, lse = fwd(q, k, v, *args)
        ref_out, ref_lse = reference.attn_fwd(q, k, v, *args)
        got = bwd(dout, q, k, v, out, lse, *args)
        want = reference.attn_bwd(dout, q, k, v, ref_out, ref_lse, *args)
        errors = {
            "out": (out.float() - ref_out.float()).abs().max().item(),
            "lse_inf": not torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)),
            "lse": (lse - ref_lse).nan_to_num(0.0, 0.0, 0.0).abs().max().item(),
            **{n: (a.float() - b.float()).abs().max().item() if a.numel() else 0.0
               for n, a, b in zip(("dq", "dk", "dv"), got, want)},
        }  # fmt: skip
        bad = errors["out"] > 2e-2 or errors["lse_inf"] or errors["lse"] > 1e-3
        if bad or any(errors[n] > 5e-2 for n in ("dq", "dk", "dv")):
            failures.append((lq, lk, causal, window, errors))
    return failures


@pytest.mark.parametrize("name, fwd, bwd", KERNELS, ids=[k[0] for k in KERNELS])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: "x".join(map(str, h)))
def test_random_ring_shapes_match_reference(name, fwd, bwd, heads) -> None:
    failures = check(fwd, bwd, heads, torch.device("cuda"))
    assert not failures, f"{name}: {len(failures)} of 60 calls off the reference, e.g. {failures[:3]}"

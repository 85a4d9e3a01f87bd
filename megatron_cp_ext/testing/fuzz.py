"""Seeded random configurations for the fuzz test: everything a valid call may vary.

One seed gives one :class:`~.cases.AttnCase` and its world size (2–4): random sequence
lengths (0 and 1 included, and lengths not divisible by anything), a random mask (causal /
none, windows incl. 0, chunks incl. 1), MHA / GQA / MQA / MLA head layouts, every comm type
(hierarchical group sizes included), the three formats, fp32 / bf16 / fp64, the built-in
balances or a random custom assignment of token ranges to ranks (segments in any order),
an explicit softmax scale, an attention sink and check mode. Only valid configurations are drawn: the point is
that every one matches the dense fp64 reference.
"""

from __future__ import annotations

import random

from .cases import AttnCase

__all__ = ["random_case"]

# (hq, hkv): MHA, GQA, MQA, and head counts that a2a must replicate or split
_HEADS = [(4, 4), (4, 2), (4, 1), (8, 2), (6, 3), (2, 1), (6, 6), (3, 1)]


def _lengths(rng: random.Random, n: int) -> tuple[int, ...]:
    def pick() -> int:
        u = rng.random()
        if u < 0.35:
            return rng.choice([0, 1, 2, 3])
        return rng.randint(260, 520) if u < 0.42 else rng.randint(4, 48)  # long ones get cut by workload

    return tuple(pick() for _ in range(n))


def _random_segments(rng: random.Random, seqlens: tuple[int, ...], world: int) -> tuple:
    """Cut every sequence at random points; give each piece to a random rank; shuffle ranks' lists."""
    per_rank: list[list] = [[] for _ in range(world)]
    for s, n in enumerate(seqlens):
        cuts = sorted({0, n, *(rng.randint(0, n) for _ in range(rng.randint(0, 3)))})
        for a, b in zip(cuts[:-1], cuts[1:]):
            per_rank[rng.randrange(world)].append((s, a, b))
    for segs in per_rank:
        if rng.random() < 0.5:
            rng.shuffle(segs)
    return tuple(tuple(x) for x in per_rank)


def _mask(rng: random.Random) -> dict:
    causal = rng.random() < 0.6
    left = rng.choice([-1, -1, 0, 1, 3, 7, 20])
    right = -1 if causal else rng.choice([-1, -1, 0, 2, 5])
    chunk = rng.choice([None, None, None, 1, 3, 8])
    return dict(causal=causal, window_size=(left, right), chunk_size=chunk)


def _comm(rng: random.Random, world: int, hq: int, hkv: int) -> tuple[str, int]:
    options = [("p2p", 0), ("all_gather", 0), ("a2a", 0)]  # a2a takes any head counts (uneven shards)
    options += [("a2a+p2p", a) for a in range(1, world + 1) if world % a == 0]
    return rng.choice(options)


def random_case(seed: int, dtype: str | None = None) -> tuple[int, AttnCase]:
    """``(world, case)`` for ``seed`` (deterministic); ``dtype`` pins the dtype (the fp64 run:
    every path computes and merges in fp64 and must match the reference to 1e-10)."""
    rng = random.Random(seed)
    world = rng.choice([2, 3, 4])
    hq, hkv = rng.choice(_HEADS)
    d = rng.choice([4, 8])
    dv = d if rng.random() < 0.7 else d - 2  # MLA: v head dim differs
    comm, a2a_size = _comm(rng, world, hq, hkv)
    fmt = "thd" if rng.random() < 0.8 else rng.choice(["bshd", "sbhd"])
    if fmt == "thd":
        seqlens = _lengths(rng, rng.randint(1, 6))
    else:  # b equal sequences, s divisible by 2 * cp
        seqlens = (2 * world * rng.randint(1, 5),) * rng.randint(1, 3)
    balance, segments = rng.choice(["workload", "dualchunk", "contiguous"]), None
    if fmt == "thd" and rng.random() < 0.3:
        segments = _random_segments(rng, seqlens, world)
    drawn = rng.choices(["float32", "bfloat16", "float16", "float64"], weights=[6, 2, 1.5, 1])[0]
    dtype = dtype or drawn
    extra: dict = {}
    if rng.random() < 0.3 and dtype not in ("bfloat16", "float16"):  # half tolerances assume the default scale
        extra["softmax_scale"] = rng.choice([0.05, 0.3, 1.0, 2.5])
    if rng.random() < 0.3:
        extra["check"] = True
    sink = tuple(round(rng.uniform(-2, 2), 3) for _ in range(hq)) if rng.random() < 0.3 else None
    case = AttnCase(
        seqlens=seqlens, comm_type=comm, hq=hq, hkv=hkv, d=d, dv=dv, dtype=dtype, balance=balance,
        segments=segments, seed=seed, a2a_size=a2a_size, qkv_format=fmt, extra=extra, sink=sink, **_mask(rng),
    )  # fmt: skip
    return world, case

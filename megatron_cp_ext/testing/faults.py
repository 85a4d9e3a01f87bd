"""Bad and rank-divergent inputs for the reliability suite (worker side).

Every rank of a pool builds the same valid ``cp_attention`` call; the ranks a :class:`Fault`
names get it changed (one argument, a tensor's dtype or shape, the sharding, the groups...),
on the first call or — for check mode — on a second call after a valid first one. Each rank
reports what it raised, so the driver can require the *same* error (class and message) on
every rank, naming the argument. A rank that hangs is caught by the pool's watchdog.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import megatron_cp_ext as mcx

from .cases import AttnCase, cp_group_for

__all__ = ["Fault", "attempt", "BASE_SEQLENS"]

BASE_SEQLENS = (13, 0, 1, 30, 7, 2)
_BSHD = (2, 24)  # b, s (global): s divisible by 2*cp for cp 2 and 4


@dataclass(frozen=True)
class Fault:
    """One bad or rank-divergent input and the error it must raise on every rank."""

    name: str
    change: dict
    """What the faulty ranks do differently: ``cp_attention`` keyword overrides, plus
    ``cu_seqlens``/``balance``/``cp_size`` (their sharding), ``dtype``/``k_dtype``, ``hq``/
    ``hkv``/``d``/``dv``, ``extra_tokens``, ``requires_grad``, ``q="list"``, ``k_tokens``
    and ``cp_group`` in ``"none"``, ``"garbage"``, ``"list"``, ``"pair"``, ``"plain_pair"``,
    ``"world"``, ``"half"`` (this rank's half of a world split in two CP groups),
    ``"half_pair"``; ``k_dim`` (k's head dim), ``thd_tensors`` (3-D q, k, v whatever the
    format), ``bshd_local`` (the local sequence length of bshd tensors)."""
    expect: type[Exception] | None
    """The class every rank must raise (None: every rank must succeed)."""
    names: str = ""
    """Text the message must contain: the argument's name."""
    ranks: tuple[int, ...] | None = None
    """Faulty ranks (negative counts from the end); None: every rank."""
    base: dict = field(default_factory=dict)
    """Changes every rank makes (the valid call the fault departs from)."""
    on_call: int = 0
    """0: the fault is in the first call; 1: a valid first call (plan cached), then the fault."""

    def faulty(self, rank: int, world: int) -> bool:
        return self.ranks is None or rank in {r % world for r in self.ranks}


def _groups(world: int, kind: str, rank: int):
    """Process groups every rank creates in the same order (new_group is collective)."""
    pair = cp_group_for(AttnCase(seqlens=(), comm_type="a2a+p2p", a2a_size=2), world)
    halves = _halves(world)
    if kind == "world":
        return dist.group.WORLD
    if kind == "pair":
        return pair
    if kind == "plain_pair":
        return [pair[0], pair[1]]
    if kind == "half":
        return halves[rank // (world // 2)].cp_group
    if kind == "half_pair":
        return halves[rank // (world // 2)]
    if kind == "list":
        return [dist.group.WORLD]
    if kind == "none":
        return None
    return "not a process group"


_HALVES: dict[int, list] = {}


def _halves(world: int) -> list:
    """The world cut into two CP groups of world/2 ranks (data parallel 2), each with its
    hierarchical pair (a2a size 2 when possible)."""
    if world not in _HALVES:
        half = world // 2
        out = []
        for g in range(2):
            ranks = list(range(g * half, (g + 1) * half))
            try:
                out.append(mcx.hierarchical_cp_groups(min(2, half), ranks))
            except ValueError:  # not a member: the collective part is done, keep a placeholder
                out.append(None)
        _HALVES[world] = out
    return _HALVES[world]


def _tensors(ch: dict, fmt: str, cp: int, rank: int, sharding) -> list:
    hq, hkv, d, dv = ch.get("hq", 4), ch.get("hkv", 2), ch.get("d", 8), ch.get("dv", 8)
    heads = ((hq, d), (hkv, ch.get("k_dim", d)), (hkv, dv))
    dtype = getattr(torch, ch.get("dtype", "float32"))
    g = torch.Generator().manual_seed(0)
    if fmt == "thd":
        t = sharding.total_tokens if sharding is not None else sum(BASE_SEQLENS)
        full = [torch.randn(t, h, e, generator=g) for h, e in heads]
        local = [sharding.shard(x, rank) if sharding is not None else x for x in full]
    elif "bshd_local" in ch:  # [b, s_local, h, d] chosen directly (e.g. s not divisible by 2cp)
        local = [torch.randn(_BSHD[0], ch["bshd_local"], h, e, generator=g) for h, e in heads]
    else:
        b, s = _BSHD
        full = [torch.randn(b, s, h, e, generator=g) for h, e in heads]
        local = [torch.cat([c[rank], c[2 * cp - 1 - rank]], 1) for c in (x.chunk(2 * cp, 1) for x in full)]
        if fmt == "sbhd":
            local = [x.transpose(0, 1).contiguous() for x in local]
    local = [x.to(dtype) for x in local]
    if "k_dtype" in ch:
        local[1] = local[1].to(getattr(torch, ch["k_dtype"]))
    if ch.get("extra_tokens"):
        local = [torch.cat([x, x[:1].expand(ch["extra_tokens"], *x.shape[1:])]) for x in local]
    if "k_tokens" in ch:
        local[1] = local[1][: ch["k_tokens"]]
    local = [x.to(ch.get("device", "cpu")) for x in local]
    if ch.get("requires_grad", True):
        local = [x.requires_grad_() for x in local]
    if ch.get("q") == "list":
        local[0] = local[0].tolist()
    return local


_KWARGS = ("comm_type", "qkv_format", "causal", "window_size", "chunk_size", "softmax_scale", "backend", "check")
_KWARGS += ("return_max_logit",)


def _call(rank: int, world: int, ch: dict, sharding_cache: dict):
    fmt = ch.get("qkv_format", "thd")
    cu = ch.get("cu_seqlens", [0, *torch.tensor(BASE_SEQLENS).cumsum(0).tolist()])
    key = (tuple(cu) if isinstance(cu, list) else id(cu), ch.get("cp_size", world), ch.get("balance", "dualchunk"))
    if key not in sharding_cache:  # one sharding per micro-batch, reused by the second call
        sharding_cache[key] = mcx.shard_sequences(cu, key[1], key[2])
    sharding = ch.get("sharding", sharding_cache[key] if fmt == "thd" else None)
    comm = ch.get("comm_type", "p2p")
    cp_rank = rank % (world // 2) if ch.get("cp_group") in ("half", "half_pair") else rank
    if ch.get("thd_tensors"):  # 3-D tensors whatever the format says
        q, k, v = _tensors(ch, "thd", world, cp_rank, sharding_cache[key])
    else:
        q, k, v = _tensors(ch, fmt, world, cp_rank, sharding if fmt == "thd" else None)
    group = _groups(world, ch.get("cp_group", "pair" if comm == "a2a+p2p" else "world"), rank)
    kw = {n: ch[n] for n in _KWARGS if n in ch}
    if "sink" in ch:  # a softmax offset: a shape, or anything else passed as is
        sink = ch["sink"]
        kw["softmax_offset"] = (
            torch.zeros(sink, device=ch.get("device", "cpu"), requires_grad=True) if isinstance(sink, tuple) else sink
        )
    out = mcx.cp_attention(q, k, v, cp_group=group, sharding=sharding, **kw)
    if isinstance(out, tuple):  # return_max_logit
        out = out[0]
    if out.requires_grad:
        out.float().sum().backward()
    return out


def attempt(rank: int, world: int, fault: Fault) -> dict:
    """Run the fault's call(s) on this rank; report the exception (or success)."""
    _groups(world, "world", rank)  # create the shared groups on every rank, faulty or not
    _halves(world)
    shardings: dict = {}
    base = dict(fault.base)
    mine = base | (fault.change if fault.faulty(rank, world) else {})
    try:
        if fault.on_call:
            _call(rank, world, base, shardings)
        _call(rank, world, mine, shardings)
    except Exception as e:  # noqa: BLE001 - reported to the driver
        ok = fault.expect is not None and isinstance(e, fault.expect)
        return {"type": type(e).__name__, "msg": str(e), "expected_type": ok}
    return {"type": None, "msg": "", "expected_type": fault.expect is None}

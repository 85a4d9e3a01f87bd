"""``cp_attention``: validate, look up (or build once) the plan, dispatch, autograd.

Everything that can be wrong is checked here before any collective runs. What every rank
sees (arguments, shapes, group size) raises locally. What only one rank may see (its token
count, dtype, its copy of ``cu_seqlens``) is compared across ranks by one small exchange when
a plan is first built for a micro-batch, so every rank raises the same error instead of
hanging in a collective. Once built, the plan lives on the sharding and is reused by every
layer and by the backward: the hot path does no host work beyond a dict lookup.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.distributed as dist

from .backends import get_backend
from .comm import exchange_ints
from .masks import MaskSpec
from .schedules import SCHEDULES, a2a
from .schedules.common import Run
from .schedules.p2p import RingPlan
from .sharding import CPSharding, shard_sequences

__all__ = ["cp_attention", "COMM_TYPES", "QKV_FORMATS"]

COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")
QKV_FORMATS = ("thd", "bshd", "sbhd")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class _CPAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, run: Run, schedule: ModuleType):
        out, lse = schedule.forward(run, q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.run, ctx.schedule = run, schedule
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.schedule.backward(ctx.run, dout.contiguous(), q, k, v, out, lse)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


@dataclass(frozen=True)
class _Shapes:
    tokens: int
    hq: int
    hkv: int
    dqk: int
    dv: int
    dtype: torch.dtype


def _check_tensors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> _Shapes:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 3:
            raise ValueError(f"{name} must be [tokens, heads, head_dim], got shape {tuple(x.shape)}")
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one of {_DTYPES}; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")
    if k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0]:
        raise ValueError(f"q, k, v token counts differ: {q.shape[0]}, {k.shape[0]}, {v.shape[0]}")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"k and v head counts differ: {k.shape[1]} vs {v.shape[1]}")
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"q and k head dims differ: {q.shape[2]} vs {k.shape[2]}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"num_heads of q ({q.shape[1]}) must be a multiple of k/v heads ({k.shape[1]})")
    return _Shapes(q.shape[0], q.shape[1], k.shape[1], q.shape[2], v.shape[2], q.dtype)


@dataclass(frozen=True)
class _Groups:
    """The CP process groups of one call, normalised over comm types."""

    a2a: object
    """All-to-all group (None: no all-to-all)."""
    p2p: object
    """Ring / all-gather group (None: single participant)."""
    a2a_size: int
    size: int
    """Total CP size (a2a size x p2p size)."""
    rank: int
    """CP rank = p2p rank * a2a size + a2a rank (Megatron's hierarchical layout)."""


def _one_group(g) -> tuple[object, int, int]:
    if g is None:
        return None, 1, 0
    if not isinstance(g, dist.ProcessGroup):
        raise ValueError(f"cp_group entries must be ProcessGroups or None, got {type(g).__name__}")
    n = dist.get_world_size(g)
    return (g if n > 1 else None), n, dist.get_rank(g)


def _groups(cp_group, comm_type: str) -> _Groups:
    if cp_group is None:  # CP size 1 for every comm type: local attention
        return _Groups(None, None, 1, 1, 0)
    if comm_type == "a2a+p2p":
        if not isinstance(cp_group, (list, tuple)) or len(cp_group) != 2:
            raise ValueError(
                "cp_group must be [a2a_group, p2p_group] for comm_type='a2a+p2p' (see "
                f"megatron_cp_ext.hierarchical_cp_groups), got {cp_group!r}"
            )
        a2a, na, ra = _one_group(cp_group[0])
        ring, np_, rp = _one_group(cp_group[1])
        return _Groups(a2a, ring, na, na * np_, rp * na + ra)
    if isinstance(cp_group, (list, tuple)):
        raise ValueError(f"cp_group must be one ProcessGroup for comm_type={comm_type!r}, got a sequence")
    g, n, r = _one_group(cp_group)
    if comm_type == "a2a":
        return _Groups(g, None, n, n, r)
    return _Groups(None, g, 1, n, r)


def _signature(sharding: CPSharding, shapes: _Shapes, comm_type: str, mask: MaskSpec, rank: int) -> list[int]:
    cu_crc = zlib.crc32(",".join(map(str, sharding.cu_seqlens)).encode())
    seg_crc = zlib.crc32(repr(sharding.segments).encode())
    return [
        rank, shapes.tokens, sharding.num_tokens(rank), cu_crc, seg_crc, COMM_TYPES.index(comm_type),
        int(mask.causal), mask.left, mask.right, mask.chunk or 0, _DTYPES.index(shapes.dtype),
        shapes.hq, shapes.hkv, shapes.dqk, shapes.dv,
    ]  # fmt: skip


_SIG_NAMES = ("", "", "", "cu_seqlens", "the sharding", "comm_type", "causal", "window_size", "window_size",
              "chunk_size", "dtype", "q heads", "k/v heads", "qk head_dim", "v head_dim")  # fmt: skip


def _check_consistency(sigs: list[list[int]]) -> None:
    """Raise the same error on every rank when any rank's view disagrees."""
    for sig in sigs:
        if sig[1] != sig[2]:
            raise ValueError(
                f"q on CP rank {sig[0]} has {sig[1]} tokens but the sharding gives that rank {sig[2]} "
                "(shard inputs with sharding.shard(x, rank))"
            )
    for i, name in enumerate(_SIG_NAMES):
        if name and len({s[i] for s in sigs}) > 1:
            raise ValueError(f"{name} differs across CP ranks: {[s[i] for s in sigs]}")


def _agree(sig: list[int], groups: _Groups, device: torch.device) -> None:
    """Compare every rank's view in one exchange per group; all ranks raise together.

    With two groups (a2a+p2p) the second exchange also carries whether the first one failed,
    so a bad input seen inside one a2a group reaches every rank of the CP group.
    """
    if groups.a2a is None and groups.p2p is None:
        _check_consistency([sig])
        return
    err: ValueError | None = None
    for g in (x for x in (groups.a2a, groups.p2p) if x is not None):
        sigs = exchange_ints(sig + [int(err is not None)], g, device)
        if err is None:
            try:
                _check_consistency([x[:-1] for x in sigs])
            except ValueError as e:
                err = e
        if err is None and any(x[-1] for x in sigs):
            err = ValueError("another CP rank rejected its input (see its error); no attention was run")
    if err is not None:
        raise err


def _build_plan(sharding: CPSharding, groups: _Groups, comm_type: str, mask: MaskSpec):
    if groups.a2a is None and groups.p2p is None:
        comm_type = "all_gather"  # a single rank: local attention, no communication
    if comm_type in ("a2a", "a2a+p2p"):
        return a2a.build_plan(sharding, groups.a2a_size, groups.rank, mask)
    segs = list(sharding.segments)
    return SCHEDULES[comm_type].build_plan(segs, segs, groups.rank, mask)


def _get_plan(q, sharding, shapes, groups: _Groups, comm_type, mask):
    """The cached plan for this micro-batch, built (with the consistency exchange) on first use."""
    key = (comm_type, mask, id(groups.a2a), id(groups.p2p), groups.rank)
    plan = sharding._plans.get(key)
    if plan is not None:
        if shapes.tokens != sharding.num_tokens(groups.rank):
            raise ValueError(
                f"q has {shapes.tokens} tokens but the sharding gives CP rank {groups.rank} "
                f"{sharding.num_tokens(groups.rank)}"
            )
        return plan
    _agree(_signature(sharding, shapes, comm_type, mask, groups.rank), groups, q.device)
    plan = sharding._plans[key] = _build_plan(sharding, groups, comm_type, mask)
    return plan


_SEQ_SHARDINGS: dict[tuple[int, int, int], CPSharding] = {}


def _fixed_length_sharding(b: int, s_local: int, cp: int, qkv_format: str) -> CPSharding:
    """The dual-chunk sharding Megatron uses for bshd/sbhd (cached: it never changes)."""
    s = s_local * cp
    if cp > 1 and s % (2 * cp):
        raise ValueError(
            f"{qkv_format} needs the global sequence length ({s_local} local x cp {cp} = {s}) "
            f"divisible by 2*cp = {2 * cp}"
        )
    key = (b, s, cp)
    if key not in _SEQ_SHARDINGS:
        _SEQ_SHARDINGS[key] = shard_sequences([i * s for i in range(b + 1)], cp)
    return _SEQ_SHARDINGS[key]


def cp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    cp_group: dist.ProcessGroup | Sequence[dist.ProcessGroup] | None,
    comm_type: str = "p2p",
    qkv_format: str = "thd",
    sharding: CPSharding | None = None,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    chunk_size: int | None = None,
    softmax_scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Context-parallel attention over this rank's shard of packed sequences.

    Args:
        q, k, v: this rank's tokens. ``thd``: ``[t, hq, d]``, ``[t, hkv, d]``, ``[t, hkv, dv]``
            with ``hq % hkv == 0`` (GQA/MQA) and any ``dv`` (MLA). ``bshd``: ``[b, s/cp, h, d]``;
            ``sbhd``: ``[s/cp, b, h, d]`` (Megatron's dual-chunk split, ``s % 2cp == 0``).
        cp_group: the CP process group (``None`` for a single rank); for ``a2a+p2p`` the pair
            ``[a2a_group, p2p_group]``.
        comm_type: ``p2p`` (KV ring) | ``all_gather`` | ``a2a`` | ``a2a+p2p``.
        sharding: from :func:`shard_sequences`, required for ``thd``; reuse one per micro-batch.
        causal, window_size, chunk_size: mask on positions inside each sequence (design §1):
            q sees k iff causal ⇒ k ≤ q; left ≥ 0 ⇒ k ≥ q − left; right ≥ 0 and not causal
            ⇒ k ≤ q + right; chunk ⇒ q // chunk == k // chunk. Queries that see no key get 0.
        softmax_scale: default ``1/sqrt(d)``.
        backend: local kernels: ``auto`` | ``reference`` | ``flash``.

    Returns:
        ``[t, hq, dv]`` (or the bshd/sbhd equivalent), differentiable w.r.t. q, k, v.
    """
    if comm_type not in COMM_TYPES:
        raise ValueError(f"comm_type must be one of {COMM_TYPES}, got {comm_type!r}")
    if qkv_format not in QKV_FORMATS:
        raise ValueError(f"qkv_format must be one of {QKV_FORMATS}, got {qkv_format!r}")
    if qkv_format != "thd":
        return _seq_format_attention(q, k, v, locals())
    if not isinstance(sharding, CPSharding):
        raise ValueError("sharding (from shard_sequences) is required for qkv_format='thd'")
    shapes = _check_tensors(q, k, v)
    mask = MaskSpec.make(causal=causal, window_size=window_size, chunk_size=chunk_size)
    groups = _groups(cp_group, comm_type)
    if groups.size != sharding.cp_size:
        raise ValueError(f"cp_group has {groups.size} ranks but sharding.cp_size is {sharding.cp_size}")
    plan = _get_plan(q, sharding, shapes, groups, comm_type, mask)
    run = Run(
        plan=plan,
        group=groups.p2p,
        backend=get_backend(q.device, backend),
        scale=softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(shapes.dqk),
        dk=shapes.dqk,
    )
    if isinstance(plan, a2a.A2APlan):
        rep = a2a.kv_replication(shapes.hq, shapes.hkv, groups.a2a_size)
        return a2a.attention(q, k, v, run, groups.a2a, groups.p2p, rep)
    schedule = SCHEDULES["p2p"] if isinstance(plan, RingPlan) else SCHEDULES["all_gather"]
    return _CPAttention.apply(q, k, v, run, schedule)


def _seq_format_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, args: dict) -> torch.Tensor:
    """bshd/sbhd: the batch is b sequences of equal length; run it as thd."""
    fmt = args["qkv_format"]
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 4:
            raise ValueError(f"{name} must be 4-D for qkv_format={fmt!r}, got shape {tuple(x.shape)}")
    if fmt == "sbhd":
        q, k, v = (x.transpose(0, 1) for x in (q, k, v))
    if k.shape[:2] != q.shape[:2] or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"q, k, v batch/sequence dims differ: {q.shape[:2]}, {k.shape[:2]}, {v.shape[:2]}")
    b, s_local = q.shape[:2]
    sharding = _fixed_length_sharding(b, s_local, _groups(args["cp_group"], args["comm_type"]).size, fmt)
    thd = [x.reshape(b * s_local, *x.shape[2:]) for x in (q, k, v)]
    kw = {
        n: args[n] for n in ("cp_group", "comm_type", "causal", "window_size", "chunk_size", "softmax_scale", "backend")
    }
    out = cp_attention(*thd, qkv_format="thd", sharding=sharding, **kw).view(b, s_local, *q.shape[2:3], -1)
    return out.transpose(0, 1).contiguous() if fmt == "sbhd" else out

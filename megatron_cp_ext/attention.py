"""``cp_attention``: validate, agree across ranks, look up (or build once) the plan, dispatch.

Every argument is checked here (:mod:`.validation`) before any collective runs. What only one
rank can see (token count, dtype, heads, scale, sharding, whether it runs a backward, ...) goes
into a signature all CP ranks compare in one small exchange (:mod:`.agreement`) when a rank's
signature is new (a micro-batch's first call) or, with ``check=True``, on every call; any
disagreement or argument error is raised as the same error on every rank, never a hang in a
collective. Plans live on the sharding, reused by every layer and the backward: the hot path
does no host work beyond validating, building the signature and two lookups (tens of µs).
"""

from __future__ import annotations

import math
import weakref
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.distributed as dist

from . import schedules
from .backends import BACKENDS, get_backend
from .backends import backend_name as resolved_name
from .masks import MaskSpec
from .runtime import agreement as agr
from .runtime.autocast import autocast_off
from .runtime.groups import CPGroups, GroupInfo, checked_rank, cp_groups, ranks_crc
from .runtime.validation import (
    DTYPES,
    CPArgumentError,
    CPArgumentTypeError,
    QKVShapes,
    as_bool,
    as_choice,
    as_chunk,
    as_scale,
    as_window,
    check_backend_dtype,
    check_offset,
    check_qkv,
)
from .schedules import a2a, build_plan, prepare_plan, schedule_of
from .schedules.common import Run, apply_sink, sink_grad
from .schedules.delta import row_dot
from .schedules.first_order import first_order
from .schedules.max_logit import new_max_logit, reduce_max_logit
from .sharding import CPSharding
from .sharding.seq_layout import check_data_split, fixed_length_sharding, rows_to_thd, seq_to_thd, thd_to_seq

__all__ = ["cp_attention", "COMM_TYPES", "QKV_FORMATS"]

COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")
QKV_FORMATS = ("thd", "bshd", "sbhd")
_SIG_STATE: weakref.WeakKeyDictionary[CPSharding, dict] = weakref.WeakKeyDictionary()
"""Per sharding (micro-batch): its fingerprint and the signatures all ranks agreed on."""


class _CPAttention(torch.autograd.Function):
    """One attention call: the schedule's forward/backward, the sink at the final merge, and
    one rounding to the input dtype. Backward runs on the final ``out``/``lse`` (sink included),
    so every partial gradient uses the true probabilities."""

    @staticmethod
    def forward(ctx, q, k, v, offset: torch.Tensor | None, run: Run, schedule: ModuleType):
        out, lse = schedule.forward(run, q, k, v)  # accumulator dtype
        if offset is not None:
            out, lse = apply_sink(out, lse, offset)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, offset)
        ctx.run, ctx.schedule = run, schedule
        return out

    @staticmethod
    @first_order  # create_graph=True gives gradients whose second derivative raises
    @autocast_off
    def backward(ctx, dout: torch.Tensor):
        q, k, v, out, lse, offset = ctx.saved_tensors
        dout = dout.contiguous()
        dq, dk, dv = ctx.schedule.backward(ctx.run, dout, q, k, v, out, lse)
        d_off = sink_grad(row_dot(dout, out), lse, offset).to(offset.dtype) if ctx.needs_input_grad[3] else None
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), d_off, None, None


@dataclass
class _Known:
    """What validation established before it failed: enough to find the group to report on."""

    groups: CPGroups | None = None
    cp_size: int | None = None
    cp_rank: int = -1


@dataclass
class _Call:
    """One validated call in thd form."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    shapes: QKVShapes
    groups: CPGroups
    comm_type: str
    fmt: str
    seq_dims: tuple[int, int] | None
    """``(b, s_local)`` for bshd/sbhd, None for thd."""
    sharding: CPSharding
    mask: MaskSpec
    scale: float
    backend: ModuleType | object
    """Local kernels (:func:`.backends.get_backend`: a module, or a per-call picker)."""
    check: bool
    grad: bool
    heads: tuple | None
    """a2a head shards (:func:`.schedules.heads.split_heads`), None for other comm types."""
    offset: torch.Tensor | None
    """Softmax offset (attention sink) per query head, or None."""
    max_logit: bool = False
    """``return_max_logit``: also run the max-logit all-reduce (must agree across ranks)."""
    auto: bool = False
    """``comm_type="auto"`` was asked for (``comm_type`` is its choice)."""


def _prepare(q, k, v, a: dict, known: _Known) -> _Call:
    """Validate every argument (no communication); raises CPArgumentError/CPArgumentTypeError."""
    check = as_bool(a["check"], "check")
    fmt = as_choice(a["qkv_format"], "qkv_format", QKV_FORMATS)
    auto = isinstance(a["comm_type"], str) and a["comm_type"] == "auto"
    comm_type = "auto" if auto else as_choice(a["comm_type"], "comm_type", (*COMM_TYPES, "auto"))
    sharding = a["sharding"]
    if fmt == "thd":
        if not isinstance(sharding, CPSharding):
            raise CPArgumentTypeError(
                f"sharding (from shard_sequences) is required for qkv_format='thd', got {type(sharding).__name__}"
            )
        known.cp_size = sharding.cp_size
    elif sharding is not None:
        raise CPArgumentError(
            f"sharding is for qkv_format='thd' only; {fmt} uses Megatron's fixed split (pass sharding=None)"
        )
    if auto:  # group structure only: the pair means a2a+p2p is a candidate
        comm_type = "a2a+p2p" if isinstance(a["cp_group"], (list, tuple)) else "p2p"
    groups = known.groups = cp_groups(a["cp_group"], comm_type)
    known.cp_rank = groups.rank
    checked_rank(groups)  # a pair's CP rank is its whole group's
    causal, window = as_bool(a["causal"], "causal"), as_window(a["window_size"])
    mask = MaskSpec.make(causal=causal, window_size=window, chunk_size=as_chunk(a["chunk_size"]))
    scale = as_scale(a["softmax_scale"])
    backend_name = as_choice(a["backend"], "backend", BACKENDS)
    seq_dims = None
    if fmt != "thd":
        q, k, v, seq_dims = seq_to_thd(q, k, v, fmt)
        sharding = fixed_length_sharding(*seq_dims, groups.size, fmt)
        q, k, v = (rows_to_thd(x, groups.size) for x in (q, k, v))
    shapes = check_qkv(q, k, v)
    if schedules.P2P_SCHEDULE not in ("staged", "ring"):
        raise CPArgumentError(f"MEGATRON_CP_EXT_P2P_SCHEDULE must be staged or ring, got {schedules.P2P_SCHEDULE!r}")
    if shapes.device.type == "meta" and groups.size > 1:
        raise CPArgumentError("q, k, v are on the meta device: shape-only runs are for CP 1 (CP moves data)")
    if scale is not None and shapes.dtype != torch.float64 and scale > torch.finfo(torch.float32).max:
        raise CPArgumentError(f"softmax_scale={scale!r} is inf in float32, the kernels' scale for {shapes.dtype}")
    if groups.size != sharding.cp_size:
        raise CPArgumentError(f"cp_group has {groups.size} ranks but sharding.cp_size is {sharding.cp_size}")
    if shapes.tokens != sharding.num_tokens(groups.rank):
        raise CPArgumentError(
            f"q has {shapes.tokens} tokens but the sharding gives CP rank {groups.rank} "
            f"{sharding.num_tokens(groups.rank)} (shard inputs with sharding.shard(x, rank))"
        )
    check_data_split(sharding, fmt, seq_dims, groups.rank)
    backend = get_backend(shapes.device, backend_name)
    check_backend_dtype(resolved_name(backend), shapes.dtype)
    offset = check_offset(a["softmax_offset"], shapes)
    if auto and groups.size > 1:
        comm_type, groups = _auto(a["cp_group"], groups, sharding, mask, shapes)
        known.groups = groups
    use_a2a = comm_type in ("a2a", "a2a+p2p") and groups.size > 1
    heads = a2a.split_heads(shapes.hq, shapes.hkv, groups.a2a_size) if use_a2a else None
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, offset) if x is not None)
    scale = scale if scale is not None else 1.0 / math.sqrt(shapes.dqk)
    return _Call(
        q, k, v, shapes, groups, comm_type, fmt, seq_dims, sharding, mask, scale, backend, check, grad, heads, offset,
        auto=auto,
    )  # fmt: skip


AUTO_CHOOSER: list[Callable[..., tuple[str, CPGroups]] | None] = [None]
"""``comm_type="auto"``'s chooser, ``fn(cp_group, groups, sharding, mask, shapes) -> (comm type,
groups)``. The chooser prices plans through :func:`~megatron_cp_ext.inspect_plan` and the cost
model, which sit above this module; so the runtime does not import them: importing the package
installs :func:`megatron_cp_ext.planner.auto.resolve` here (imports run one way, design §2)."""


def _auto(cp_group, groups: CPGroups, sharding: CPSharding, mask: MaskSpec, shapes) -> tuple[str, CPGroups]:
    """``comm_type="auto"``: the predicted fastest comm type (same on every rank, no comm)."""
    chooser = AUTO_CHOOSER[0]
    if chooser is None:  # unreachable: importing any submodule first runs the package's __init__
        raise RuntimeError("comm_type='auto' needs megatron_cp_ext.planner.auto imported")
    return chooser(cp_group, groups, sharding, mask, shapes)


def _fingerprint(sharding: CPSharding) -> dict:
    state = _SIG_STATE.get(sharding)
    if state is None:  # setdefault: ranks run as threads share one state (else one skips an exchange)
        muted = repr(sorted(sharding.muted)).encode()  # padding that attends nothing changes every call
        state = _SIG_STATE.setdefault(sharding, {
            "cu_crc": zlib.crc32(",".join(map(str, sharding.cu_seqlens)).encode()),
            "total_tokens": sharding.total_tokens,
            "num_seqs": sharding.num_seqs,
            "seg_crc": zlib.crc32(sharding.seg.tobytes() + sharding.rank_ptr.tobytes() + muted),
            "agreed": set(),
        })  # fmt: skip
    return state


def _group_fields(info: GroupInfo | None, global_rank: int) -> tuple[int, int]:
    return (info.name_crc, info.members_crc) if info is not None else (0, ranks_crc([global_rank]))


def _signature(c: _Call, state: dict) -> tuple[int, ...]:
    """Everything of this call that must agree across CP ranks (see ``agreement.FIELDS``)."""
    g, s = c.groups, c.shapes
    global_rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    a2a_name, a2a_members = _group_fields(g.a2a_info, global_rank)
    p2p_name, p2p_members = _group_fields(g.p2p_info, global_rank)
    b, s_local = c.seq_dims or (0, 0)
    return agr.signature(
        error=0, global_rank=global_rank, cp_rank=g.rank, comm_type=COMM_TYPES.index(c.comm_type), cp_size=g.size,
        a2a_size=g.a2a_size, a2a_name=a2a_name, a2a_members=a2a_members, p2p_name=p2p_name, p2p_members=p2p_members,
        qkv_format=QKV_FORMATS.index(c.fmt), check=c.check, batch=b, seq_local=s_local,
        dtype=DTYPES.index(s.dtype), device=agr.device_index(s.device), hq=s.hq, hkv=s.hkv, dqk=s.dqk, dv=s.dv,
        causal=c.mask.causal, left=c.mask.left, right=c.mask.right, chunk=c.mask.chunk or 0,
        scale=agr.float_bits(c.scale), backend=("reference", "flash").index(resolved_name(c.backend)),
        grad=c.grad, sink=agr.sink_field(c.offset, c.check),
        cu_crc=state["cu_crc"], total_tokens=state["total_tokens"], num_seqs=state["num_seqs"],
        seg_crc=state["seg_crc"], tokens=s.tokens, rank_tokens=c.sharding.num_tokens(g.rank), max_logit=c.max_logit,
        auto=c.auto, schedule=("staged", "ring").index(schedules.P2P_SCHEDULE),
    )  # fmt: skip


def _checked(q, k, v, args: dict) -> _Call:
    """The validated call, agreed with the other CP ranks; an argument error (in validation or
    in the signature, which reads the sink in check mode) is raised on every rank."""
    known = _Known()
    try:
        c = _prepare(q, k, v, args, known)
        c.max_logit = as_bool(args["return_max_logit"], "return_max_logit")
        sig = _signature(c, _fingerprint(c.sharding))
    except (ValueError, TypeError, OSError) as err:  # OSError: an unreadable planner profile (auto)
        agr.raise_everywhere(err, known.groups, known.cp_size, known.cp_rank, cp_group=args["cp_group"])
        raise  # unreachable: raise_everywhere always raises
    _agree(c, sig)
    return c


def _agree(c: _Call, sig: tuple) -> None:
    """Exchange the signature when it is new on this rank (or always in check mode)."""
    state = _fingerprint(c.sharding)
    if c.check or sig not in state["agreed"]:
        path = agr.exchange_path(c.groups, c.sharding.cp_size)
        if path is not None:
            agr.agree(sig, path)
        state["agreed"].add(sig)


def _get_plan(c: _Call):
    """The cached plan for this micro-batch (the plan depends on the comm type, groups, mask)."""
    g = c.groups
    key = (c.comm_type, c.mask, id(g.a2a), id(g.p2p), g.rank)
    plan = c.sharding._plans.get(key)
    if plan is None:
        plan = c.sharding._plans[key] = build_plan(c.sharding, c.comm_type, g.rank, g.a2a_size, c.mask)
        prepare_plan(plan, c.q.device)  # index tensors uploaded with the plan, not by layer 1's schedule
    return plan


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
    softmax_offset: torch.Tensor | None = None,
    backend: str = "auto",
    check: bool = False,
    return_max_logit: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Context-parallel attention over this rank's shard of packed sequences.

    Args:
        q, k, v: this rank's tokens. ``thd``: ``[t, hq, d]``, ``[t, hkv, d]``, ``[t, hkv, dv]``
            with ``hq % hkv == 0`` (GQA/MQA) and any ``dv`` (MLA). ``bshd``: ``[b, s/cp, h, d]``;
            ``sbhd``: ``[s/cp, b, h, d]`` (Megatron's dual-chunk split, ``s % 2cp == 0``).
            float32/bfloat16/float16, or float64 (computed in float64 end to end).
        cp_group: the CP process group (``None`` for a single rank); for ``a2a+p2p`` the pair
            ``[a2a_group, p2p_group]`` (from :func:`hierarchical_cp_groups`, which also carries
            the whole CP group the consistency exchange runs on).
        comm_type: ``p2p`` (KV ring) | ``all_gather`` | ``a2a`` | ``a2a+p2p`` | ``auto``: per
            micro-batch, the one the cost model predicts fastest (``docs/planning.md``;
            ``a2a+p2p`` is a candidate when ``cp_group`` is the hierarchical pair).
        sharding: from :func:`shard_sequences`, required for ``thd`` (``None`` otherwise);
            the one that split the data, for every layer of the micro-batch (another split of
            the same batch that this process recorded raises :class:`CPArgumentError`).
        causal, window_size, chunk_size: mask on positions inside each sequence (design §1):
            q sees k iff causal ⇒ k ≤ q; left ≥ 0 ⇒ k ≥ q − left; right ≥ 0 and not causal
            ⇒ k ≤ q + right; chunk ⇒ q // chunk == k // chunk. Queries that see no key get 0.
            ``window_size`` is a pair of ints ≥ -1; ``chunk_size`` None or an int ≥ 1.
        softmax_scale: default ``1/sqrt(d)``; else a positive finite float.
        softmax_offset: attention sink, a tensor ``[num_heads]`` (all query heads, also under a2a)
            on q's device, differentiable: each query's softmax denominator gains
            ``exp(offset[h])``, a logit with no value (Megatron's ``softmax_type``
            "off-by-one" is zeros, "learnable" a parameter). Its gradient is this rank's
            partial; the data-parallel reduction over the CP ranks sums it.
        backend: local kernels: ``auto`` | ``reference`` | ``flash`` (fp16/bf16 on CUDA).
            ``auto`` on CUDA runs each local call on the kernel measured fastest for its
            shape on this device class (``docs/kernels.md``, "Local attention kernels").
        check: compare every call's arguments across CP ranks (one small all-gather and a
            host sync per call), not only the first call of each micro-batch: rank-local
            drift on a cached plan then raises on every rank instead of hanging. Every rank
            must pass the same value. See ``docs/reliability.md``.
        return_max_logit: also return, per query head, the largest scaled logit
            ``softmax_scale * q.k`` over every visible pair of the whole (global) batch —
            ``[hq]`` float32, the same on every CP rank, ``-inf`` for a head that sees nothing;
            the sink does not count (:mod:`.schedules.max_logit`). For QK-clip and logging:
            an exact computation per local call plus one all-reduce(MAX); not differentiable.
            Every rank must pass the same value.

    Returns:
        ``[t, hq, dv]`` (or the bshd/sbhd equivalent), differentiable w.r.t. q, k, v; with
        ``return_max_logit``, the pair ``(out, max_logit)``.

    Raises:
        CPArgumentError (a ValueError; :class:`CPArgumentTypeError` is also a TypeError) for a
        bad argument, before any collective. With several CP ranks the error is raised on
        every rank that exchanges at the same time (always in check mode), as is
        :class:`CPRankMismatchError` when ranks disagree.
    """
    args = dict(
        cp_group=cp_group, comm_type=comm_type, qkv_format=qkv_format, sharding=sharding, causal=causal,
        window_size=window_size, chunk_size=chunk_size, softmax_scale=softmax_scale, softmax_offset=softmax_offset,
        backend=backend, check=check, return_max_logit=return_max_logit,
    )  # fmt: skip
    return _run(q, k, v, args)


@torch.compiler.disable(reason="host side: validation, cross-rank agreement, plan lookup, collectives")
@autocast_off
def _run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, args: dict):
    """Everything behind :func:`cp_attention`, run eagerly under ``torch.compile``.

    The host side reads Python objects that change every micro-batch (the sharding, its numpy
    plan, process groups); traced, it would crash in numpy code or recompile per micro-batch.
    Excluded as one unit, the surrounding model compiles with one graph break per call and
    the same guards for every micro-batch (``docs/compile.md``).
    """
    c = _checked(q, k, v, args)
    plan = _get_plan(c)
    max_logit, heads = _max_logit_accumulator(c, plan) if c.max_logit else (None, None)
    out = _dispatch(c, plan, max_logit)
    if c.seq_dims is not None:
        out = thd_to_seq(out, c.fmt, c.seq_dims, c.sharding.cp_size)
    else:
        # the compiled code after the call then treats the token count as dynamic from the
        # first micro-batch instead of recompiling on the second (a no-op outside compile)
        torch._dynamo.maybe_mark_dynamic(out, 0)
    return (out, reduce_max_logit(max_logit, c.groups, c.shapes.hq, heads)) if c.max_logit else out


def _max_logit_accumulator(c: _Call, plan) -> tuple[torch.Tensor, tuple[int, int] | None]:
    """The running-max accumulator for the heads this rank computes (its a2a share, or all)."""
    heads = c.heads[0][plan.member] if isinstance(plan, a2a.A2APlan) else None
    n = heads[1] - heads[0] if heads is not None else c.shapes.hq
    return new_max_logit(n, c.q.device), heads


def _dispatch(c: _Call, plan, max_logit: torch.Tensor | None = None) -> torch.Tensor:
    run = Run(plan=plan, group=c.groups.p2p, backend=c.backend, scale=c.scale, dk=c.shapes.dqk, max_logit=max_logit)
    if isinstance(plan, a2a.A2APlan):
        return a2a.attention(c.q, c.k, c.v, run, c.groups.a2a, c.groups.p2p, c.heads, c.offset)
    return _CPAttention.apply(c.q, c.k, c.v, c.offset, run, schedule_of(plan))

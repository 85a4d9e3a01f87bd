"""Multi-rank attention cases: run ``cp_attention`` on each rank and check against the dense
fp64 reference over the whole unsharded batch.

``run_case`` is the worker side (it runs on every rank of a pool); ``check_case`` is the
driver side (it unshards the per-rank results and compares them). Every tensor is generated
from a seed on every rank, so no data crosses the pool's queues except results.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

import megatron_cp_ext as mcx

from . import coverage
from .reference import dense_attention

__all__ = ["AttnCase", "run_case", "check_case", "TOLERANCE"]
__all__ += ["local_shard", "global_thd", "zigzag_split", "zigzag_merge"]

# Masks for plan-level checks: causal/no mask, left/bidirectional windows incl. 0 and longer
# than the sequences, chunked (incl. chunk 1) and chunked + window.
PLAN_MASKS = [
    dict(causal=True),
    dict(causal=False),
    dict(causal=True, window_size=(3, -1)),
    dict(causal=True, window_size=(0, -1)),
    dict(causal=False, window_size=(2, 5)),
    dict(causal=False, window_size=(0, 0)),
    dict(causal=False, window_size=(-1, 1)),
    dict(causal=False, window_size=(40, 40)),
    dict(causal=True, chunk_size=4),
    dict(causal=False, chunk_size=3),
    dict(causal=False, chunk_size=1),
    dict(causal=True, window_size=(2, -1), chunk_size=5),
]

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3.5e-2, torch.float16: 5e-3, torch.float64: 1e-10}


@dataclass(frozen=True)
class AttnCase:
    """One configuration of a multi-rank attention test."""

    seqlens: tuple[int, ...]
    comm_type: str = "p2p"
    causal: bool = True
    hq: int = 4
    hkv: int = 4
    d: int = 8
    dv: int = 8
    dtype: str = "float32"
    window_size: tuple[int, int] = (-1, -1)
    chunk_size: int | None = None
    balance: str = "dualchunk"
    segments: tuple | None = None
    """Explicit per-rank segments (a custom sharding) instead of ``balance``."""
    seed: int = 0
    a2a_size: int = 0
    """For ``a2a+p2p``: ranks per a2a group (0: the whole world for ``a2a``)."""
    qkv_format: str = "thd"
    """``bshd``/``sbhd``: ``seqlens`` must be b equal lengths; ranks get Megatron's zigzag split."""
    extra: dict = field(default_factory=dict)
    """More ``cp_attention`` keywords (``softmax_scale``, ``check``, ``backend``)."""
    sink: tuple[float, ...] | None = None
    """Softmax offset per query head (attention sink), passed as a differentiable tensor."""
    device: str = "cpu"
    """Where the ranks compute (``cuda``: all ranks of the in-process runner on one GPU)."""
    p2p_schedule: str = "staged"
    """How ``p2p`` runs: ``staged`` forced (whatever its memory bound says, so every case
    exercises it), ``staged-index`` (also every move of more than one run by index and every step's KV
    packed), ``ring``,
    or ``""`` the package's choice."""

    @property
    def cu_seqlens(self) -> list[int]:
        cu = [0]
        for n in self.seqlens:
            cu.append(cu[-1] + n)
        return cu

    def sharding(self, cp: int) -> mcx.CPSharding:
        if self.segments is not None:
            return mcx.CPSharding.from_segments(self.cu_seqlens, self.segments)
        mask = dict(causal=self.causal, window_size=self.window_size, chunk_size=self.chunk_size)
        return mcx.shard_sequences(torch.tensor(self.cu_seqlens, dtype=torch.int32), cp, self.balance, **mask)

    def inputs(self) -> tuple[torch.Tensor, ...]:
        """Global q, k, v, dout in float64 (cast per case)."""
        g = torch.Generator().manual_seed(self.seed)
        t = self.cu_seqlens[-1]
        q = torch.randn(t, self.hq, self.d, generator=g, dtype=torch.float64)
        k = torch.randn(t, self.hkv, self.d, generator=g, dtype=torch.float64)
        v = torch.randn(t, self.hkv, self.dv, generator=g, dtype=torch.float64)
        dout = torch.randn(t, self.hq, self.dv, generator=g, dtype=torch.float64)
        return q, k, v, dout


_HIER_GROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Per default group (one per worker process, or per rank thread of the in-process runner)."""


def cp_group_for(case: AttnCase, world: int):
    """The world group, or (cached per rank) the hierarchical pair for ``a2a+p2p``."""
    if case.comm_type != "a2a+p2p":
        return dist.group.WORLD
    mine = _HIER_GROUPS.setdefault(dist.group.WORLD, {})
    key = (world, case.a2a_size)
    if key not in mine:  # every rank runs the same cases in order: collective-safe
        mine[key] = mcx.hierarchical_cp_groups(case.a2a_size)
    return mine[key]


def zigzag_split(x: torch.Tensor, rank: int, cp: int, dim: int) -> torch.Tensor:
    """Megatron's bshd/sbhd CP split, written independently of the engine's sharding: the
    sequence dim in 2cp equal chunks, rank r keeps chunks r and 2cp-1-r."""
    chunks = x.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=dim)


def zigzag_merge(xs: list[torch.Tensor], dim: int) -> torch.Tensor:
    """Inverse of :func:`zigzag_split` over all ranks' pieces (in rank order)."""
    cp = len(xs)
    halves = [x.chunk(2, dim=dim) for x in xs]
    return torch.cat([halves[c][0] if c < cp else halves[2 * cp - 1 - c][1] for c in range(2 * cp)], dim=dim)


def _seq_dims(case: AttnCase) -> tuple[int, int]:
    """(b, s) of a bshd/sbhd case: its sequences must all have one length."""
    if len(set(case.seqlens)) != 1:
        raise ValueError(f"{case.qkv_format} cases need equal seqlens, got {case.seqlens}")
    return len(case.seqlens), case.seqlens[0]


def local_shard(
    case: AttnCase, world: int, rank: int, x: torch.Tensor, sharding: mcx.CPSharding | None = None
) -> torch.Tensor:
    """Global THD ``[T, h, d]`` -> what ``rank`` passes to ``cp_attention`` in ``case.qkv_format``."""
    if case.qkv_format == "thd":
        return (sharding or case.sharding(world)).shard(x, rank)
    b, s = _seq_dims(case)
    local = zigzag_split(x.view(b, s, *x.shape[1:]), rank, world, 1)
    return local.transpose(0, 1).contiguous() if case.qkv_format == "sbhd" else local


def global_thd(case: AttnCase, xs: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of :func:`local_shard` over all ranks (in rank order)."""
    if case.qkv_format == "thd":
        return case.sharding(len(xs)).unshard(xs)
    if case.qkv_format == "sbhd":
        xs = [x.transpose(0, 1) for x in xs]
    return zigzag_merge(xs, 1).flatten(0, 1)


_SCHEDULE_LOCK = threading.Lock()
_SCHEDULE_HELD: list = []
"""``[name, holders, saved settings]`` while some thread is inside :func:`p2p_schedule`."""


@contextlib.contextmanager
def p2p_schedule(name: str) -> Iterator[None]:
    """Within the block, plans run ``p2p`` as ``name`` (:attr:`AttnCase.p2p_schedule`). The
    settings are module globals, shared by the in-process runner's rank threads: the first
    thread in sets them, the last one out restores them, so no rank plans under another's
    restored settings; threads asking for different schedules at once are an error."""
    from .. import schedules
    from ..schedules import staged_moves, staged_plan

    if not name:
        yield
        return
    m = staged_moves
    with _SCHEDULE_LOCK:
        if _SCHEDULE_HELD:
            if _SCHEDULE_HELD[0] != name:
                raise RuntimeError(f"p2p_schedule({name!r}) while {_SCHEDULE_HELD[0]!r} is in force")
            _SCHEDULE_HELD[1] += 1
        else:
            before = schedules.P2P_SCHEDULE, staged_plan.MAX_BLOCKS, m.MAX_RUNS, m.MAX_PIECES
            _SCHEDULE_HELD[:] = [name, 1, before]
            schedules.P2P_SCHEDULE = name.split("-")[0]
            staged_plan.MAX_BLOCKS = float("inf")
            if name == "staged-index":  # every move of more than one run by index, every step packed
                m.MAX_RUNS, m.MAX_PIECES = 1, 0
    try:
        yield
    finally:
        with _SCHEDULE_LOCK:
            _SCHEDULE_HELD[1] -= 1
            if not _SCHEDULE_HELD[1]:
                schedules.P2P_SCHEDULE, staged_plan.MAX_BLOCKS, m.MAX_RUNS, m.MAX_PIECES = _SCHEDULE_HELD[2]
                _SCHEDULE_HELD.clear()


def run_case(rank: int, world: int, case: AttnCase) -> dict[str, torch.Tensor]:
    """Worker: shard, run forward + backward on this rank, return local results."""
    dtype = getattr(torch, case.dtype)
    sharding = case.sharding(world) if case.qkv_format == "thd" else None
    q, k, v, dout = (local_shard(case, world, rank, x, sharding).to(case.device, dtype) for x in case.inputs())
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    extra = dict(case.extra)
    if case.sink is not None:
        sink_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        extra["softmax_offset"] = torch.tensor(case.sink, dtype=sink_dtype, device=case.device).requires_grad_()
    with p2p_schedule(case.p2p_schedule):
        out = mcx.cp_attention(
            q, k, v, cp_group=cp_group_for(case, world), comm_type=case.comm_type, qkv_format=case.qkv_format,
            sharding=sharding,
            causal=case.causal, window_size=case.window_size, chunk_size=case.chunk_size, **extra,
        )  # fmt: skip
    out.backward(dout)
    res = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    if case.sink is not None:
        res["doffset"] = extra["softmax_offset"].grad
    return {n: t.cpu() for n, t in res.items()}


def check_case(results: list[dict[str, torch.Tensor]], case: AttnCase) -> dict[str, float]:
    """Driver: unshard and compare against the dense fp64 reference; returns max errors."""
    q, k, v, dout = case.inputs()
    dtype = getattr(torch, case.dtype)
    # the reference sees the same rounded inputs as the ranks did
    q, k, v = (x.to(dtype).double().requires_grad_() for x in (q, k, v))
    offset = None if case.sink is None else torch.tensor(case.sink, dtype=torch.float64, requires_grad=True)
    ref = dense_attention(
        q, k, v, case.cu_seqlens, causal=case.causal, window_size=case.window_size, chunk_size=case.chunk_size,
        softmax_scale=case.extra.get("softmax_scale"), softmax_offset=offset,
    )  # fmt: skip
    ref.backward(dout.to(dtype).double())
    want = {"out": ref, "dq": q.grad, "dk": k.grad, "dv": v.grad}
    errors = {}
    if offset is not None:  # each rank's partial; the sum over ranks is the gradient
        got = torch.stack([r["doffset"] for r in results]).double().sum(0)
        errors["doffset"] = (got - offset.grad).abs().max().item() / max(1.0, offset.grad.abs().max().item())
    for name, w in want.items():
        got = global_thd(case, [r[name] for r in results]).double()
        assert got.shape == w.shape, (name, got.shape, w.shape)
        assert torch.isfinite(got).all(), f"{name} has non-finite values for {asdict(case)}"
        # absolute error, relative to the magnitude once that exceeds 1 (large scales and long
        # documents give gradients well above 1; fp32 rounding is relative)
        errors[name] = (got - w).abs().max().item() / max(1.0, w.abs().max().item()) if got.numel() else 0.0
    tol = TOLERANCE[dtype]
    bad = {n: e for n, e in errors.items() if e > tol}
    assert not bad, f"errors {bad} above {tol} for {case}"
    feats = coverage.features_of(
        causal=case.causal, window_size=case.window_size, chunk_size=case.chunk_size,
        hq=case.hq, hkv=case.hkv, d=case.d, dv=case.dv,
    )  # fmt: skip
    coverage.record(case.comm_type, case.qkv_format, feats)
    return errors

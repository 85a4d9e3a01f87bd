"""Bytes every op outside the attention kernels reads and writes: the CPU proxy of what CP adds
to a layer's memory traffic on a GPU (``benchmarks/traffic.py``, ``tests/L1/test_traffic.py``).

Under :func:`.accounting.flash_stub` the attention kernels are one op each and are left out, as
are collectives and peer ops (their bytes are the plan's traffic, counted in the ideal).
Every other op that launches work is counted by rule, from shapes only, so the counts are
exact and the same on every run:

* written: the bytes of every output (for an in-place or ``out=`` op, the tensor it mutates);
* read: the bytes of every tensor argument, except the destination of ``copy_``, of fills and
  of an ``out=`` op (overwritten, not read), and the source of a gather (``index_select``, ``gather``, indexing
  by a tensor), which reads only as many rows as it writes;
* a scatter (``index_add_``, ``index_copy_``, ``index_put_``) writes, and for an add reads, only
  the rows it is given, not its whole destination;
* a merge of a partial result (``ops.merge_partial``) counts as the one fused kernel the GPU
  runs (``csrc``): the partial and its lse read, the accumulator rows and their lse read and
  written, the index read; the CPU fallback's own ops are not counted; a 16-bit row dot
  (``ops.row_dot16``, a2a's backward) likewise: both operands read, the fp32 result written;
  and a2a's 16-bit stand-in output (``ops.stand_in16``): dout and the row terms read, the
  result written;
* ``launches``: such ops (views, metadata ops and allocations excluded).

The ideal a layer cannot avoid: forward, its q, k, v read and out and lse written; backward,
dout, q, k, v, out and lse read and dq, dk, dv written; both plus the bytes it sends and
receives (the plan's, :func:`megatron_cp_ext.inspect_plan`).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["Traffic", "nbytes", "layer_traffic", "fused_merges"]

_PURE_WRITES = {"copy_", "fill_", "zero_", "normal_", "uniform_", "random_", "copy", "fill"}
_GATHERS = {"index_select", "gather", "index", "embedding", "take"}
_SCATTERS = {"index_add", "index_copy", "index_put", "scatter", "scatter_add"}
_SKIP_NS = {"mcx_testing", "c10d", "_c10d_functional", "c10d_functional"}
_METADATA = {"detach", "lift_fresh", "alias", "empty", "new_empty", "empty_like", "empty_strided",
             "new_empty_strided", "resize_", "set_", "record_stream"}  # fmt: skip
"""Ops that move no data: views' kin and allocations (an allocation launches nothing)."""


def nbytes(t: torch.Tensor) -> int:
    """Bytes of the elements a tensor (view) covers: what an op touching it all moves."""
    return t.numel() * t.element_size()


class Traffic(TorchDispatchMode):
    """Bytes read and written, and launches, of every op dispatched inside the mode but the
    attention kernels and collectives; per op name in ``by_op`` as ``(read, written, count)``."""

    def __init__(self) -> None:
        super().__init__()
        self.read = 0
        self.written = 0
        self.launches = 0
        self.by_op: Counter[str] = Counter()
        self.by_op_bytes: Counter[str] = Counter()
        self.suspended = 0

    def count(self, name: str, read: int, written: int) -> None:
        """Count one launch of ``name`` (an op the mode does not see as one)."""
        self.read += read
        self.written += written
        self.launches += 1
        self.by_op[name] += 1
        self.by_op_bytes[name] += read + written

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.suspended or func.namespace in _SKIP_NS or func.is_view:
            return out
        base = func._schema.name.split("::")[-1]
        if base in _METADATA:
            return out
        mutable = [a.name for a in func._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
        named = dict(zip((a.name for a in func._schema.arguments), args, strict=False)) | kwargs
        dests = [named[n] for n in mutable if isinstance(named.get(n), torch.Tensor)]
        if dests:
            written = sum(nbytes(t) for t in dests)
        else:
            written = sum(nbytes(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        read = 0
        pure = base in _PURE_WRITES or base.rstrip("_") in _PURE_WRITES
        # an ``out=`` argument is only written; an in-place op's ``self`` is read too
        skip = {id(named[n]) for n in mutable if isinstance(named.get(n), torch.Tensor) and (pure or n != "self")}
        if base.rstrip("_") in _SCATTERS:
            src = [t for n, t in named.items() if n not in mutable and isinstance(t, torch.Tensor)]
            written = sum(nbytes(t) for t in src if t.is_floating_point())
            read = sum(nbytes(t) for t in src) + (written if "add" in base else 0)
            self.count(base, read, written)
            return out
        for name, a in named.items():
            for t in tree_flatten(a)[0]:
                if not isinstance(t, torch.Tensor) or id(t) in skip:
                    continue
                if base.rstrip("_") in _GATHERS and name in ("self", "input", "weight"):
                    read += written  # a gather reads as many source rows as it writes
                else:
                    read += nbytes(t)
        self.count(base, read, written)
        return out

    @property
    def moved(self) -> int:
        return self.read + self.written


@contextlib.contextmanager
def fused_merges(tr: Traffic) -> Iterator[None]:
    """Within the block, the schedules' merges, 16-bit row dots and stand-ins (a2a's backward)
    count in ``tr`` as the csrc kernels a GPU runs; their CPU fallbacks' own ops are not
    counted."""
    from ..schedules import common, delta

    plain, plain_dot, plain_stand = common.merge_partial, delta._row_dot16, delta._stand_in16

    def fused(name: str, read: int, written: int, fn, *args, **kw):
        """Count one launch of ``name``, then run ``fn`` (its CPU form) uncounted."""
        tr.count(name, read, written)
        tr.suspended += 1
        try:
            return fn(*args, **kw)
        finally:
            tr.suspended -= 1

    def merge(out, lse, part, part_lse, idx, **kw):
        rows = part.shape[0]
        acc = rows * (out[0].numel() * out.element_size() + lse[0].numel() * lse.element_size()) if rows else 0
        read = nbytes(part) + nbytes(part_lse) + acc + (nbytes(idx) if idx is not None else 0)
        fused("merge_partial", read, acc, plain, out, lse, part, part_lse, idx, **kw)

    def row_dot16(a, b):
        out = a.shape[:-1].numel() * 4  # the fp32 result
        return fused("row_dot", nbytes(a) + nbytes(b), out, delta.row_dot_torch, a, b)

    def stand_in16(dout, dl):
        fits = dl.dtype == torch.float32 and dl.shape == dout.shape[:-1]
        if not (fits and dout.is_contiguous() and dl.is_contiguous()):  # where the kernel would not run
            return None
        return fused("stand_in", nbytes(dout) + nbytes(dl), nbytes(dout), delta.stand_in_torch, dout, dl)

    common.merge_partial, delta._row_dot16, delta._stand_in16 = merge, row_dot16, stand_in16
    try:
        yield
    finally:
        common.merge_partial, delta._row_dot16, delta._stand_in16 = plain, plain_dot, plain_stand


def layer_traffic(rank: int, world: int, comm: str, lens: list[int], shape: tuple[int, int, int], dtype: str,
                  balance: str = "workload", route_floor: int | None = None) -> dict:  # fmt: skip
    """One rank's traffic for one ``cp_attention`` layer (flash-shaped stub kernels; plan built
    and agreed before): per phase, bytes moved by ops outside the kernels, the ideal and launches.
    Runs inside a rank of :func:`.pool.run_on_ranks` (gloo: its collectives run in C++, outside
    the count; the in-process runner's would be counted, on whichever thread joins last).
    a2a's moves go by route (``schedules/route.py``) where a GPU's would, or where their mean
    message carries at least ``route_floor`` bytes. ``comm`` ``p2p:staged`` / ``p2p:ring``
    forces how ``p2p`` runs (:func:`.cases.p2p_schedule`); plain ``p2p`` is the package's choice."""
    from ..schedules import route
    from .cases import p2p_schedule

    comm, _, schedule = comm.partition(":")
    floor, route.CPU_MIN_BYTES = route.CPU_MIN_BYTES, route.MIN_BYTES if route_floor is None else route_floor
    try:
        with p2p_schedule(schedule):
            return _layer(rank, comm, lens, shape, dtype, balance)
    finally:
        route.CPU_MIN_BYTES = floor


def _layer(rank: int, comm: str, lens: list[int], shape: tuple[int, int, int], dtype: str, balance: str) -> dict:
    import torch.distributed as dist

    import megatron_cp_ext as mcx

    from .accounting import flash_stub

    world = dist.get_world_size()
    hq, hkv, d = shape
    a2a = 2 if comm == "a2a+p2p" else None
    group = mcx.hierarchical_cp_groups(a2a) if a2a else dist.group.WORLD
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    sh = mcx.shard_sequences(cu, world, balance=balance)
    t, dt = sh.num_tokens(rank), getattr(torch, dtype)
    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(t, h, d, generator=g).to(dt).requires_grad_() for h in (hq, hkv, hkv))
    dout = torch.randn(t, hq, d, generator=g).to(dt)
    call = dict(cp_group=group, comm_type=comm, sharding=sh)
    rep = mcx.inspect_plan(sh, comm, a2a_size=a2a, num_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=dt)
    r = rep.ranks[rank]
    with flash_stub():
        mcx.cp_attention(q, k, v, **call).backward(dout)  # plan built, agreed
        q.grad = k.grad = v.grad = None
        fwd = Traffic()
        with fwd, fused_merges(fwd):
            out = mcx.cp_attention(q, k, v, **call)
        bwd = Traffic()
        with bwd, fused_merges(bwd):
            out.backward(dout)
    own = sum(nbytes(x) for x in (q, k, v))
    lse = t * hq * 4
    wire = {p: r.bytes_sent[p] + r.bytes_received[p] for p in ("forward", "backward")}
    ideal = {"forward": own + nbytes(out) + lse + wire["forward"],
             "backward": nbytes(dout) + own + nbytes(out) + lse + own + wire["backward"]}  # fmt: skip
    return {
        "fwd": fwd.moved / ideal["forward"], "bwd": bwd.moved / ideal["backward"],
        "fwd_launches": fwd.launches, "bwd_launches": bwd.launches,
        "fwd_bytes": fwd.moved, "bwd_bytes": bwd.moved, "ideal": ideal,
        "top": {"fwd": fwd.by_op_bytes.most_common(6), "bwd": bwd.by_op_bytes.most_common(6)},
    }  # fmt: skip

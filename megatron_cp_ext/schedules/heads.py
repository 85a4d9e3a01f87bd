"""Head shards for ``a2a``: which query and KV heads each member of an a2a group computes, for
any head counts, and the all-to-alls that move tokens-of-all-heads to heads-of-all-tokens.

Ulysses needs every member to hold whole GQA groups: each of its query heads must use one of
the KV heads it holds, at one fixed ratio (the local kernel's contract). With ``A`` members:

* ``hkv >= A``: the KV heads (each with its ``g = hq / hkv`` query heads) are dealt out as
  evenly as possible — ``hkv // A`` or one more per member, no replication;
* ``hkv < A`` (MQA, few KV groups): the members are dealt out over the KV heads as evenly as
  possible, and each KV head's ``g`` query heads are split among its members; every member
  receives the one KV head its query heads use (replicated to those members).

When ``A`` divides the counts this is the classic split. Otherwise shards are uneven (a member
may even hold no head, and then computes nothing): the largest shard sets the time, and
``inspect_plan`` reports it as work imbalance. Members' shards differ in size, so the
all-to-alls move flat buffers with element split sizes rather than equal rows.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from .route import Route, from_group, routed, to_group

__all__ = ["split_heads", "to_heads", "from_heads", "head_room", "heads_into", "a2a_bytes", "assemble"]

Range = tuple[int, int]
Count = int | np.ndarray
"""A count of bytes or rows x heads: one member's, or every rank's as an array."""


def split_heads(hq: int, hkv: int, a: int) -> tuple[tuple[Range, ...], tuple[Range, ...]]:
    """``(q, kv)``: member m computes query heads ``q[m]`` with KV heads ``kv[m]``."""
    g = hq // hkv
    if hkv >= a:
        cuts = [(m * hkv) // a for m in range(a + 1)]
        kv = tuple((cuts[m], cuts[m + 1]) for m in range(a))
        return tuple((x * g, y * g) for x, y in kv), kv
    group = [(m * hkv) // a for m in range(a)]  # the KV head each member serves
    q, kv = [], []
    for m, j in enumerate(group):
        members = [i for i, x in enumerate(group) if x == j]
        i, n = members.index(m), len(members)
        q.append((j * g + (i * g) // n, j * g + ((i + 1) * g) // n))
        kv.append((j, j + 1))
    return tuple(q), tuple(kv)


def acc_bytes(es: int) -> int:
    """Bytes of an accumulator element (dK/dV partials, row terms) for inputs of ``es``-byte
    elements: fp64 for fp64 inputs, else fp32."""
    return 8 if es == 8 else 4


def a2a_bytes(
    out_q: Count, out_kv: Count, in_q: Count, in_kv: Count, d: int, dv: int, es: int, replicated: bool
) -> tuple[Count, Count, Count, Count]:
    """``(forward sent, forward received, backward sent, backward received)`` bytes of one
    member's all-to-alls, from the rows x heads it sends (``out_*``) and receives (``in_*``) of
    query and KV heads (ints, or numpy arrays over ranks). Forward: q and KV out, outputs of
    the others' tokens back. Backward: dout and each row's ``dout . out`` in the accumulator
    dtype out (:mod:`.delta`), dq and dK/dV home; replicated KV heads also move the saved k
    and v to heads again and send dK/dV home in the accumulator dtype. The plan report and the
    ``auto`` estimate both price with this; ``tests/L1/test_a2a_stand_in.py`` holds it to the
    bytes the schedule sends."""
    acc = acc_bytes(es)
    q_w, o_w, kv_w = d * es, dv * es, (d + dv) * es
    d_w, g_w = o_w + acc, (d + dv) * acc if replicated else kv_w
    rep = int(replicated)
    return (
        out_q * q_w + out_kv * kv_w + in_q * o_w,
        in_q * q_w + in_kv * kv_w + out_q * o_w,
        out_q * d_w + in_q * q_w + in_kv * g_w + rep * out_kv * kv_w,
        in_q * d_w + out_q * q_w + out_kv * g_w + rep * in_kv * kv_w,
    )


def _a2a_flat(flat: torch.Tensor, send_sizes: list[int], recv_sizes: list[int], group) -> torch.Tensor:
    """All-to-all of a flat buffer holding per-member pieces of any sizes, back to back;
    returns the flat receive buffer (member after member)."""
    out = flat.new_empty(sum(recv_sizes))
    dist.all_to_all_single(out, flat, recv_sizes, send_sizes, group=group)
    return out


def _pack_heads(x: torch.Tensor, parts: tuple[Range, ...], room: int = 0) -> tuple[torch.Tensor, list[int]]:
    """``x[:, a:b]`` of every member's range, back to back in one flat buffer: one copy (a
    ``cat`` of reshaped strided slices would copy twice). The buffer holds at least ``room``
    elements (the packed pieces are its first ones)."""
    t, width = x.shape[0], int(torch.Size(x.shape[2:]).numel())
    sizes = [t * (b - a) * width for a, b in parts]
    flat = x.new_empty(max(sum(sizes), room))
    strided = _regular(parts, x.shape[1])
    if strided is not None:  # every member's range at the same offset of equal blocks: one copy
        flat[: sum(sizes)].view(len(parts), t, strided.stop - strided.start, *x.shape[2:]).copy_(
            x.view(t, len(parts), x.shape[1] // len(parts), *x.shape[2:])[:, :, strided].transpose(0, 1)
        )
        return flat, sizes
    off = 0
    for (a, b), n in zip(parts, sizes):
        flat[off : off + n].view(t, b - a, *x.shape[2:]).copy_(x[:, a:b])
        off += n
    return flat, sizes


def _regular(parts: tuple[Range, ...], heads: int) -> slice | None:
    """``parts`` as one slice of every member's equal block of ``heads // len(parts)`` heads
    (``parts[m] == (m * P + a, m * P + b)``), or None: then ``[t, heads, *]`` viewed as
    ``[t, members, P, *]`` holds all members' ranges as one strided view (one copy, not one
    per member)."""
    n = len(parts)
    if heads % n:
        return None
    p, (a, b) = heads // n, parts[0]
    if not 0 <= a < b <= p or any(parts[m] != (m * p + a, m * p + b) for m in range(n)):
        return None
    return slice(a, b)


def to_heads(
    x: torch.Tensor | tuple[torch.Tensor, ...],
    parts: tuple[Range, ...],
    counts: list[int],
    me: int,
    group,
    perm: torch.Tensor | None = None,
    exact: bool = True,
    route: Route | None = None,
) -> torch.Tensor:
    """``[t, H, D]`` (own tokens, all heads) -> ``[T_group, h_me, D]`` (every member's tokens of
    this member's heads ``parts[me]``, member after member: a view of the receive buffer).
    A tuple ``x`` (``[t, H, D_i]`` each) moves packed side by side on the last dim.

    ``perm``: the result's rows are ``received[perm]`` instead, gathered into the send buffer
    once the all-to-all has sent it (sized for both), so the move and the reordering hold two
    buffers, not three: the receive buffer is freed on return. ``exact``: only where the send
    buffer is no larger than the result (a tensor saved for backward keeps its own size); else
    the send buffer may be a little larger than the result (members' token counts differ).
    ``route``: the same rows in ``perm``'s order, moved run by run into place (:mod:`.route`:
    no gather, no receive buffer) where :func:`.route.routed` says so."""
    xs = x if isinstance(x, tuple) else (x,)
    if routed(route, group, sum(_row_bytes(t) for t in xs), xs[0].device):
        return to_group(xs, parts, me, group, route)
    if isinstance(x, tuple):
        x = torch.cat(x, dim=-1)
    a0, a1 = parts[me]
    if group is None:
        return x[:, a0:a1] if perm is None else x[:, a0:a1].index_select(0, perm)
    d = x.shape[2:]
    h_me = a1 - a0
    width = h_me * int(torch.Size(d).numel())
    rows = sum(counts)
    flat, sizes = _pack_heads(x, parts, rows * width if perm is not None else 0)
    got = _a2a_flat(flat[: sum(sizes)], sizes, [n * width for n in counts], group).view(rows, h_me, *d)
    if perm is None:
        return got
    if (exact and flat.numel() > rows * width) or torch.compiler.is_compiling():
        # dynamo rejects ``out=`` views: a traced graph lets the compiler place the buffers
        del flat
        return got.index_select(0, perm)
    out = flat[: rows * width].view(rows, h_me, *d)
    torch.index_select(got, 0, perm, out=out)
    return out


def _row_bytes(x: torch.Tensor) -> int:
    """Bytes of one row of ``x`` (all its heads)."""
    return int(torch.Size(x.shape[1:]).numel()) * x.element_size()


def head_room(
    rows: int, h_me: int, tail: torch.Size, t: int, heads: int, like: torch.Tensor, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """A flat buffer (``like``'s device, ``dtype`` or ``like``'s) that holds ``[rows, h_me,
    *tail]`` — what :func:`from_heads` sends — and also fits its ``[t, heads, *tail]`` result:
    the result is then written where the sent rows were, and the move holds two buffers, not
    three."""
    width = int(torch.Size(tail).numel())
    return like.new_empty(max(rows * h_me, t * heads) * width, dtype=dtype or like.dtype)


def from_heads(
    y: torch.Tensor | list[torch.Tensor],
    parts: tuple[Range, ...],
    counts: list[int],
    me: int,
    group,
    t: int,
    heads: int,
    room: list[torch.Tensor] | None = None,
    route: Route | None = None,
) -> torch.Tensor:
    """Inverse of :func:`to_heads`: ``[T_group, h_me, D]`` -> ``[t, heads, D]``. Where members'
    ranges overlap (replicated KV heads), their contributions are summed in ``y``'s dtype.
    ``route``: ``y`` is in group order and moves run by run (:mod:`.route`) where
    :func:`.route.routed` says so; else it is in member order (the caller permuted it).

    ``y`` may be handed over in a one-element list: it is then taken out and freed as soon as
    it is sent, before the result is assembled (an argument stays alive until the call returns).
    ``room``: a one-element list holding the :func:`head_room` buffer ``y`` is a view of (its
    first elements); the result is then written into it once ``y`` is sent.
    """
    first = y[0] if isinstance(y, list) else y
    row = heads * int(torch.Size(first.shape[2:]).numel()) * first.element_size()
    by_route = routed(route, group, row, first.device)
    del first  # no reference beyond the caller's handed-over one: freed once sent
    if by_route:
        ys = y if isinstance(y, list) else [y]
        del y
        bufs, views = from_group(ys, parts, me, group, route, t)
        return assemble(views[0], parts, t, heads, bufs[0].dtype)
    if isinstance(y, list):
        y = y.pop()
    store = room.pop() if room else None
    d = y.shape[2:]
    if group is None:
        out = y.new_zeros((t, heads, *d))
        out[:, parts[me][0] : parts[me][1]] = y
        return out
    # y's member blocks are consecutive rows of one contiguous buffer: sent as is, no copy
    sizes = [t * (b - a) * int(torch.Size(d).numel()) for a, b in parts]
    width = int(torch.Size(y.shape[1:]).numel())
    send = [n * width for n in counts]
    dtype, y = y.dtype, y.contiguous().view(-1)
    flat = _a2a_flat(y, send, sizes, group)
    del y  # the send buffer: freed before the result is allocated (or reused for it)
    got = flat.split(sizes)
    numel = t * heads * int(torch.Size(d).numel())
    fits = store is not None and store.dtype == dtype and store.numel() >= numel
    fits = fits and not torch.compiler.is_compiling()  # no ``out=`` views under dynamo
    out = store[:numel].view(t, heads, *d) if fits else None
    del store
    return assemble([g.view(t, b - a, *d) for g, (a, b) in zip(got, parts)], parts, t, heads, dtype, out)


def assemble(pieces: list, parts: tuple[Range, ...], t: int, heads: int, dtype, out=None) -> torch.Tensor:
    """``[t, heads, D]`` from each member's ``[t, h_j, D]`` piece (``None`` or empty for a
    member without heads): one ``cat``, or a sum where members' ranges overlap. ``out``: the
    buffer to write it into (else new)."""
    first = next(p for p in pieces if p is not None)
    d = first.shape[2:]
    overlap = len({r for a, b in parts for r in range(a, b)}) < sum(b - a for a, b in parts)
    if not overlap:
        pieces = [p for p in pieces if p is not None]
        return torch.cat(pieces, dim=1) if out is None else torch.cat(pieces, dim=1, out=out)
    out = first.new_zeros((t, heads, *d), dtype=dtype) if out is None else out.zero_()
    for p, (a, b) in zip(pieces, parts):
        if p is not None:
            out[:, a:b].add_(p)
    return out


def heads_into(
    y: list[torch.Tensor], parts: tuple[Range, ...], counts: list[int], me: int, group, out, route: Route | None = None
) -> None:
    """:func:`from_heads` of a subset of the heads into ``out`` (``[t, H, D]``, the whole
    result): members' ranges ``parts`` (disjoint) are written where they belong, the other
    heads are left as they are. ``y`` (``[T_group, h_me, D]``, one contiguous buffer) is
    handed over in a one-element list and freed once sent. The a2a backward by head groups
    sends each group's dq home with it. ``route``: as :func:`from_heads`'."""
    if routed(route, group, _row_bytes(out), out.device):
        _, views = from_group(y, parts, me, group, route, out.shape[0])
        for p, (a, b) in zip(views[0], parts):
            if p is not None:
                out[:, a:b].copy_(p)
        return
    y_flat, d, t = y.pop().view(-1), out.shape[2:], out.shape[0]
    width = int(torch.Size(d).numel())
    if group is None:
        a, b = parts[me]
        out[:, a:b].copy_(y_flat.view(t, b - a, *d))
        return
    sizes = [t * (b - a) * width for a, b in parts]
    per_row = y_flat.numel() // max(sum(counts), 1)
    flat = _a2a_flat(y_flat, [n * per_row for n in counts], sizes, group)
    del y_flat
    strided = _regular(parts, out.shape[1])
    if strided is not None:
        view = flat.view(len(parts), t, strided.stop - strided.start, *d).transpose(0, 1)
        out.view(t, len(parts), out.shape[1] // len(parts), *d)[:, :, strided].copy_(view)
        return
    for g, (a, b) in zip(flat.split(sizes), parts):
        out[:, a:b].copy_(g.view(t, b - a, *d))

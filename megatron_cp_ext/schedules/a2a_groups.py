"""``a2a`` and ``a2a+p2p`` backward by head groups: one all-to-all pair per group, 1/G of the
head-layout temporaries alive at a time.

Under the flash contract the backward kernel takes dout and the output in head layout, and
the caller keeps both in token layout meanwhile; with every head at once, the kernel call has
dout moved to heads, the output's stand-in (:mod:`.delta`) and the kernel's dq alive (three
``[t, H, D]`` buffers, 1.2x the ideal in fp32 at 16/4 heads). Split over ``G`` groups of each
member's query heads, each group moves its share of dout and of the rows' ``dout . out`` to
heads, builds its stand-in, runs the kernel for those query
heads with the KV heads they read, and sends its dq home into the (token-layout) dq, so only
1/G of those three is alive. The price: the whole dq is alive from the first group on; and a
KV head whose query heads fall into several groups gets one kernel dK/dV per group, summed
into a head-layout accumulator (fp32 for 16-bit inputs, rounded once, like replicated KV
heads) — one more dK/dV (two for 16-bit) alive at the kernel call. KV heads in
one group each are written once into that accumulator. dK/dV go home in one all-to-all at the
end, as without groups.

``a2a+p2p`` runs its whole ring once per group, over the group's query heads and the KV heads
they read: each group's ring moves only those KV heads (the same bytes in all, G times the
messages), and its received blocks, narrowed rows and dq accumulator are 1/G as large. A KV
head read by two groups would travel twice, so the ring only takes counts whose groups read
disjoint whole KV heads; each group's ring accumulates its KV heads' dK/dV straight into
the head-layout accumulator, in the accumulator dtype until they leave for home.

:func:`choose` picks ``G`` from {1, 2, 4}: valid for the head shards, the modelled peak lower
than without groups, and each group's all-to-all at least :data:`MIN_GROUP_BYTES` per member.
Every input is the same on all members, so they agree without communicating.
"""

from __future__ import annotations

import torch

from .common import KV, acc_dtype, sink_grad
from .delta import row_dot, stand_in
from .heads import Range, heads_into, to_heads
from .route import routed

__all__ = [
    "MIN_GROUP_BYTES", "RING_MIN_GROUP_BYTES", "SHARED_MIN_GAIN", "GROUPS", "group_parts", "valid", "choose",
    "rows_to_heads", "backward",
]  # fmt: skip

MIN_GROUP_BYTES = 1 << 20
"""Smallest dout all-to-all per member and group (bytes) worth splitting for. An all-to-all
pays a fixed cost per call beside its bytes' time, and a MiB crosses NVLink in a few
microseconds: below that, extra collectives cost mostly their fixed part, and the layer's
buffers are too small for the saving (0.1-0.3x the ideal) to matter. A judgement, not a
measured knee (docs/performance.md, "a2a backward by head groups")."""
RING_MIN_GROUP_BYTES = 16 << 20
"""The same floor where each group runs a whole ring (``p2p``, ``a2a+p2p``): a group there
costs a ring's worth of messages, kernel calls and copies (about 2-3x a ring's backward
launches at G = 2), all paid again per step, so only shards whose buffers matter in absolute
terms (a 16 MiB group dout is 4K tokens of 32 heads x 128 in bf16 at G = 2), and whose ring
steps take long enough to hide the extra launches, are split. A judgement, like
:data:`MIN_GROUP_BYTES`, not a measured knee."""
SHARED_MIN_GAIN = 0.25
"""Groups that split a KV head's query heads (its dK/dV partials summed in the accumulator
dtype) are taken only where they lower the modelled peak by at least this share of the
layer's ideal (the member's own q, k, v, out and lse). The sums cost ``G - 1`` reads and
writes of a widened dK/dV and the split ``G`` times the calls and all-to-alls: at 16K tokens,
cp 8, 32/8 heads, bf16, four such groups lowered the peak 2.79 -> 2.70 of the ideal and
raised the traffic around the kernels 1.61 -> 2.73 (docs/performance.md). A judgement from
that measurement, not a measured knee."""
GROUPS: int | None = None
"""Forces the largest valid count in {1, 2, 4} up to this one, regardless of size and of the
modelled peak (tests: small batches); None chooses by :func:`choose`."""

_CANDIDATES = (4, 2)


def group_parts(
    q_parts: tuple[Range, ...], kv_parts: tuple[Range, ...], hq: int, hkv: int, groups: int
) -> list[tuple[tuple[Range, ...], tuple[Range, ...]]] | None:
    """Per group: every member's query heads in it and the KV heads they read, or None when
    ``groups`` does not split every member's query heads into equal runs that each read whole
    KV heads (a multiple of the GQA ratio, aligned) or one KV head (a part of its queries)."""
    g, out = hq // hkv, [([], []) for _ in range(groups)]
    for (q0, q1), (k0, k1) in zip(q_parts, kv_parts):
        n = q1 - q0
        if n % groups:
            return None
        s = n // groups
        for j in range(groups):
            a, b = q0 + j * s, q0 + (j + 1) * s
            if s == 0:
                kv = (k0, k0)
            elif a % g == 0 and b % g == 0:
                kv = (a // g, b // g)
            elif a // g == (b - 1) // g:
                kv = (a // g, a // g + 1)
            else:
                return None
            if s and not k0 <= kv[0] < kv[1] <= k1:
                return None
            out[j][0].append((a, b))
            out[j][1].append(kv)
    return [(tuple(q), tuple(kv)) for q, kv in out]


def valid(heads, hq: int, hkv: int, groups: int, ring: bool) -> bool:
    """Whether ``groups`` head groups are possible (:func:`group_parts`); for a ring, also every
    member's groups reading disjoint KV heads (a shared one would travel the ring twice)."""
    if groups == 1:
        return True
    parts = group_parts(*heads, hq, hkv, groups)
    return parts is not None and not (ring and any(_shared(parts, m) for m in range(len(heads[0]))))


def _shared(parts: list[tuple[tuple[Range, ...], tuple[Range, ...]]], m: int) -> bool:
    """Whether member ``m`` reads one KV head in several groups (its dK/dV are then summed)."""
    kvs = [kv[m] for _, kv in parts if kv[m][1] > kv[m][0]]
    return len(set(kvs)) < len(kvs)


def choose(heads, counts: list[int], hq: int, hkv: int, d: int, dv: int, dtype: torch.dtype, ring: bool = False) -> int:
    """The number of head groups for this a2a backward (the same on every member).

    Modelled at the largest member's shard, in bytes: groups free ``(1 - 1/G)`` of dout moved
    to heads, the output's stand-in and the kernel's dq, and cost the whole token-layout dq (alive
    from the first group) plus, where KV heads are shared by groups, their summed dK/dV
    (acc dtype) beside the kernel's, else 1/G of the kernel's dK/dV. The largest gain wins;
    no gain, or a group whose dout all-to-all is under :data:`MIN_GROUP_BYTES`, keeps one;
    groups summing a shared KV head's partials need :data:`SHARED_MIN_GAIN`.

    ``ring``: for ``a2a+p2p``'s ring, only counts whose groups read disjoint KV heads on every
    member (:func:`valid`); its dq and dK/dV are kept in the accumulator dtype."""
    q_parts, kv_parts = heads
    if GROUPS is not None:
        return next((c for c in (*_CANDIDATES, 1) if c <= GROUPS and valid(heads, hq, hkv, c, ring)), 1)
    widths = [b - a for a, b in q_parts]
    m = widths.index(max(widths))  # not max(key=): dynamo traces this (prepared a2a, dynamic=True)
    rows, nq, nkv = sum(counts), q_parts[m][1] - q_parts[m][0], kv_parts[m][1] - kv_parts[m][0]
    size, wide = dtype.itemsize, 8 if dtype == torch.float64 else 4  # the acc dtype's
    # dout and output in head layout, the kernel's dq (the ring's: its accumulator)
    moved = rows * nq * (2 * dv * size + d * (wide if ring else size))
    home = max(counts) * hq * d * size
    kv_kernel = rows * nkv * (d + dv) * (wide if ring else size)
    ideal = max(counts) * ((hq + hkv) * (d + dv) * size + hq * 4)  # token layout: q, out, k, v, lse
    best, gain = 1, 0.0
    for c in _CANDIDATES:
        parts = group_parts(*heads, hq, hkv, c)
        floor = RING_MIN_GROUP_BYTES if ring else MIN_GROUP_BYTES
        if not valid(heads, hq, hkv, c, ring) or rows * nq * dv * size / c < floor:
            continue
        shared = _shared(parts, m)
        kv_cost = kv_kernel * wide / size if shared else kv_kernel / c
        g = moved * (1 - 1 / c) - home - kv_cost
        if shared and g < SHARED_MIN_GAIN * ideal:
            continue
        if g > gain:
            best, gain = c, g
    return best


def rows_to_heads(
    dout: torch.Tensor,
    delta: torch.Tensor,
    q_parts: tuple[Range, ...],
    counts: list[int],
    me: int,
    group,
    perm: torch.Tensor,
    lse: torch.Tensor,
    offset: torch.Tensor | None,
    d_off: torch.Tensor | None,
    route=None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``dout`` (token layout) and each row's ``dout . out`` (``delta``, ``[t, H, 1]``) moved
    to this member's query heads ``q_parts[me]``: returns ``dout_h`` and the output's stand-in
    (:mod:`.delta`; ``None`` without heads), and writes those heads' sink gradient into
    ``d_off`` (when given) from the moved row terms, whose ``lse`` they share."""
    dout_h = to_heads(dout, q_parts, counts, me, group, perm, exact=False, route=route)
    delta_h = to_heads(delta, q_parts, counts, me, group, perm, exact=False, route=route)[..., 0]
    a, b = q_parts[me]
    if b <= a:
        return dout_h, None
    if d_off is not None:
        d_off[a:b] = sink_grad(delta_h, lse, offset[a:b]).to(offset.dtype)
    return dout_h, stand_in(dout_h, delta_h)


def backward(
    ring, block_backward, plan, group, heads, tensors, offset, want_off: bool, shape, groups: int, wide: bool = False
):
    """dq (token layout), dK and dV (head layout, this member's KV heads: the caller sends them
    home) and the sink gradient, computed group by group. ``tensors``: the saved ``q_h, kv_h,
    lse``, the incoming ``dout`` and the saved output ``y`` (token layout); ``shape``: ``(t,
    hq, hkv)``; ``block_backward(ring, saved, kv)``: one group's backward (the a2a ring of
    one's block, or a2a+p2p's whole ring), ``saved`` the group's ``[dout, q, out, lse]`` in head
    layout handed over; ``wide``: a ring per group (a2a+p2p), dK/dV kept in the accumulator
    dtype and accumulated by each group's ring into its KV heads (``block_backward``'s fourth
    argument, ``(None, KV(dk, dv))``), nothing adopted or copied after."""
    q_h, kv_h, lse, dout, y = tensors
    (q_parts, kv_parts), me, counts, (t, hq, hkv) = heads, plan.member, plan.counts, shape
    perm, inv = plan.perms_on(dout.device)
    by_route = routed(plan.route, group, hq * q_h.shape[-1] * q_h.element_size(), q_h.device)
    parts = group_parts(q_parts, kv_parts, hq, hkv, groups)
    h0, k0 = q_parts[me][0], kv_parts[me][0]
    dtype = acc_dtype(kv_h) if wide or _shared(parts, me) else kv_h.dtype  # summed partials: widened
    dq = dout.new_empty((t, hq, q_h.shape[-1]), dtype=q_h.dtype)
    d_off = torch.zeros_like(offset) if want_off else None
    acc: list[torch.Tensor | None] = [None, None]
    if wide and q_parts[me][1] > h0:  # each ring accumulates its KV heads' dK/dV into theirs (disjoint heads)
        kv = KV.of(kv_h, ring.dk)
        acc = [x.new_empty(x.shape, dtype=dtype) for x in (kv.k, kv.v)]
        del kv
    done = k0  # KV heads below this one have their dK/dV in ``acc``
    delta = row_dot(dout, y).unsqueeze(-1)  # each row's dout . out: moved instead of the output
    del y
    for q_j, kv_j in parts:
        (a, b), (ka, kb) = q_j[me], kv_j[me]
        lse_j = lse[:, a - h0 : b - h0]
        dout_h, out_h = rows_to_heads(dout, delta, q_j, counts, me, group, perm, lse_j, offset, d_off, plan.route)
        if b > a:
            saved = [dout_h, q_h[:, a - h0 : b - h0], out_h, lse_j]  # handed over
            del dout_h, out_h
            into = (None, KV(*(x[:, ka - k0 : kb - k0] for x in acc))) if wide else None
            g_q, g_k, g_v = block_backward(ring, saved, kv_h[:, ka - k0 : kb - k0], *([into] if wide else []))
            del saved, into
        else:
            g_q = q_h.new_zeros((q_h.shape[0], 0, q_h.shape[-1]))
        dout_h = out_h = None
        send = [g_q.to(q_h.dtype) if by_route else g_q.to(q_h.dtype).index_select(0, inv)]
        del g_q
        heads_into(send, q_j, counts, me, group, dq, plan.route)
        if b > a and not wide:
            for i, g_x in enumerate((g_k, g_v)):
                acc[i] = _add(acc[i], g_x, (ka - k0, kb - k0), ka >= done, kv_h.shape[:2], dtype)
            done = max(done, kb)
            del g_k, g_v, g_x  # before the next group's kernel call
    if q_parts[me][1] <= h0:  # a member without heads: empty dK/dV to send
        kv = KV.of(kv_h, ring.dk)
        acc = [torch.zeros_like(kv.k), torch.zeros_like(kv.v)]
    return dq, acc[0], acc[1], d_off


def _add(acc, g: torch.Tensor, heads: Range, fresh: bool, rows_heads: torch.Size, dtype: torch.dtype):
    """``g``, the kernel's dK or dV of local KV heads ``heads``, into the accumulator ``acc``
    (``[rows, heads, D]`` in ``dtype``, made here on first use): adopted when it is the whole
    accumulator in that dtype, else copied into heads no group wrote yet (``fresh``) or added
    to the heads an earlier group wrote."""
    a, b = heads
    if acc is None:
        if (a, b) == (0, rows_heads[1]) and g.dtype == dtype and g.is_contiguous():
            return g
        acc = g.new_empty((*rows_heads, g.shape[-1]), dtype=dtype)
    if fresh:
        acc[:, a:b].copy_(g)
    else:
        acc[:, a:b].add_(g)
    return acc

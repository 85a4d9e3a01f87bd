"""What every schedule shares: running a step's planned calls forward and backward.

A schedule only decides which KV buffer a step sees; computing a step is always the same:
for each planned call, take its query/key rows (a view when contiguous, else a gather), run
the local varlen kernel, and merge (forward) or accumulate (backward) by the call's rows.

Shape legend: ``t`` local tokens, ``H``/``Hk`` query/KV heads, ``D`` qk dim, ``Dv`` v dim;
A step's KV is a :class:`KV`: K and V as two tensors, views of one packed ``[rows, Hk, D + Dv]``
buffer where the schedule has one (a gathered or all-to-all'd KV moves both in one message),
or the layer's own ``k`` and ``v`` (p2p sends them as they are: packing them would be a copy).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import NamedTuple

import torch

from ..plan import VarlenCall
from ..runtime.ops import floor_lse_, gather_rows, index_add_rows, lse_floor, merge_partial

__all__ = [
    "Run",
    "take",
    "accumulate",
    "add_rows",
    "step_forward",
    "step_backward",
    "pack_kv",
    "new_accumulators",
    "acc_dtype",
]
__all__ += ["apply_sink", "sink_grad", "GradAcc", "OutAcc", "KV", "add_rows"]


class KV(NamedTuple):
    """K and V rows of one step (or their gradient accumulators)."""

    k: torch.Tensor
    v: torch.Tensor
    packed: torch.Tensor | None = None
    """The ``[rows, Hk, D + Dv]`` buffer ``k`` and ``v`` view, if any: a gathered call then
    gathers it once for both."""

    @classmethod
    def of(cls, packed: torch.Tensor, dk: int) -> KV:
        return cls(packed[..., :dk], packed[..., dk:], packed)

    def take(self, sl: tuple[int, int] | None, idx: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The call's rows of K and V (one gather for a packed buffer, else one each)."""
        if sl is not None or self.packed is None:
            return take(self.k, sl, idx), take(self.v, sl, idx)
        kv = gather_rows(self.packed, idx)
        dk = self.k.shape[-1]
        return kv[..., :dk], kv[..., dk:]


@dataclass(frozen=True)
class Run:
    """Everything one attention call needs besides the tensors (fixed per plan and layer)."""

    plan: object
    """The schedule's plan for this rank (built once per micro-batch)."""
    group: object
    """Process group(s) the schedule communicates over (None for a single rank)."""
    backend: ModuleType | object
    """Local varlen kernels (``attn_fwd``/``attn_bwd``/``max_logit``): a backend module, or a
    :class:`~..backends.pick.Picker` choosing one per call."""
    scale: float
    """Softmax scale."""
    dk: int
    """Query/key head dim: splits packed KV buffers into K and V."""
    max_logit: torch.Tensor | None = None
    """``[heads of q]`` fp32 running max of the scaled logits over the calls, updated in place;
    None (the default) computes nothing (see :mod:`.max_logit`)."""


def take(x: torch.Tensor, sl: tuple[int, int] | None, idx: torch.Tensor | None) -> torch.Tensor:
    """Rows of ``x`` selected by a call: ``x`` itself when all of them, a slice view when
    contiguous, else a gather."""
    if sl is None:
        return gather_rows(x, idx)
    return x if sl[0] == 0 and sl[1] == x.shape[0] else x[sl[0] : sl[1]]


def accumulate(acc: torch.Tensor, sl: tuple[int, int] | None, idx: torch.Tensor | None, src: torch.Tensor) -> None:
    """``acc[rows] += src`` for a call's rows (rows may repeat across entries of one call): one
    in-place op (``acc[a:b] += src`` would add a ``copy_`` back through ``__setitem__``)."""
    if sl is not None:
        acc[sl[0] : sl[1]].add_(src)
    else:
        index_add_rows(acc, idx, src)


def add_rows(
    acc: torch.Tensor | GradAcc, sl: tuple[int, int] | None, idx: torch.Tensor | None, src: torch.Tensor
) -> None:
    """:func:`accumulate` into a tensor, or into a :class:`GradAcc` (made on first use) or any
    other accumulator with its ``add``."""
    if not isinstance(acc, torch.Tensor):
        acc.add(sl, idx, src)
    else:
        accumulate(acc, sl, idx, src)


class GradAcc:
    """A gradient accumulator made on first use: the first partial that covers every row (the
    own block's call over all local queries, typically) becomes the accumulator instead of
    being added to zeros — one ``[t, H, D]`` buffer fewer alive. A 16-bit partial becomes it
    widened: one op instead of a zero fill and an add, the same values (``0 + x`` is ``x``;
    only a ``-0.0`` stays ``-0.0`` instead of becoming ``+0.0``) and the same memory.

    Partials over row slices are copied (widened) into rows no partial wrote yet and added
    only where one did (the written rows are tracked as a few intervals); the rows nobody
    wrote are zeroed at the end, or before the first indexed add. A stage whose calls cover
    parts of a block then costs one write per row, not a zero fill, a read and a write."""

    def __init__(self, like: torch.Tensor, into: torch.Tensor | None = None, keep: bool = False) -> None:
        self.shape, self.dtype, self.device = like.shape, acc_dtype(like), like.device
        self.t: torch.Tensor | None = None
        self.keep = keep
        """The caller adds one partial only and rounds the result to the input dtype itself (a
        rank's single call): a 16-bit partial over every row is kept as it is, not widened —
        no widened copy and no rounding back (the same values). Should a second partial come
        after all, the kept one is widened first."""
        self._into = into
        """A caller's buffer (``like``'s shape, the accumulator dtype; a head slice of a larger
        accumulator) to accumulate into: the first partial covering every row is copied into it,
        else its rows are written as for a buffer of our own. Nothing is adopted then."""
        self._rows: dict[tuple[int, int], torch.Tensor] = {}
        """Row-slice views of ``t`` by slice: the steps add into the same few slices again."""
        self._written: list[tuple[int, int]] | None = None
        """While ``t`` holds rows no partial wrote: the written rows, sorted disjoint intervals."""

    def add(self, sl: tuple[int, int] | None, idx: torch.Tensor | None, src: torch.Tensor) -> None:
        if self.t is not None and self.t.dtype != self.dtype:  # a kept 16-bit partial gets company
            self.t, self._rows = self.t.to(self.dtype), {}
        whole = sl == (0, self.shape[0]) and src.shape == self.shape
        if self.t is None and self._into is not None:
            self.t, self._into = self._into, None
            if whole:
                self.t.copy_(src)
                return
            self._written = []
        if self.t is None:
            if whole:
                if src.dtype != self.dtype and not self.keep:
                    self.t = src.to(self.dtype, memory_format=torch.contiguous_format)
                    return
                if src.dtype != self.dtype:
                    self.t = src.contiguous()
                    return
                if src.is_contiguous():
                    self.t = src
                    return
            self.t = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            self._written = []
        if sl is None:
            self._fill()
            index_add_rows(self.t, idx, src)
            return
        if self._written is not None:
            self._write(sl, src)
            return
        self._view(sl).add_(src)

    def _view(self, sl: tuple[int, int]) -> torch.Tensor:
        view = self._rows.get(sl)
        if view is None:
            view = self._rows[sl] = self.t[sl[0] : sl[1]]
        return view

    def _write(self, sl: tuple[int, int], src: torch.Tensor) -> None:
        """``src`` into rows ``sl``: copied where no partial wrote yet, added where one did."""
        a, b = sl
        spans, at = [], a
        for w0, w1 in self._written:
            if w1 <= at or w0 >= b:
                continue
            if w0 > at:
                spans.append((at, w0, False))
            spans.append((max(at, w0), min(b, w1), True))
            at = min(b, w1)
        if at < b:
            spans.append((at, b, False))
        if len(spans) == 1:
            view = self._view(sl)
            view.add_(src) if spans[0][2] else view.copy_(src)
        else:
            for s0, s1, seen in spans:
                part, dst = src[s0 - a : s1 - a], self.t[s0:s1]
                dst.add_(part) if seen else dst.copy_(part)
        merged = sorted([*self._written, (a, b)])
        self._written = []
        for w0, w1 in merged:
            if self._written and w0 <= self._written[-1][1]:
                self._written[-1] = (self._written[-1][0], max(self._written[-1][1], w1))
            else:
                self._written.append((w0, w1))

    def _fill(self) -> None:
        """Zero the rows no partial wrote (before an indexed add, or for the result)."""
        if self._written is None:
            return
        at = 0
        for w0, w1 in [*self._written, (self.shape[0], self.shape[0])]:
            if w0 > at:
                self.t[at:w0].zero_()
            at = max(at, w1)
        self._written = None

    def result(self) -> torch.Tensor:
        if self.t is None and self._into is not None:
            self.t, self._into = self._into.zero_(), None
        if self.t is None:
            self.t = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        self._fill()
        self._rows = {}
        return self.t


def pack_kv(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.cat([k, v], dim=-1)


def acc_dtype(x: torch.Tensor) -> torch.dtype:
    """Accumulator dtype for merges and gradient sums: fp32, or fp64 for fp64 inputs (so fp64
    is computed in fp64 end to end and passes ``gradcheck``)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def new_accumulators(q: torch.Tensor, dv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Output (zeros) and lse (:data:`~..ops.LSE_FLOOR`, standing for -inf) accumulators for the
    online-softmax merge (:func:`acc_dtype`). A query that sees no key keeps output 0 and lse
    ``LSE_FLOOR``, which every backward treats like -inf (all its probabilities are 0)."""
    out = q.new_zeros((q.shape[0], q.shape[1], dv), dtype=acc_dtype(q))
    lse = q.new_full((q.shape[0], q.shape[1]), lse_floor(acc_dtype(q)), dtype=acc_dtype(q))
    return out, lse


class OutAcc:
    """Output and lse accumulators made on first merge: a first partial over every query row,
    already in the accumulator dtype, becomes the accumulator (its lse made finite in place)
    instead of being merged into zeros — one ``[t, H, Dv]`` buffer fewer alive at the call
    (a2a's single call, the rings' own whole-query call). A 16-bit partial becomes it widened:
    two fp32 ``[t, H, Dv]`` buffers fewer (the zeros and the merge's widened copy)."""

    def __init__(self, q: torch.Tensor, dv: int, keep: bool = False) -> None:
        self.q, self.dv = q, dv
        self.keep = keep
        """As :class:`GradAcc`'s: one partial only, rounded by the caller, so a 16-bit partial
        over every query row is kept as it is (widened first should a second merge come)."""
        self.out: torch.Tensor | None = None
        self.lse: torch.Tensor | None = None
        self._rows: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        """Row-slice views of ``out`` and ``lse`` by slice (made once per layer)."""

    def merge(self, sl: tuple[int, int] | None, idx: torch.Tensor | None, o: torch.Tensor, lse_c: torch.Tensor) -> None:
        if self.out is None:
            t, dtype = self.q.shape[0], acc_dtype(self.q)
            if sl == (0, t) and lse_c.dtype == dtype and o.is_contiguous():
                # empty rows: a kernel's -inf (or flash's +inf) lse becomes the finite floor the
                # merges and backwards expect; NaN stays NaN. A 16-bit partial is widened: the
                # same bits as merging it into zeros, without the zeros
                self.out = o if o.dtype == dtype or self.keep else o.to(dtype)
                self.lse = floor_lse_(lse_c)
                return
            self.out, self.lse = new_accumulators(self.q, self.dv)
        elif self.out.dtype != self.lse.dtype:  # a kept 16-bit partial gets company
            self.out, self._rows = self.out.to(self.lse.dtype), {}
        if sl is not None:
            views = self._rows.get(sl)
            if views is None:
                views = self._rows[sl] = (self.out[sl[0] : sl[1]], self.lse[sl[0] : sl[1]])
            merge_partial(views[0], views[1], o, lse_c, None, acc_finite=True)
        else:
            merge_partial(self.out, self.lse, o, lse_c, idx, acc_finite=True)

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.out is None:
            self.out, self.lse = new_accumulators(self.q, self.dv)
        self.q, self._rows = None, {}  # the accumulator outlives the call; q is not its business
        return self.out, self.lse


def step_forward(
    calls: list[VarlenCall], run: Run, q: torch.Tensor, kv: KV | list[KV], acc: OutAcc, views: dict | None = None
) -> None:
    """Merge this step's attention of ``q`` over the ``kv`` rows into ``acc``.

    ``kv`` may be handed over in a one-element list: it is then taken out and dropped after
    the step's last kernel call, before that call's merge allocates (a received block).
    ``views``: a dict the caller keeps over a layer's steps, caching the query slices (views,
    no memory) that the steps take again and again."""
    if isinstance(kv, list):
        kv = kv.pop()
    last = calls[-1] if calls else None
    for c in calls:
        k_c, v_c = kv.take(c.k_slice, c.k_index)
        if views is not None and c.q_slice is not None:
            q_c = views.get(c.q_slice)
            if q_c is None:
                q_c = views[c.q_slice] = q[c.q_slice[0] : c.q_slice[1]]
        else:
            q_c = take(q, c.q_slice, c.q_index)
        o, lse_c = run.backend.attn_fwd(
            q_c, k_c, v_c,
            c.cu_seqlens_q, c.cu_seqlens_k, c.max_seqlen_q, c.max_seqlen_k, c.causal, c.window, run.scale,
        )  # fmt: skip
        if run.max_logit is not None:
            m = run.backend.max_logit(
                q_c, k_c, c.cu_seqlens_q, c.cu_seqlens_k, c.max_seqlen_q, c.max_seqlen_k,
                c.causal, c.window, run.scale, c.entries,
            )  # fmt: skip
            torch.maximum(run.max_logit, m, out=run.max_logit)
        del q_c, k_c, v_c  # gathered rows: freed before the merge gathers its own
        if c is last:
            del kv
        acc.merge(c.q_slice, c.q_index, o, lse_c)
        del o, lse_c  # free the partial before the next call allocates its own


def step_backward(
    calls: list[VarlenCall],
    run: Run,
    saved: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    kv: KV,
    dq: GradAcc,
    dkv: KV,
    views: dict | None = None,
    local: list[tuple] | None = None,
) -> None:
    """Accumulate this step's gradients: ``dq`` for local queries, ``dkv`` for the KV rows
    (tensors, or :class:`GradAcc` that a first whole-block kernel output becomes).

    ``saved`` is ``(dout, q, out, lse)`` with the final merged ``out``/``lse``. ``views``: as
    in :func:`step_forward`, for the saved tensors' query slices. ``local``: per call, its
    ``(slice, index)`` rows in ``saved`` when ``saved`` holds only some query rows (a ring's
    narrowed copies); ``dq`` still takes the call's own rows.
    """
    for i, c in enumerate(calls):
        qs, ks = (c.q_slice, c.q_index), (c.k_slice, c.k_index)
        ts = local[i] if local is not None else qs
        k_c, v_c = kv.take(*ks)
        rows = views.get(ts[0]) if views is not None and ts[0] is not None else None
        if rows is None:
            rows = tuple(take(x, *ts) for x in saved)
            if views is not None and ts[0] is not None:
                views[ts[0]] = rows
        dout_c, q_c, out_c, lse_c = rows
        del rows
        g_q, g_k, g_v = run.backend.attn_bwd(
            dout_c, q_c, k_c, v_c, out_c, lse_c,
            c.cu_seqlens_q, c.cu_seqlens_k, c.max_seqlen_q, c.max_seqlen_k, c.causal, c.window, run.scale,
        )  # fmt: skip
        del dout_c, q_c, out_c, lse_c
        dq.add(*qs, g_q)
        del g_q
        del k_c, v_c
        # K and V accumulated separately (halves of a packed buffer or two): no per-call cat
        add_rows(dkv.k, *ks, g_k)
        add_rows(dkv.v, *ks, g_v)
        del g_k, g_v


def apply_sink(out: torch.Tensor, lse: torch.Tensor, offset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Add the attention sink: each query's softmax denominator gains ``exp(offset[h])`` (a
    logit with no value). Merged ``out``/``lse`` (accumulator dtype) -> final ``out``/``lse``;
    a query that sees no key keeps output 0."""
    lse_t = torch.logaddexp(lse, offset.to(lse.dtype)[None, :])
    return out * torch.exp(lse - lse_t).unsqueeze(-1), lse_t


def sink_grad(delta: torch.Tensor, lse: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """d loss / d offset of this rank's queries (the caller's data-parallel reduction sums the
    ranks): the sink's probability times minus each row's ``dout . out`` (``delta``, ``[N, H]``,
    from :func:`.delta.row_dot`; ``a2a`` has it in head layout already)."""
    off = offset.to(lse.dtype)[None, :]
    p = torch.exp(off - lse)  # lse includes the sink; a +inf sink takes every probability (1, not inf - inf)
    p.masked_fill_(torch.isposinf(off) & torch.isposinf(lse), 1.0)
    term = p * delta.to(lse.dtype)
    # Where the sink takes every probability the row's output is 0 (padding, a row that sees no
    # key): a NaN or inf in its dout (0 * NaN in delta) adds nothing, as for its q, k and v.
    return -term.masked_fill_((p == 1) & ~torch.isfinite(term), 0.0).sum(0)

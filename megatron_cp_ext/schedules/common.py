"""What every schedule shares: running a step's planned calls forward and backward.

A schedule only decides which KV buffer a step sees; computing a step is always the same:
for each planned call, take its query/key rows (a view when contiguous, else a gather), run
the local varlen kernel, and merge (forward) or accumulate (backward) by the call's rows.

Shape legend: ``t`` local tokens, ``H``/``Hk`` query/KV heads, ``D`` qk dim, ``Dv`` v dim;
``KV`` buffers pack K and V along the last dim (``[rows, Hk, D + Dv]``) so one message moves both.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from ..ops import LSE_FLOOR, gather_rows, index_add_rows, merge_partial
from ..plan import VarlenCall

__all__ = ["Run", "take", "accumulate", "step_forward", "step_backward", "pack_kv", "new_accumulators", "acc_dtype"]
__all__ += ["apply_sink", "sink_grad", "GradAcc"]


@dataclass(frozen=True)
class Run:
    """Everything one attention call needs besides the tensors (fixed per plan and layer)."""

    plan: object
    """The schedule's plan for this rank (built once per micro-batch)."""
    group: object
    """Process group(s) the schedule communicates over (None for a single rank)."""
    backend: ModuleType
    """Local varlen kernels (``attn_fwd``/``attn_bwd``)."""
    scale: float
    """Softmax scale."""
    dk: int
    """Query/key head dim: splits packed KV buffers into K and V."""
    max_logit: torch.Tensor | None = None
    """``[heads of q]`` fp32 running max of the scaled logits over the calls, updated in place;
    None (the default) computes nothing (see :mod:`.max_logit`)."""


def take(x: torch.Tensor, sl: tuple[int, int] | None, idx: torch.Tensor | None) -> torch.Tensor:
    """Rows of ``x`` selected by a call: a slice view when contiguous, else a gather."""
    return x[sl[0] : sl[1]] if sl is not None else gather_rows(x, idx)


def accumulate(acc: torch.Tensor, sl: tuple[int, int] | None, idx: torch.Tensor | None, src: torch.Tensor) -> None:
    """``acc[rows] += src`` for a call's rows (rows may repeat across entries of one call): one
    in-place op (``acc[a:b] += src`` would add a ``copy_`` back through ``__setitem__``)."""
    if sl is not None:
        acc[sl[0] : sl[1]].add_(src)
    else:
        index_add_rows(acc, idx, src)


class GradAcc:
    """A gradient accumulator made on first use: the first partial that covers every row in
    the accumulator's dtype (the own block's call over all local queries, typically) becomes
    the accumulator instead of being added to zeros — one ``[t, H, D]`` buffer fewer alive."""

    def __init__(self, like: torch.Tensor) -> None:
        self.shape, self.dtype, self.device = like.shape, acc_dtype(like), like.device
        self.t: torch.Tensor | None = None

    def add(self, sl: tuple[int, int] | None, idx: torch.Tensor | None, src: torch.Tensor) -> None:
        if self.t is None:
            whole = sl == (0, self.shape[0]) and src.shape == self.shape
            if whole and src.dtype == self.dtype and src.is_contiguous():
                self.t = src
                return
            self.t = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        accumulate(self.t, sl, idx, src)

    def result(self) -> torch.Tensor:
        if self.t is None:
            self.t = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
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
    lse = q.new_full((q.shape[0], q.shape[1]), LSE_FLOOR, dtype=acc_dtype(q))
    return out, lse


def step_forward(
    calls: list[VarlenCall], run: Run, q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor, lse: torch.Tensor
) -> None:
    """Merge this step's attention of ``q`` over the ``kv`` buffer into ``out``/``lse``."""
    for c in calls:
        kv_c = take(kv, c.k_slice, c.k_index)  # one gather moves K and V together
        q_c = take(q, c.q_slice, c.q_index)
        o, lse_c = run.backend.attn_fwd(
            q_c, kv_c[..., : run.dk], kv_c[..., run.dk :],
            c.cu_seqlens_q, c.cu_seqlens_k, c.max_seqlen_q, c.max_seqlen_k, c.causal, c.window, run.scale,
        )  # fmt: skip
        if run.max_logit is not None:
            m = run.backend.max_logit(
                q_c, kv_c[..., : run.dk], c.cu_seqlens_q, c.cu_seqlens_k, c.max_seqlen_q, c.max_seqlen_k,
                c.causal, c.window, run.scale,
            )  # fmt: skip
            torch.maximum(run.max_logit, m, out=run.max_logit)
        if c.q_slice is not None:
            a, b = c.q_slice
            merge_partial(out[a:b], lse[a:b], o, lse_c, None, acc_finite=True)
        else:
            merge_partial(out, lse, o, lse_c, c.q_index, acc_finite=True)
        del o, lse_c  # free the partial before the next call allocates its own


def step_backward(
    calls: list[VarlenCall],
    run: Run,
    saved: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    kv: torch.Tensor,
    dq: GradAcc,
    dkv: torch.Tensor,
) -> None:
    """Accumulate this step's gradients: ``dq`` for local queries, ``dkv`` for the KV buffer.

    ``saved`` is ``(dout, q, out, lse)`` with the final merged ``out``/``lse``.
    """
    dout, q, out, lse = saved
    for c in calls:
        qs, ks = (c.q_slice, c.q_index), (c.k_slice, c.k_index)
        kv_c = take(kv, *ks)
        g_q, g_k, g_v = run.backend.attn_bwd(
            take(dout, *qs), take(q, *qs), kv_c[..., : run.dk], kv_c[..., run.dk :], take(out, *qs), take(lse, *qs),
            c.cu_seqlens_q, c.cu_seqlens_k, c.max_seqlen_q, c.max_seqlen_k, c.causal, c.window, run.scale,
        )  # fmt: skip
        dq.add(*qs, g_q)
        del g_q
        # K and V halves of the packed buffer separately: no per-call cat
        accumulate(dkv[..., : run.dk], *ks, g_k)
        accumulate(dkv[..., run.dk :], *ks, g_v)
        del g_k, g_v


def apply_sink(out: torch.Tensor, lse: torch.Tensor, offset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Add the attention sink: each query's softmax denominator gains ``exp(offset[h])`` (a
    logit with no value). Merged ``out``/``lse`` (accumulator dtype) -> final ``out``/``lse``;
    a query that sees no key keeps output 0."""
    lse_t = torch.logaddexp(lse, offset.to(lse.dtype)[None, :])
    return out * torch.exp(lse - lse_t).unsqueeze(-1), lse_t


def sink_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """d loss / d offset of this rank's queries (the caller's data-parallel reduction sums the
    ranks): the sink's probability times minus the row's ``dout . out``."""
    p = torch.exp(offset.to(lse.dtype)[None, :] - lse)  # lse includes the sink: finite
    delta = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1)
    return -(p * delta).sum(0)

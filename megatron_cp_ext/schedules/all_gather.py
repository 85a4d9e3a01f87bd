"""``all_gather``: gather every rank's KV once, attend, reduce-scatter dK/dV.

Blocks are padded to the largest per-rank count for the collective. Of the gathered rows,
one gather (:func:`megatron_cp_ext.runtime.ops.gather_rows`) keeps exactly the keys this rank's
queries see, in document order: each document's visible keys are then contiguous, so the
plan covers the rank's queries in one or two varlen calls instead of one per source block.
Each query row is then in one call, so the calls' outputs and dq are copied into place
(:mod:`.placed`): no merges, no fp32 accumulators. KV is gathered again in backward rather
than kept alive between forward and backward (activation memory is the scarcer resource at
long context); the gradients of the kept rows go back to their gathered rows before the
reduce-scatter. A single rank (CP 1) runs here too, with nothing gathered: its own ``k`` and
``v`` go to the kernel as they are, and a single call's outputs are the results (no widened
copies, no zero-filled dK/dV), so CP 1 costs what the kernel costs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from ..masks import MaskSpec
from ..plan import Layout, StepPlan, plan_steps, visible_rows
from ..runtime.comm import all_gather_padded, reduce_scatter_padded
from ..runtime.ops import gather_rows
from .common import KV, GradAcc, OutAcc, Run, acc_dtype, pack_kv, step_backward, step_forward
from .placed import KeptRows, PlacedGrad, PlacedOut, placement

__all__ = ["GatherPlan", "build_plan", "forward", "backward"]


@dataclass
class GatherPlan:
    counts: list[int]
    """Tokens of each rank."""
    pad: int
    """Rows per rank in the gathered buffer (the largest count)."""
    step: StepPlan
    """Local queries against the kept rows (single rank: against its own KV)."""
    keep: np.ndarray | None = None
    """Gathered rows the queries see, in document order (None on a single rank)."""
    once: bool = False
    """Every query row is in at most one call (:func:`.placed.placement`): partials are copied
    into place, not merged (document-ordered keys make this the rule)."""
    covered: bool = False
    """With ``once``: every query row is in a call (no zero fill)."""
    k_once: bool = False
    """Every kept key row is in at most one call: backward places dK/dV straight at their
    gathered rows (:class:`.placed.KeptRows`)."""
    _keep_on: dict = field(default_factory=dict, repr=False)

    def keep_on(self, device: torch.device) -> torch.Tensor:
        """:attr:`keep` on ``device``, uploaded once."""
        key = str(device)
        if key not in self._keep_on:
            self._keep_on[key] = torch.as_tensor(self.keep, dtype=torch.int64).to(device)
        return self._keep_on[key]

    def __getstate__(self) -> dict:  # device copies never travel
        return {**self.__dict__, "_keep_on": {}}


def _spread(first: np.ndarray, count: np.ndarray) -> np.ndarray:
    """``first[i], first[i] + 1, ..., first[i] + count[i] - 1`` for every ``i``, concatenated."""
    total = int(count.sum())
    offset = np.repeat(np.cumsum(count) - count, count)
    return np.repeat(first, count) + np.arange(total, dtype=np.int64) - offset


def _document_order(kv: Layout, lo: np.ndarray, hi: np.ndarray) -> tuple[Layout, np.ndarray]:
    """The gathered rows ``[lo, hi)`` (sorted, disjoint) as a layout in (sequence, position)
    order, adjacent pieces of a sequence joined, and the gathered row of each of its rows."""
    r0 = kv.row
    r1 = kv.row + kv.end - kv.start  # the layout's rows ascend (rank blocks in order)
    a = np.searchsorted(r1, lo, side="right")
    n = np.maximum(np.searchsorted(r0, hi, side="left") - a, 0)
    i, j = _spread(a, n), np.repeat(np.arange(len(lo), dtype=np.int64), n)
    s0, s1 = np.maximum(r0[i], lo[j]), np.minimum(r1[i], hi[j])
    ok = s0 < s1
    i, s0, s1 = i[ok], s0[ok], s1[ok]
    seq, start = kv.seq[i], kv.start[i] + s0 - r0[i]
    end = start + s1 - s0
    if not len(seq):  # the rank's queries see no key (or it holds none)
        empty = np.zeros(0, dtype=np.int64)
        return Layout.packed(empty, empty, empty), empty
    order = np.lexsort((start, seq))
    seq, start, end, s0 = seq[order], start[order], end[order], s0[order]
    rows = _spread(s0, end - start)
    head = np.ones(len(seq), dtype=bool)
    head[1:] = (seq[1:] != seq[:-1]) | (start[1:] != end[:-1])  # a new piece starts here
    first = np.flatnonzero(head)
    last = np.append(first[1:], len(seq)) - 1
    return Layout.packed(seq[first], start[first], end[last]), rows


def build_plan(segments: list[np.ndarray], rank: int, mask: MaskSpec) -> GatherPlan:
    """Rank ``rank``'s calls against the gathered KV; ``segments[j]``: rank j's ``[k, 3]`` ranges."""
    counts = [int((s[:, 2] - s[:, 1]).sum()) for s in segments]
    pad = max(counts)
    mine = segments[rank]
    q = Layout.packed(mine[:, 0], mine[:, 1], mine[:, 2])
    if len(segments) == 1:  # a single rank attends to its own KV as it is
        step = plan_steps(q, q, mask).get(0, StepPlan([]))
        return GatherPlan(counts, pad, step, None, *placement(step.calls, counts[rank]))
    kv = Layout.concat([Layout.packed(s[:, 0], s[:, 1], s[:, 2], row0=j * pad) for j, s in enumerate(segments)])
    _, _, lo, hi = visible_rows(q, kv, mask)
    doc, keep = _document_order(kv, lo, hi)
    step = plan_steps(q, doc, mask).get(0, StepPlan([]))
    k_once = placement(step.calls, len(keep), side="k")[0]
    return GatherPlan(counts, pad, step, keep, *placement(step.calls, counts[rank]), k_once)


def _gather(run: Run, k: torch.Tensor, v: torch.Tensor) -> KV:
    """The K and V rows the plan addresses: the layer's own ``k`` and ``v`` on a single rank
    (no packing copy), else the kept rows, in document order, of one padded all-gather of them
    packed (the gathered buffer is freed on return)."""
    if run.group is None:
        return KV(k, v)
    gathered = all_gather_padded(pack_kv(k, v), run.plan.pad, run.group)
    return KV.of(gather_rows(gathered, run.plan.keep_on(k.device)), run.dk)


def forward(run: Run, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Output and lse in the accumulator dtype, or the kernel's where the rank runs one call
    (the caller adds any sink and rounds once)."""
    kv_all = _gather(run, k, v)
    calls, plan = run.plan.step.on(q.device), run.plan
    # rows in one call each: copied into place (``PlacedOut``), else merged
    acc = PlacedOut(q, v.shape[-1], plan.covered) if plan.once else OutAcc(q, v.shape[-1], keep=len(calls) == 1)
    step_forward(calls, run, q, kv_all, acc)
    del kv_all  # the gathered KV: freed before the result is handed back
    return acc.result()


def backward(run: Run, dout, q, k, v, out, lse) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv as :func:`forward`'s output: the accumulator dtype, or the kernel's for a
    single call (dK/dV there only without a group: a gathered rank's are reduce-scattered)."""
    kv_all = _gather(run, k, v)
    calls = run.plan.step.on(q.device)
    one = len(calls) == 1
    dq = PlacedGrad(q, run.plan.covered) if run.plan.once else GradAcc(q, keep=one)
    if run.group is None:  # dK/dV adopt the kernel's (kept for a single call): no zeros, no adds
        dkv = KV(GradAcc(k, keep=one), GradAcc(v, keep=one))
        step_backward(calls, run, (dout, q, out, lse), kv_all, dq, dkv)
        return dq.result(), dkv.k.result(), dkv.v.result()
    size = dist.get_world_size(run.group)
    keep = run.plan.keep_on(q.device)
    if run.plan.k_once:  # each kept row's dK/dV from one call: placed at its gathered row, widened
        dkv_all = torch.zeros((size * run.plan.pad, *kv_all.packed.shape[1:]), dtype=acc_dtype(q), device=q.device)
        into = KV(KeptRows(dkv_all[..., : run.dk], keep), KeptRows(dkv_all[..., run.dk :], keep))
        step_backward(calls, run, (dout, q, out, lse), kv_all, dq, into)
        del kv_all, into
    else:  # dK, then dV, in one zero-filled buffer: each contiguous, so indexed adds take the kernel
        rows, heads, dkv = kv_all.packed.shape
        flat = torch.zeros(rows * heads * dkv, dtype=acc_dtype(q), device=q.device)
        dk_kept = flat[: rows * heads * run.dk].view(rows, heads, run.dk)
        dv_kept = flat[rows * heads * run.dk :].view(rows, heads, dkv - run.dk)
        step_backward(calls, run, (dout, q, out, lse), kv_all, dq, KV(dk_kept, dv_kept))
        del kv_all  # the kept KV: freed before the reduce-scatter allocates
        dkv_all = flat.new_zeros((size * run.plan.pad, heads, dkv))
        dkv_all[..., : run.dk].index_copy_(0, keep, dk_kept)  # kept rows are distinct
        dkv_all[..., run.dk :].index_copy_(0, keep, dv_kept)
        del flat, dk_kept, dv_kept
    dkv = reduce_scatter_padded(dkv_all, run.group)[: k.shape[0]]
    return dq.result(), dkv[..., : run.dk], dkv[..., run.dk :]  # accumulator dtype: the caller rounds once

"""``all_gather``: gather every rank's KV once, attend, reduce-scatter dK/dV.

Blocks are padded to the largest per-rank count for the collective; the plan addresses
rank j's rows at ``j * pad`` directly. KV is gathered again in backward rather than kept
alive between forward and backward (activation memory is the scarcer resource at long
context). A single rank (CP 1) runs here too, with nothing gathered: its own ``k`` and ``v``
go to the kernel as they are, and a single call's outputs are the results (no widened copies,
no zero-filled dK/dV), so CP 1 costs what the kernel costs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..comm import all_gather_padded, reduce_scatter_padded
from ..masks import MaskSpec
from ..plan import Layout, StepPlan, plan_steps
from .common import KV, GradAcc, OutAcc, Run, acc_dtype, pack_kv, step_backward, step_forward

__all__ = ["GatherPlan", "build_plan", "forward", "backward"]


@dataclass
class GatherPlan:
    counts: list[int]
    """Tokens of each rank."""
    pad: int
    """Rows per rank in the gathered buffer (the largest count)."""
    step: StepPlan
    """Local queries against the whole gathered KV."""


def build_plan(segments: list[np.ndarray], rank: int, mask: MaskSpec) -> GatherPlan:
    """Rank ``rank``'s calls against the gathered KV; ``segments[j]``: rank j's ``[k, 3]`` ranges."""
    counts = [int((s[:, 2] - s[:, 1]).sum()) for s in segments]
    pad = max(counts)
    kv = Layout.concat([Layout.packed(s[:, 0], s[:, 1], s[:, 2], row0=j * pad) for j, s in enumerate(segments)])
    mine = segments[rank]
    plans = plan_steps(Layout.packed(mine[:, 0], mine[:, 1], mine[:, 2]), kv, mask)
    return GatherPlan(counts, pad, plans.get(0, StepPlan([])))


def _gather(run: Run, k: torch.Tensor, v: torch.Tensor) -> KV:
    """Every rank's K and V rows: the layer's own ``k`` and ``v`` on a single rank (no packing
    copy), else one padded all-gather of them packed."""
    if run.group is None:
        return KV(k, v)
    return KV.of(all_gather_padded(pack_kv(k, v), run.plan.pad, run.group), run.dk)


def forward(run: Run, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Output and lse in the accumulator dtype, or the kernel's where the rank runs one call
    (the caller adds any sink and rounds once)."""
    kv_all = _gather(run, k, v)
    calls = run.plan.step.on(q.device)
    acc = OutAcc(q, v.shape[-1], keep=len(calls) == 1)
    step_forward(calls, run, q, kv_all, acc)
    del kv_all  # the gathered KV: freed before the result is handed back
    return acc.result()


def backward(run: Run, dout, q, k, v, out, lse) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv as :func:`forward`'s output: the accumulator dtype, or the kernel's for a
    single call (dK/dV there only without a group: a gathered rank's are reduce-scattered)."""
    kv_all = _gather(run, k, v)
    calls = run.plan.step.on(q.device)
    one = len(calls) == 1
    dq = GradAcc(q, keep=one)
    if run.group is None:  # dK/dV adopt the kernel's (kept for a single call): no zeros, no adds
        dkv = KV(GradAcc(k, keep=one), GradAcc(v, keep=one))
        step_backward(calls, run, (dout, q, out, lse), kv_all, dq, dkv)
        return dq.result(), dkv.k.result(), dkv.v.result()
    dkv_all = torch.zeros(kv_all.packed.shape, dtype=acc_dtype(q), device=q.device)
    step_backward(calls, run, (dout, q, out, lse), kv_all, dq, KV.of(dkv_all, run.dk))
    del kv_all  # the gathered KV: freed before the reduce-scatter allocates
    dkv = reduce_scatter_padded(dkv_all, run.group)[: k.shape[0]]
    return dq.result(), dkv[..., : run.dk], dkv[..., run.dk :]  # accumulator dtype: the caller rounds once

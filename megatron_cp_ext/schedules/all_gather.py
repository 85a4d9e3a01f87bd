"""``all_gather``: gather every rank's KV once, attend, reduce-scatter dK/dV.

Blocks are padded to the largest per-rank count for the collective; the plan addresses
rank j's rows at ``j * pad`` directly. KV is gathered again in backward rather than kept
alive between forward and backward (activation memory is the scarcer resource at long
context).
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


def _gather(run: Run, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    kv = pack_kv(k, v)
    if run.group is None:
        return kv
    return all_gather_padded(kv, run.plan.pad, run.group)


def forward(run: Run, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    kv_all = _gather(run, k, v)
    acc = OutAcc(q, v.shape[-1])
    step_forward(run.plan.step.on(q.device), run, q, KV.of(kv_all, run.dk), acc)
    del kv_all  # the gathered KV: freed before the result is handed back
    return acc.result()  # accumulator dtype: the caller adds any sink and rounds once


def backward(run: Run, dout, q, k, v, out, lse) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    kv_all = _gather(run, k, v)
    dq = GradAcc(q)
    dkv_all = torch.zeros(kv_all.shape, dtype=acc_dtype(q), device=q.device)
    calls = run.plan.step.on(q.device)
    step_backward(calls, run, (dout, q, out, lse), KV.of(kv_all, run.dk), dq, KV.of(dkv_all, run.dk))
    del kv_all  # the gathered KV: freed before the reduce-scatter allocates
    dkv = dkv_all if run.group is None else reduce_scatter_padded(dkv_all, run.group)
    dkv = dkv[: k.shape[0]]
    return dq.result(), dkv[..., : run.dk], dkv[..., run.dk :]  # accumulator dtype: the caller rounds once

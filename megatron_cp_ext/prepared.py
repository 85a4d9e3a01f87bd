"""``plan_cp_attention``: the host side of :func:`cp_attention` done ahead, for ``fullgraph=True``.

:func:`cp_attention` validates, agrees across ranks and looks up its plan on every call; under
``torch.compile`` that host side runs eagerly behind one graph break (``docs/compile.md``).
:func:`plan_cp_attention` runs the very same host side once, outside the compiled region, and
returns a :class:`PreparedCPAttention`: calling it runs only tensor ops and collectives on the
plan's already-uploaded device tensors, so dynamo traces it whole. Its results equal
:func:`cp_attention`'s: the same schedules run on the same plan.

What dynamo cannot trace stays out of the traced call by construction: the numpy planner,
validation and the agreement exchange (all at planning time), and the ``p2p`` ring's batched
``isend``/``irecv``, which has no traceable form (``p2p`` and ``a2a+p2p`` at CP > 1 therefore
run their ring behind a graph break even here; ``docs/compile.md``).
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import numpy as np
import torch
import torch.distributed as dist

from . import attention as att
from .runtime.autocast import autocast_off
from .runtime.validation import CPArgumentError, CPArgumentTypeError
from .schedules import a2a, prepare_plan, schedule_of
from .schedules.common import Run
from .schedules.p2p import P2PPlan
from .sharding.seq_layout import rows_to_thd, seq_to_thd, thd_to_seq

__all__ = ["PreparedCPAttention", "plan_cp_attention"]


class PreparedCPAttention:
    """One micro-batch's validated, agreed and planned ``cp_attention`` call (reused by every
    layer with the same arguments). ``prepared(q, k, v)`` runs it; traceable whole by dynamo
    where the comm type's collectives are (``fullgraph``: see :attr:`fullgraph`)."""

    def __init__(self, c: att._Call, plan: object, inputs: tuple) -> None:
        self.inputs = inputs
        """``(shape, dtype, device)`` of the planned ``q, k, v``: a call on others is refused (the
        plan's softmax scale, head split and batch layout follow them)."""
        self.grad = c.grad
        """Whether the planned call runs a backward (agreed by every CP rank): a call that
        differs is refused, or one rank would enter the backward's collectives alone."""
        self.comm_type = c.comm_type
        """The comm type that runs (``auto`` resolved at planning time)."""
        self.fmt, self.seq_dims, self.cp_size = c.fmt, c.seq_dims, c.sharding.cp_size
        self.tokens, self.hq, self.hkv = c.shapes.tokens, c.shapes.hq, c.shapes.hkv
        self.offset = _spec(c.offset)
        """``(shape, dtype, device)`` of the planned ``softmax_offset`` (checked at planning), or None."""
        self.plan = plan
        self._a2a = isinstance(plan, a2a.A2APlan)
        self._groups, self._heads = c.groups, c.heads
        self._run = Run(plan=plan, group=c.groups.p2p, backend=c.backend, scale=c.scale, dk=c.shapes.dqk)
        self._schedule: ModuleType = schedule_of(plan)
        self._fullgraph = self._traceable(c.sharding)
        prepare_plan(plan, c.q.device)  # a lookup where `_get_plan` built the plan here

    def __reduce__(self):
        raise CPArgumentTypeError(
            "a PreparedCPAttention holds its process groups and device tensors: it does not pickle or deep-copy. "
            "Pickle the CPSharding (plans travel without device state) and call plan_cp_attention where it runs"
        )

    @property
    def fullgraph(self) -> bool:
        """Whether a call traces without a graph break: no ``p2p`` ring with a peer (CP 1, ``all_gather``,
        ``a2a``); ``p2p`` and ``a2a+p2p`` at CP > 1 keep one break around their ring. So do the
        layouts where a rank's traced collective would feed nothing on that rank (the same
        answer on every rank: the sharding and head counts are global): an ``all_gather`` rank
        with no token that attends (AOT autograd dropped its gather: the others hung) and an
        ``a2a`` member with no query head (its exchange was traced with other sizes: gloo
        aborted the process)."""
        return self._fullgraph

    def _traceable(self, sharding) -> bool:
        ring = self.plan.ring if self._a2a else self.plan
        if isinstance(ring, P2PPlan) and len(ring.counts) > 1:
            return False
        if self._a2a:
            return all(b > a for a, b in self._heads[0])
        if self.comm_type != "all_gather":
            return True
        for r in range(sharding.cp_size):
            seg = sharding.rank_segments(r)
            if not ((seg[:, 2] > seg[:, 1]) & ~np.isin(seg[:, 0], sorted(sharding.muted))).any():
                return False  # no token of this rank attends
        return True

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_offset: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Attention of this rank's ``q, k, v`` (the shapes, dtype and device planned for)."""
        if _spec(softmax_offset) != self.offset:  # a2a slices it by head: another shape fails on some ranks only
            raise CPArgumentError(
                f"softmax_offset (shape, dtype, device) {_spec(softmax_offset)} differs from the planned call's "
                f"{self.offset} (None: not passed): pass it as it was passed to plan_cp_attention"
            )
        got = _shapes(q, k, v)
        if got != self.inputs:
            raise CPArgumentError(
                f"q, k, v (shape, dtype, device) {got} differ from the planned call's {self.inputs}: call "
                "plan_cp_attention once per micro-batch, on tensors of that micro-batch's shapes"
            )
        grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, softmax_offset) if x is not None)
        if grad != self.grad:
            raise CPArgumentError(
                f"this call {'runs' if grad else 'runs no'} backward (grad mode and requires_grad of q, k, v, "
                f"softmax_offset) but plan_cp_attention agreed on {'one' if self.grad else 'none'} with every "
                "CP rank: plan on tensors (and in a grad mode) like the call's (inside a reentrant checkpoint, "
                "use use_reentrant=False or cp_attention)"
            )
        if self.seq_dims is not None:
            q, k, v, _ = seq_to_thd(q, k, v, self.fmt)
            q, k, v = (rows_to_thd(x, self.cp_size) for x in (q, k, v))
        out = (_attend if self.fullgraph else _attend_eager)(self, q, k, v, softmax_offset)
        if self.seq_dims is not None:
            out = thd_to_seq(out, self.fmt, self.seq_dims, self.cp_size)
        return out


def _spec(x: object) -> tuple | None:
    if x is None or not isinstance(x, torch.Tensor):
        return None if x is None else (type(x).__name__,)
    return (tuple(x.shape), x.dtype, x.device)


def _shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
    return tuple(_spec(x) for x in (q, k, v))


@autocast_off
def _attend(p: PreparedCPAttention, q, k, v, offset) -> torch.Tensor:
    """The schedule on the prepared plan: tensor ops and collectives only."""
    if p._a2a:
        g = p._groups
        return a2a.attention(q, k, v, p._run, g.a2a, g.p2p, p._heads, offset)
    return att._CPAttention.apply(q, k, v, offset, p._run, p._schedule)


_attend_eager = torch.compiler.disable(
    _attend,
    reason="a p2p ring (batched isend/irecv has no traceable form), or a layout where a rank's traced collective "
    "feeds nothing on that rank (PreparedCPAttention.fullgraph)",
)


def plan_cp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    cp_group: dist.ProcessGroup | Sequence[dist.ProcessGroup] | None,
    comm_type: str = "p2p",
    qkv_format: str = "thd",
    sharding=None,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    chunk_size: int | None = None,
    softmax_scale: float | None = None,
    softmax_offset: torch.Tensor | None = None,
    backend: str = "auto",
    check: bool = False,
) -> PreparedCPAttention:
    """Run :func:`cp_attention`'s host side now: validation, the cross-rank agreement, the plan
    (built or looked up on the sharding) and its device upload. Call it eagerly, outside
    ``torch.compile``, once per micro-batch (every layer with the same arguments shares the
    result); then call the returned object inside the compiled model.

    Arguments as :func:`cp_attention` (``return_max_logit`` is not offered). ``q, k, v``
    (and ``softmax_offset``) stand for the tensors of the later calls: their shapes, dtype,
    device and ``requires_grad`` are what is checked and agreed; their values are not read.
    ``check`` applies to this planning exchange (the prepared call communicates only
    attention data). Collective: every CP rank must call it, like :func:`cp_attention`.
    """
    args = dict(
        cp_group=cp_group, comm_type=comm_type, qkv_format=qkv_format, sharding=sharding, causal=causal,
        window_size=window_size, chunk_size=chunk_size, softmax_scale=softmax_scale, softmax_offset=softmax_offset,
        backend=backend, check=check, return_max_logit=False,
    )  # fmt: skip
    c = att._checked(q, k, v, args)
    return PreparedCPAttention(c, att._get_plan(c), _shapes(q, k, v))

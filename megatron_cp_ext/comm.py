"""Communication used by the schedules: an async ring, padded uneven gathers, one-off checks.

Ranks may hold different token counts. Every size here comes from the host plan, so no
collective ever waits on a size exchange inside forward/backward. Uneven all-gather and
reduce-scatter pad each rank's block to the largest count; plans index the padded buffer
directly, so nothing is un-padded by a copy.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["Ring", "all_gather_padded", "reduce_scatter_padded", "exchange_ints"]


class Ring:
    """Asynchronous send-to-next / receive-from-previous over a process group.

    ``exchange`` posts the pair and returns at once so the caller computes while the next
    block is in flight; ``wait`` completes everything posted. Zero-size transfers are skipped
    (both ends know the sizes from the plan).
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)
        self._reqs: list = []

    def exchange(self, send: torch.Tensor | None, recv: torch.Tensor | None) -> None:
        ops = []
        if send is not None and send.numel():
            ops.append(dist.P2POp(dist.isend, send.contiguous(), self.next, self.group))
        if recv is not None and recv.numel():
            ops.append(dist.P2POp(dist.irecv, recv, self.prev, self.group))
        if ops:
            self._reqs += dist.batch_isend_irecv(ops)

    def wait(self) -> None:
        for r in self._reqs:
            r.wait()
        self._reqs = []


def all_gather_padded(x: torch.Tensor, pad_rows: int, group: dist.ProcessGroup) -> torch.Tensor:
    """``[t, ...]`` per rank -> ``[size * pad_rows, ...]``: rank j's rows start at ``j * pad_rows``."""
    size = dist.get_world_size(group)
    if x.shape[0] < pad_rows:
        x = torch.cat([x, x.new_zeros((pad_rows - x.shape[0], *x.shape[1:]))])
    out = x.new_empty((size * pad_rows, *x.shape[1:]))
    if pad_rows:
        dist.all_gather(list(out.chunk(size)), x.contiguous(), group=group)
    return out


def reduce_scatter_padded(full: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Inverse of :func:`all_gather_padded` for gradients: sum over ranks, keep own block."""
    size = dist.get_world_size(group)
    chunks = list(full.chunk(size))
    out = torch.empty_like(chunks[0])
    if out.numel():
        dist.reduce_scatter(out, chunks, group=group)
    return out


def exchange_ints(values: list[int], group: dist.ProcessGroup, device: torch.device) -> list[list[int]]:
    """All ranks' small integer vectors (host sync: only for once-per-plan consistency checks)."""
    size = dist.get_world_size(group)
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    allv = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(allv, mine, group=group)
    return [v.tolist() for v in allv]

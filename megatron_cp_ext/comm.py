"""Communication used by the schedules: an async ring, padded uneven gathers, one-off checks.

Ranks may hold different token counts. Every size here comes from the host plan, so no
collective ever waits on a size exchange inside forward/backward. Uneven all-gather and
reduce-scatter pad each rank's block to the largest count; plans index the padded buffer
directly, so nothing is un-padded by a copy.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

__all__ = ["Ring", "all_gather_padded", "reduce_scatter_padded", "exchange_ints"]


class Ring:
    """Asynchronous send-to-next / receive-from-previous over a process group.

    ``exchange`` posts the pair and returns at once so the caller computes while the next
    block is in flight; ``wait`` completes everything posted. Zero-size transfers are skipped
    (both ends know the sizes from the plan).

    ``direction=-1`` runs the ring the other way (next = rank - 1), and ``exchange(..., hops=h)``
    talks to the rank ``h`` places along it (negative: back towards where a block came from),
    which is how the p2p schedule returns gradients straight home. Each ring object has its
    own ``tag`` so the different streams of one schedule never match each other's messages on
    backends that honour tags; on the others they match in posting order, which every rank
    keeps identical.
    """

    def __init__(self, group: dist.ProcessGroup, direction: int = 1, tag: int = 0) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.direction = direction
        self.tag = tag
        self.next = self.peer(1)
        self.prev = self.peer(-1)
        self._reqs: list = []
        self._keep: list[torch.Tensor] = []

    def peer(self, hops: int) -> int:
        """Global rank ``hops`` places along this ring's direction."""
        return dist.get_global_rank(self.group, (self.rank + self.direction * hops) % self.size)

    def exchange(self, send: torch.Tensor | None, recv: torch.Tensor | None, hops: int = 1) -> None:
        """Send to the rank ``hops`` ahead and receive from the rank ``hops`` behind."""
        ops = []
        if send is not None and send.numel():
            send = send.contiguous()
            self._keep.append(send)  # in flight until wait(): keep the storage alive
            to = self.next if hops == 1 else self.peer(hops)
            ops.append(dist.P2POp(dist.isend, send, to, self.group, self.tag))
        if recv is not None and recv.numel():
            frm = self.prev if hops == 1 else self.peer(-hops)
            ops.append(dist.P2POp(dist.irecv, recv, frm, self.group, self.tag))
        if ops:
            self._reqs += dist.batch_isend_irecv(ops)

    def wait(self) -> None:
        for r in self._reqs:
            r.wait()
        self._reqs = []
        self._keep = []


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


def exchange_ints(
    values: list[int],
    group: dist.ProcessGroup,
    device: torch.device | None = None,
    timeout: float | None = None,
) -> list[list[int]]:
    """All ranks' small integer vectors (host sync: only for consistency checks, never in
    the hot path). Every rank must pass a vector of the same length.

    ``device`` defaults to what the group's backend moves (CUDA for NCCL, else CPU).
    ``timeout`` (seconds) bounds the wait: a ``TimeoutError`` when other ranks never join.
    """
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    size = dist.get_world_size(group)
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    allv = [torch.empty_like(mine) for _ in range(size)]
    work = dist.all_gather(allv, mine, group=group, async_op=True)
    if timeout is None:
        work.wait()
    else:
        try:
            work.wait(timeout=datetime.timedelta(seconds=timeout))
        except RuntimeError as exc:
            raise TimeoutError(f"exchange over a group of {size} ranks not joined within {timeout}s: {exc}") from exc
    return [v.tolist() for v in allv]

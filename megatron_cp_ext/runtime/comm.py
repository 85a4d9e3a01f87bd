"""Communication used by the schedules: async peer exchanges, padded uneven gathers, checks.

Ranks may hold different token counts. Every size here comes from the host plan, so no
collective ever waits on a size exchange inside forward/backward. Uneven all-gather and
reduce-scatter pad each rank's block to the largest count; plans index the padded buffer
directly, so nothing is un-padded by a copy.
"""

from __future__ import annotations

import datetime
import weakref
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from . import inflight

__all__ = ["Message", "Peers", "Batch", "start_group", "all_gather_padded", "reduce_scatter_padded", "exchange_ints"]
__all__ += ["global_ranks"]

_GLOBAL_RANKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Per process group (weakly held, like :mod:`.groups`' cache)."""


def global_ranks(group: dist.ProcessGroup) -> tuple[int, ...]:
    """Global rank of each group rank, built once per group: ``get_global_rank`` scans the
    group's rank map (O(size) per lookup, O(size²) for the table) and every layer needs it."""
    table = _GLOBAL_RANKS.get(group)
    if table is None:
        table = _GLOBAL_RANKS[group] = tuple(dist.get_global_rank(group, r) for r in range(dist.get_world_size(group)))
    return table


class Message(NamedTuple):
    """One send or receive of a :meth:`Peers.post` batch."""

    peer: int
    """Group-local rank of the other end."""
    tensor: torch.Tensor
    """What is sent, or the buffer received into."""
    tag: int | None = None
    """Its stream's tag; None: the :class:`Peers`' own. A tag per stream lets one batch carry
    two streams (backends without tags match each pair's messages in posting order, which
    both sides keep by listing the streams in the same order)."""


_STARTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Per group (weakly held): the device types :func:`start_group` has looked at."""

START_BACKENDS = ("nccl",)
"""Backends whose communicator a group's first operation creates, all its ranks together."""


def start_group(group: dist.ProcessGroup, device: torch.device) -> None:
    """One tiny all-reduce over ``group`` on ``device``, before its first batch of sends and
    receives there, where the group's backend for that device is one of :data:`START_BACKENDS`.

    NCCL creates a group's communicator at the group's first operation, and a batch of sends
    and receives may be that first operation only if every rank of the group takes part in it
    (torch's note on ``batch_isend_irecv``). A ring step posts nothing on a rank with nothing
    to move, so such a first batch could wait forever on the others. Every rank of a group
    builds its :class:`Peers` at the same point of a layer, so all of them run this once, there."""
    seen = _STARTED.setdefault(group, set())
    if device.type in seen:
        return
    # "nccl", or a per-device config such as "cpu:gloo,cuda:nccl"
    config = str(dist.get_backend(group)).split(",")
    backends = dict(part.split(":", 1) if ":" in part else (device.type, part) for part in config)
    if backends.get(device.type) in START_BACKENDS:
        dist.all_reduce(torch.zeros(1, device=device), group=group)
    seen.add(device.type)


class Peers:
    """Batched asynchronous sends and receives to any peers of a process group.

    ``post`` issues one batch (a NCCL group) and returns at once, so the caller computes while
    it is in flight; ``wait`` completes a batch. Peers are group-local ranks. Each object has
    its own ``tag`` so the streams of one schedule never match each other's messages on
    backends that honour tags; on the others, messages between two ranks match in posting
    order, which the schedules keep identical on both sides (they post by step number).
    Zero-size tensors are skipped (both ends know the sizes from the plan).
    """

    def __init__(self, group: dist.ProcessGroup, tag: int = 0, device: torch.device | None = None) -> None:
        self.group = group
        self.tag = tag
        if device is not None:  # its messages' device: the group is started there (:func:`start_group`)
            start_group(group, device)
        self._global = global_ranks(group)
        self._direct: dict[str, bool] = {}
        """Per device type: whether sends and receives go straight to the process group."""

    def post(self, sends: list[Message | tuple], recvs: list[Message | tuple]) -> Batch:
        """Start ``sends`` and ``recvs`` (:class:`Message`, or a ``(peer, tensor)`` /
        ``(peer, tensor, tag)`` tuple read as one); returns the batch, which holds every tensor
        the backend was given until :meth:`wait` (:mod:`.inflight`)."""
        # a tagged (contiguous) Message is posted as it is: no per-message call on the hot path
        out_m: list[Message] = []
        for m in sends:
            if m.__class__ is not Message or m.tag is None or not m.tensor.is_contiguous():
                m = self._message(m, True)
            if m.tensor.numel():
                out_m.append(m)
        into_m: list[Message] = []
        for m in recvs:
            if m.__class__ is not Message or m.tag is None:
                m = self._message(m, False)
            if m.tensor.numel():
                into_m.append(m)
        if not out_m and not into_m:
            return Batch([], [])
        device = (out_m or into_m)[0].tensor.device
        direct = self._direct.get(device.type)
        if direct is None:
            direct = self._direct[device.type] = not _coalesces(self.group, device)
        held = [m.tensor for m in out_m] + [m.tensor for m in into_m]
        if direct:  # what ``batch_isend_irecv`` does for such backends, without its per-op checks
            send, recv = self.group.send, self.group.recv
            works = [send([m.tensor], m.peer, m.tag) for m in out_m]
            works += [recv([m.tensor], m.peer, m.tag) for m in into_m]
        else:  # one coalesced group (NCCL)
            op = lambda f, m: dist.P2POp(f, m.tensor, self._global[m.peer], self.group, m.tag)  # noqa: E731
            works = dist.batch_isend_irecv([op(dist.isend, m) for m in out_m] + [op(dist.irecv, m) for m in into_m])
        batch = Batch(works, held)
        ledger = inflight.ACTIVE[0]
        if ledger is not None:
            batch.ticket = ledger.post(batch, held[: len(out_m)], held[len(out_m) :])
        return batch

    def _message(self, m: Message | tuple, send: bool) -> Message:
        """``m`` as posted: a Message, its tag resolved, a non-contiguous send made contiguous
        (a copy)."""
        m = Message(*m)
        t = m.tensor if not send or m.tensor.is_contiguous() else m.tensor.contiguous()
        if t is m.tensor and m.tag is not None:
            return m
        return Message(m.peer, t, self.tag if m.tag is None else m.tag)

    @staticmethod
    def wait(batch: list) -> None:
        """Complete a batch; only then are its tensors released (the current stream now waits
        for the transfers, so their blocks can be reused safely)."""
        for work in batch:
            work.wait()
        ticket = getattr(batch, "ticket", None)
        if ticket is not None:
            ledger = inflight.ACTIVE[0]
            if ledger is not None:
                ledger.wait(ticket)
        if isinstance(batch, Batch):
            batch.tensors = []


def _coalesces(group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether ``batch_isend_irecv`` would coalesce on this group (its own test): then the
    batch goes through it; otherwise it only calls the group's ``send``/``recv`` per tensor,
    after argument checks that cost more host time than the transfers' posting itself."""
    return type(group) is dist.ProcessGroup and bool(group._get_backend(device).supports_coalescing)


class Batch(list):
    """The works of one :meth:`Peers.post` (a list, as ``batch_isend_irecv`` returns) and every
    tensor they move, exactly as handed to the backend (``contiguous()`` copies included): held
    here until :meth:`Peers.wait`, so no block a transfer uses returns to the allocator while the
    transfer may still use it."""

    def __init__(self, works: list, tensors: list[torch.Tensor]) -> None:
        super().__init__(works)
        self.tensors = tensors
        self.ticket: int | None = None
        """The batch's id in an installed :class:`.inflight.Ledger`."""


FLAT_COLLECTIVES: bool | None = None
"""Whether :func:`all_gather_padded` and :func:`reduce_scatter_padded` run the single-tensor
collectives (``all_gather_into_tensor``, ``reduce_scatter_tensor``): None (the default) on
CUDA tensors, where NCCL given a list of output (input) blocks stages them through a flat
buffer of its own (one more gathered-KV-sized buffer alive and a copy); the list forms on CPU,
whose gloo sums are the ones the in-process test runner reproduces bit for bit. True or
False forces either (tests)."""


def _flat(x: torch.Tensor) -> bool:
    if torch.compiler.is_compiling():  # traced: the forms dynamo has always rewritten
        return False
    return x.is_cuda if FLAT_COLLECTIVES is None else FLAT_COLLECTIVES


def _single(name: str, old: str):
    """The single-tensor collective: torch's newer name where it has one, else the older."""
    return getattr(dist, name, None) or getattr(dist, old)


def all_gather_padded(x: torch.Tensor, pad_rows: int, group: dist.ProcessGroup) -> torch.Tensor:
    """``[t, ...]`` per rank -> ``[size * pad_rows, ...]``: rank j's rows start at ``j * pad_rows``."""
    size = dist.get_world_size(group)
    if x.shape[0] < pad_rows:
        x = torch.cat([x, x.new_zeros((pad_rows - x.shape[0], *x.shape[1:]))])
    out = x.new_empty((size * pad_rows, *x.shape[1:]))
    if pad_rows and _flat(x):
        _single("all_gather_single", "all_gather_into_tensor")(out, x.contiguous(), group=group)
    elif pad_rows:
        dist.all_gather(list(out.chunk(size)), x.contiguous(), group=group)
    return out


def reduce_scatter_padded(full: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Inverse of :func:`all_gather_padded` for gradients: sum over ranks, keep own block."""
    if torch.compiler.is_compiling():  # list-form reduce_scatter does not trace: the functional one
        return funcol.reduce_scatter_tensor(full.contiguous(), "sum", 0, group)
    size = dist.get_world_size(group)
    chunks = list(full.chunk(size))
    out = torch.empty_like(chunks[0])
    if out.numel() and _flat(full):
        _single("reduce_scatter_single", "reduce_scatter_tensor")(out, full.contiguous(), group=group)
    elif out.numel():
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
    if timeout is None or work.is_completed():
        # a completed work needs no timed wait (a synchronous group, e.g. the threaded test
        # runner's, has finished here and its work does not take a finite timeout)
        work.wait()
    else:
        try:
            work.wait(timeout=datetime.timedelta(seconds=timeout))
        except RuntimeError as exc:
            raise TimeoutError(f"exchange over a group of {size} ranks not joined within {timeout}s: {exc}") from exc
    return [v.tolist() for v in allv]

"""All CP ranks in one process: one thread per rank over an in-memory process group.

``run_threads(world, fn, *args)`` is the in-process twin of :func:`.pool.run_on_ranks`: it
runs ``fn(rank, world, *args)`` on ``world`` threads, each with its own default process group,
so the package's own plans, schedules, kernels and merges run unchanged for every comm type —
on any device, all ranks on one GPU included. That is how a single GPU checks every comm type
against the dense reference and times one-GPU CP (``benchmarks/gpu_suite.py``).

The communicator is PyTorch's threaded test process group (its per-thread ``torch.distributed``
world and its collectives: all-gather, reduce-scatter, all-to-all, all-reduce) plus what it
lacks and the ring schedules need: point-to-point ``send``/``recv`` (so ``batch_isend_irecv``),
matched per (group, source, destination, tag) in posting order as on gloo and NCCL. Every
transfer is a plain tensor copy and every sum (reduce-scatter, all-reduce) adds the ranks in
the order of gloo's ring all-reduce (:func:`ring_sum`), so a CPU run equals a gloo run bit for
bit (``tests/L1/test_inproc_runner.py``); on a GPU it is one fixed, deterministic order.

``run_threads(..., streams=True)`` puts each rank's compute and its incoming transfers on
streams of their own (the p2p overlap trace, ``tests/gpu/test_p2p_trace.py``).

Rules for ``fn`` that separate processes get for free: build per-rank state inside ``fn``
(module-level caches are shared by the threads), and draw random numbers from an explicit
``torch.Generator``, never the global one.
"""

from __future__ import annotations

import collections
import threading
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future
from torch.testing._internal.distributed import multi_threaded_pg as _mt

from .inproc_streams import COLLECTIVES, LOCAL, SPIN_CYCLES, StreamWork, copy_streamed, mark, stream_roles, synced

__all__ = ["run_threads", "ring_sum", "stream_roles", "BACKEND"]

BACKEND = "mcx_threads"
"""Name of the in-memory backend (what ``dist.get_backend`` reports inside ``run_threads``)."""

_RUN_LOCK = threading.Lock()


class _Mailboxes:
    """Point-to-point messages between threads, matched in posting order per channel.

    A channel is (group name, source, destination, tag). A send posted before its receive
    leaves a copy (the sender may reuse its buffer once its work completes, as on a real
    backend); a receive posted first waits on a future that the matching send completes.
    In stream mode (:func:`run_threads`' ``streams``) a message is matched the same way but
    copied on the receiver's transfer stream (:class:`StreamWork`).
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sent: dict[tuple, collections.deque] = collections.defaultdict(collections.deque)
        self.waiting: dict[tuple, collections.deque] = collections.defaultdict(collections.deque)

    def send(self, key: tuple, t: torch.Tensor) -> None:
        with self.lock:
            if self.waiting[key]:
                buf, fut = self.waiting[key].popleft()
            else:
                self.sent[key].append(t.detach().clone())
                return
        buf.detach().copy_(t)
        fut.set_result([buf])

    def recv(self, key: tuple, buf: torch.Tensor) -> Future:
        fut: Future = Future()
        with self.lock:
            if not self.sent[key]:
                self.waiting[key].append((buf, fut))
                return fut
            t = self.sent[key].popleft()
        buf.detach().copy_(t)
        fut.set_result([buf])
        return fut

    def send_streamed(self, key: tuple, t: torch.Tensor) -> StreamWork:
        work = StreamWork(mark())
        with self.lock:
            if not self.waiting[key]:
                self.sent[key].append((t, work))
                return work
            buf, rwork = self.waiting[key].popleft()
        copy_streamed(buf, t, rwork, work)
        return work

    def recv_streamed(self, key: tuple, buf: torch.Tensor) -> StreamWork:
        work = StreamWork(mark(), getattr(LOCAL, "transfer", None))
        with self.lock:
            if not self.sent[key]:
                self.waiting[key].append((buf, work))
                return work
            t, swork = self.sent[key].popleft()
        copy_streamed(buf, t, work, swork)
        return work

    def fail_all(self, exc: BaseException) -> None:
        """Wake every waiting receive (another rank failed: nobody will send)."""
        with self.lock:
            pending = [f for q in self.waiting.values() for _, f in q]
            pending += [e[1] for q in self.sent.values() for e in q if isinstance(e, tuple)]
            self.waiting.clear()
            self.sent.clear()
        err = RuntimeError(f"peer rank failed: {exc!r}")
        for fut in pending:
            if isinstance(fut, StreamWork):
                fut.finish(None, err)
            elif not fut.done():
                fut.set_exception(err)


_BOXES = _Mailboxes()


GLOO_MAX_SEGMENT_BYTES = 1 << 20
"""gloo's ring all-reduce segment bound: it sets which rank starts each element's sum."""


def ring_sum(xs: list[torch.Tensor]) -> torch.Tensor:
    """Sum of ``xs`` (one per rank) in gloo's ring all-reduce order, bit for bit.

    The buffer is cut into ``k * n`` segments (``k >= 2``, each at most 1 MiB); the ``k``
    segments of block ``c`` start at rank ``c - 1`` and collect the ranks downwards around the
    ring, so block ``c`` is ``((x[c-1] + x[c-2]) + ...) + x[c]``. gloo's reduce-scatter is one
    such all-reduce per output block.
    """
    n, flat = len(xs), [x.reshape(-1) for x in xs]
    numel, es = flat[0].numel(), flat[0].element_size()
    seg_max = es * max(1, GLOO_MAX_SEGMENT_BYTES // es)
    segs = max(-(-numel * es // seg_max), 2 * n)
    segs = -(-segs // n) * n
    seg_bytes = -(-numel * es // segs)
    seg_elems = -(-seg_bytes // es)  # ceil(bytes / segs), rounded up to whole elements
    block = seg_elems * (segs // n)
    out = torch.empty_like(flat[0])
    for c in range(n):
        lo, hi = c * block, min((c + 1) * block, numel)
        if lo >= hi:
            continue
        acc = flat[(c - 1) % n][lo:hi].clone()
        for j in range(2, n + 1):
            acc += flat[(c - j) % n][lo:hi]
        out[lo:hi] = acc
    return out.view_as(xs[0])


class _RingReduceScatter:
    """Reduce-scatter (sum) as gloo computes it: one ring all-reduce per output block."""

    @torch.no_grad()
    def work(self, data: list) -> None:
        for k, (outputs, _) in enumerate(data):
            outputs[0].detach().copy_(ring_sum([inputs[0][k] for _, inputs in data]))


class _RingAllReduce:
    """All-reduce (sum) in gloo's ring order."""

    @torch.no_grad()
    def work(self, data: list) -> None:
        for i in range(len(data[0])):
            total = ring_sum([tensors[i] for tensors in data])
            for tensors in data:
                tensors[i].detach().copy_(total)


class _MaxAllReduce:
    """All-reduce (max): exact in any order (the max logits' reduction)."""

    @torch.no_grad()
    def work(self, data: list) -> None:
        for i in range(len(data[0])):
            top = torch.stack([tensors[i] for tensors in data]).amax(0)
            for tensors in data:
                tensors[i].detach().copy_(top)


class ThreadGroup(_mt.ProcessLocalGroup):
    """PyTorch's threaded process group with point-to-point messages added and sums taken in
    gloo's order (so a CPU run here equals a gloo run bit for bit); all-reduce also takes max."""

    def _sum(self, collective, data, opts):
        if opts.reduceOp == dist.ReduceOp.MAX and isinstance(collective, _RingAllReduce):
            collective = _MaxAllReduce()
        elif opts.reduceOp != dist.ReduceOp.SUM:
            raise NotImplementedError(f"{BACKEND}: only sums (and all-reduce max) are implemented, got {opts.reduceOp}")
        coll = _mt.ProcessLocalGroup._start_coll(collective, self)
        res = coll.join(self._rank, data)
        _mt.ProcessLocalGroup._end_coll(coll, self)
        return res

    def reduce_scatter(self, output_tensor, scatter_list, opts=None):
        return self._sum(_RingReduceScatter(), (output_tensor, scatter_list), opts or _mt.ReduceScatterOptions())

    def allreduce(self, tensor_list, opts=None):
        return self._sum(_RingAllReduce(), tensor_list, opts or _mt.AllreduceOptions())

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0):
        (t,) = tensors
        if getattr(LOCAL, "streams", False):
            return _BOXES.send_streamed((self.pg_name, self._rank, dst, tag), t)
        _BOXES.send((self.pg_name, self._rank, dst, tag), t)
        return _mt.ret_work(tensors)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0):
        (buf,) = tensors
        if getattr(LOCAL, "streams", False):
            return _BOXES.recv_streamed((self.pg_name, src, self._rank, tag), buf)
        return _mt._create_work_from_future(_BOXES.recv((self.pg_name, src, self._rank, tag), buf))

    def getBackendName(self) -> str:
        return BACKEND

    def __repr__(self) -> str:
        return f"ThreadGroup(rank={self._rank}, size={self._world_size})"


def _create(prefix_store, rank: int, world_size: int, timeout):
    pg = ThreadGroup(rank, world_size)
    # groups are created by every thread independently: wait until all members have it
    _mt._store_based_barrier(rank, prefix_store, "", world_size, timeout)
    return pg


dist.Backend.register_backend(BACKEND, _create, devices=["cpu", "cuda"])

if not hasattr(_mt.ThreadLocalWorld, "comms"):
    # torch 2.11's ``destroy_process_group`` walks ``_world.comms``, which its threaded world
    # does not define yet (later releases do): give each thread's world an empty list of them.
    _COMMS = threading.local()

    def _thread_comms(self) -> list:
        if not hasattr(_COMMS, "comms"):
            _COMMS.comms = []
        return _COMMS.comms

    _mt.ThreadLocalWorld.comms = property(_thread_comms)


for _name in (n for n in COLLECTIVES if hasattr(ThreadGroup, n)):  # torch versions differ
    setattr(ThreadGroup, _name, synced(getattr(ThreadGroup, _name)))


def _rank_main(rank: int, world: int, store, fn: Callable, args: tuple, device, results: list, streams: bool) -> None:
    try:
        if device is not None and device.type == "cuda":
            torch.cuda.set_device(device.index)
        dist.init_process_group(BACKEND, rank=rank, world_size=world, store=store)
        try:
            LOCAL.streams = streams
            if streams and device is not None and device.type == "cuda":
                compute, LOCAL.transfer = torch.cuda.Stream(), torch.cuda.Stream()
                # markers: 1 + rank spins on the rank's compute stream, 1 + world + rank on its
                # transfer stream, so a trace maps streams to ranks (:func:`stream_roles`)
                for stream, spins in ((compute, 1 + rank), (LOCAL.transfer, 1 + world + rank)):
                    with torch.cuda.stream(stream):
                        for _ in range(spins):
                            torch.cuda._sleep(SPIN_CYCLES)
                with torch.cuda.stream(compute):
                    results[rank] = (True, fn(rank, world, *args))
                compute.synchronize()
            else:
                results[rank] = (True, fn(rank, world, *args))
        finally:
            LOCAL.streams, LOCAL.transfer = False, None
            dist.destroy_process_group()
    except SystemExit:  # woken by another rank's failure (the threaded group's way out)
        results[rank] = (False, "stopped: another rank failed")
    except BaseException as exc:  # noqa: BLE001 - reported to the caller with the traceback
        results[rank] = (False, traceback.format_exc())
        _mt.ProcessLocalGroup.exception_handle(exc)
        _BOXES.fail_all(exc)


def run_threads(
    world_size: int, fn: Callable, *args: Any, timeout: float = 300.0, device=None, streams: bool = False
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` threads of this process.

    Each thread has its own default process group (backend :data:`BACKEND`); ``new_group``,
    :func:`megatron_cp_ext.hierarchical_cp_groups` and every collective work as across
    processes. ``device`` (e.g. ``"cuda"``) is made current in every thread. Returns the
    per-rank return values; a rank that raises raises here with its traceback, and a run that
    does not finish within ``timeout`` seconds raises ``TimeoutError`` (a hang, e.g.
    mismatched collectives). One run at a time per process.

    ``streams``: every rank computes on its own CUDA stream and receives on its own transfer
    stream, as NCCL's separate stream does on a cluster, so a trace shows how much of the
    transfers the schedule overlaps with its rank's compute (marker kernels name the streams:
    :func:`stream_roles`). Collectives then synchronise the device around them. On CPU the
    same matching runs with the copy at the match and no clone of the send (a send buffer
    changed before its wait shows as a wrong result).
    """
    if device is not None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # a new thread starts on GPU 0
            device = torch.device("cuda", torch.cuda.current_device())
    with _RUN_LOCK:
        from ..sharding import splits

        splits.clear()  # the run splits its own data (the ranks share this process's record)
        _mt._install_threaded_pg()
        _mt.ProcessLocalGroup.reset()
        torch._C._distributed_c10d._set_thread_isolation_mode(True)  # group names per thread
        store = dist.HashStore()
        results: list = [None] * world_size
        threads = [
            threading.Thread(
                target=_rank_main,
                args=(r, world_size, store, fn, args, device, results, streams),
                daemon=True,
                name=f"mcx-rank-{r}",
            )  # fmt: skip
            for r in range(world_size)
        ]
        intra = torch.get_num_threads()
        # one intra-op thread, as each gloo pool worker has: the ranks' kernels then reduce in
        # the same order as across processes (the runners agree to the bit) and the rank
        # threads do not oversubscribe the cores
        torch.set_num_threads(1)
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout)
            hung = [r for r, t in enumerate(threads) if t.is_alive()]
            if hung:
                errors = [f"--- rank {r} ---\n{v[1]}" for r, v in enumerate(results) if v is not None and not v[0]]
                err = TimeoutError(
                    f"{getattr(fn, '__name__', fn)} on {world_size} threads: ranks {hung} not finished within "
                    f"{timeout}s (hang?); errors so far: {errors}"
                )
                _mt.ProcessLocalGroup.exception_handle(err)
                _BOXES.fail_all(err)
                for t in threads:
                    t.join(5.0)
                raise err
        finally:
            torch.set_num_threads(intra)
            torch._C._distributed_c10d._set_thread_isolation_mode(False)
            _mt._uninstall_threaded_pg()
            _mt.ProcessLocalGroup.reset()
    errors = [f"--- rank {r} ---\n{v}" for r, (ok, v) in enumerate(results) if not ok]
    if errors:
        raise RuntimeError("rank failure\n" + "\n".join(errors))
    return [v for _, v in results]

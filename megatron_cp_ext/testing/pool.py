"""A persistent pool of gloo worker processes for multi-rank tests.

Spawning ``world_size`` processes and rendezvousing costs seconds; a test grid of hundreds
of cases cannot pay that per case. ``run_on_ranks`` starts one pool per world size on first
use, keeps it for the whole session and ships each case to every worker as a picklable
``(fn, args)``. ``fn(rank, world_size, *args)`` runs with the default process group already
initialised (gloo, CPU). A case that raises on any rank raises in the caller with that rank's
traceback; a case that hangs (mismatched collectives) is killed after ``timeout`` seconds
(counted once the pool is up: starting it is not the case's time) and the pool is rebuilt,
so one bad case cannot wedge the suite.
"""

from __future__ import annotations

import atexit
import os
import queue
import socket
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

__all__ = ["run_on_ranks", "shutdown_pools"]

_POOLS: dict[int, _Pool] = {}
_READY = "ready"
"""What a worker reports once its process group is up (before it takes any case)."""
_START_TIMEOUT = 900.0
"""Seconds a pool may take to start (spawn, import torch, rendezvous) on a loaded machine."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, path: list[str], tasks, results) -> None:
    sys.path[:] = path
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    results.put((rank, True, _READY))
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args = task
        try:
            from megatron_cp_ext.sharding import splits

            splits.clear()  # each task splits its own data: none of an earlier task's splits is its own
            results.put((rank, True, fn(rank, world_size, *args)))
        except BaseException:  # noqa: BLE001 - reported to the driver verbatim
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


_PRELOAD = ["torch", "torch.distributed", "megatron_cp_ext", "megatron.core"]
"""Imported once by the fork server, not by every worker: a pool of 8 starts in well under a
second instead of importing torch 8 times on a 2-core machine (a missing module is skipped)."""


def _context():
    """Fork-server workers: forked from a single-threaded server that has imported only
    :data:`_PRELOAD`, so no thread pool or process group is inherited (unlike a plain fork)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


class _Pool:
    def __init__(self, world_size: int) -> None:
        ctx = _context()
        self.world_size = world_size
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        port = _free_port()
        self.procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, port, list(sys.path), self.tasks[r], self.results),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()
        self._await_ready()

    def _await_ready(self) -> None:
        """Wait until every worker has imported torch and joined the process group.

        Spawning and rendezvous take seconds, minutes on a loaded machine; counted against a
        case's ``timeout`` they would make the first case of each world size look hung."""
        ready, deadline = 0, time.monotonic() + _START_TIMEOUT
        while ready < self.world_size:
            try:
                rank, ok, value = self.results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    self.close()
                    why = f"worker ranks {dead} died" if dead else f"not up within {_START_TIMEOUT}s"
                    raise RuntimeError(f"pool of {self.world_size}: {why} while starting") from None
                continue
            assert ok and value == _READY, f"rank {rank} sent {value!r} before it was ready"
            ready += 1

    def run(self, fn: Callable, args: tuple, timeout: float) -> list[Any]:
        for q in self.tasks:
            q.put((fn, args))
        out: list[Any] = [None] * self.world_size
        errors: list[str] = []
        deadline = time.monotonic() + timeout
        for _ in range(self.world_size):
            while True:
                try:
                    rank, ok, value = self.results.get(timeout=1.0)
                    break
                except queue.Empty:
                    dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                    if dead or time.monotonic() > deadline:
                        why = f"worker ranks {dead} died" if dead else f"not finished within {timeout}s (hang?)"
                        raise TimeoutError(
                            f"{getattr(fn, '__name__', fn)} on {self.world_size} ranks: {why}; errors so far: {errors}"
                        ) from None
            if ok:
                out[rank] = value
            else:
                errors.append(f"--- rank {rank} ---\n{value}")
        if errors:
            raise RuntimeError("worker failure\n" + "\n".join(errors))
        return out

    def close(self) -> None:
        for q in self.tasks:
            try:
                q.put(None)
            except Exception:  # noqa: BLE001
                pass
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()


def run_on_ranks(world_size: int, fn: Callable, *args: Any, timeout: float = 300.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on every rank of a persistent gloo pool.

    Returns the per-rank return values (which must be picklable; return CPU tensors).
    """
    pool = _POOLS.get(world_size)
    if pool is None or not all(p.is_alive() for p in pool.procs):
        if pool is not None:
            pool.close()
        pool = _POOLS[world_size] = _Pool(world_size)
    try:
        return pool.run(fn, args, timeout)
    except TimeoutError:
        pool.close()
        del _POOLS[world_size]
        raise


def shutdown_pools() -> None:
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


atexit.register(shutdown_pools)

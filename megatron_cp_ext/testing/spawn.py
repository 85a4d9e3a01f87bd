"""Start ``world`` local ranks with a default process group (examples and benchmarks)."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["spawn_ranks", "bench_main"]


def _entry(rank: int, world: int, port: int, backend: str, fn: Callable, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group(backend, rank=rank, world_size=world)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def spawn_ranks(fn: Callable, world: int, *args: Any, backend: str = "gloo") -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned processes (``fn`` must be picklable)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_entry, args=(world, port, backend, fn, args), nprocs=world)


def bench_main(fn: Callable, description: str, iters: int) -> None:
    """The shared command line of the multi-rank CPU/GPU benchmarks: parse it, then run
    ``fn(rank, world, args)`` on ``--world-size`` spawned ranks (gloo, or NCCL for cuda)."""
    import argparse

    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--seqlens", default="1024,255,1,600,0,97")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--iters", type=int, default=iters)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = p.parse_args()
    spawn_ranks(fn, args.world_size, args, backend="gloo" if args.device == "cpu" else "nccl")

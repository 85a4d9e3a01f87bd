"""Caches that decide whether a rank exchanges must hand every thread the same object.

The in-process runner's ranks are threads of one process. When two of them built the cached
dual-chunk sharding (bshd/sbhd) or a sharding's agreement state at the same moment, each kept
its own, so one rank later found its signature agreed and skipped the exchange its peer
entered: an intermittent hang of ``test_data_split_check.py``. Both threads are held inside
the construction here, so the race happens every time.
"""

from __future__ import annotations

import threading

import megatron_cp_ext as mcx
from megatron_cp_ext import attention
from megatron_cp_ext.sharding import seq_layout


def _both_at_once(fn) -> list:
    """``fn()`` on two threads, returning what each got."""
    got: list = [None, None]
    errors: list = []

    def worker(i: int) -> None:
        try:
            got[i] = fn()
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and not any(t.is_alive() for t in threads), errors
    return got


def _held_inside(monkeypatch, module, name: str) -> None:
    """Make ``module.name`` wait until both threads are inside it (once per thread)."""
    barrier, real, seen = threading.Barrier(2), getattr(module, name), threading.local()

    def held(*args, **kwargs):
        if not getattr(seen, "done", False):
            seen.done = True
            barrier.wait(timeout=10)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, held)


def test_threads_get_one_dual_chunk_sharding(monkeypatch) -> None:
    monkeypatch.setattr(seq_layout, "_SEQ_SHARDINGS", {})
    _held_inside(monkeypatch, seq_layout, "shard_sequences")
    a, b = _both_at_once(lambda: seq_layout.fixed_length_sharding(3, 20, 2, "sbhd"))
    assert a is b


def test_threads_get_one_agreement_state(monkeypatch) -> None:
    sharding = mcx.shard_sequences([0, 7, 40], 2)
    _held_inside(monkeypatch, attention.zlib, "crc32")
    a, b = _both_at_once(lambda: attention._fingerprint(sharding))
    assert a is b and a is attention._fingerprint(sharding)

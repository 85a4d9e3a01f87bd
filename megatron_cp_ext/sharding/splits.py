"""The splits this process gave data, remembered per micro-batch, so a layer can tell when it
would attend with another one.

Which CP rank holds which tokens is decided twice: when a micro-batch's data is split, and when
its attention is planned. Megatron hands a layer only ``cu_seqlens``; a layer that derives its
split from them (TransformerEngine's split for a plain ``PackedSeqParams``) while the data got
another one computes on tokens its rank does not hold, at full speed and without an error.

So every split the package performs or receives is recorded here, keyed by the CP size and the
``cu_seqlens`` values it splits: :meth:`CPSharding.shard` (the data split itself, which
``shard_batch_for_cp`` uses) and a :class:`CPSharding` unpickled in this process (a data-loader
worker split the batch). A record is a fingerprint of the token -> rank assignment (canonical
segments: a split cut into more rows is the same split) with a short description, never the
sharding itself (its plans may hold device memory); the last :data:`KEEP` keys are kept.
:func:`recorded` answers in a dict lookup; :func:`generation` lets a caller skip the lookup
while nothing new was recorded. Host values only: no device work, no collective.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

CPSharding = Any
"""A :class:`megatron_cp_ext.CPSharding` (not imported: :mod:`.sharding` imports this module)."""

__all__ = [
    "Split", "KEEP", "layout_of", "record", "recorded", "generation", "clear", "describe", "first_difference",
    "mismatch", "disagreement",
]  # fmt: skip

KEEP = 1024
"""Micro-batches (distinct ``(CP size, cu_seqlens)``) remembered: far more than a data loader
splits ahead of the layers (a few kilobytes each)."""


@dataclass(frozen=True, eq=False)
class Split:
    """One token -> rank assignment, canonical: per rank its non-empty segments in local order,
    touching segments of one sequence merged."""

    fingerprint: bytes
    balance: str
    counts: tuple[int, ...]
    seg: np.ndarray
    """``[S, 3]`` ``(seq, start, end)``, rank after rank."""
    ptr: np.ndarray
    """``[cp + 1]``: rank r's rows are ``seg[ptr[r]:ptr[r + 1]]``."""


_LOCK = threading.Lock()
_RECENT: OrderedDict[tuple, dict[bytes, Split]] = OrderedDict()
_RANKS: dict[tuple, set[int] | None] = {}
"""Per ``(key, fingerprint)``: the CP ranks whose tokens this process took with
:meth:`CPSharding.shard`, or None when a split arrived whole (unpickled: any rank's data)."""
_GEN = [0]


def _canonical(sharding: CPSharding) -> tuple[np.ndarray, np.ndarray]:
    rows, ptr = [], [0]
    for r in range(sharding.cp_size):
        seg = sharding.rank_segments(r)
        seg = seg[seg[:, 2] > seg[:, 1]]
        if len(seg):
            joins = (seg[1:, 0] == seg[:-1, 0]) & (seg[1:, 1] == seg[:-1, 2])
            head = np.concatenate([[True], ~joins])
            last = np.append(np.nonzero(head)[0][1:], len(seg)) - 1
            seg = np.stack([seg[head, 0], seg[head, 1], seg[last, 2]], axis=1)
        rows.append(seg)
        ptr.append(ptr[-1] + len(seg))
    return np.concatenate(rows).astype(np.int64).reshape(-1, 3), np.asarray(ptr, dtype=np.int64)


def layout_of(sharding: CPSharding) -> Split:
    """The canonical split of ``sharding`` (computed once per sharding object)."""
    split = sharding._cache.get("split")
    if split is None:
        seg, ptr = _canonical(sharding)
        digest = hashlib.blake2b(digest_size=16)
        for part in (np.asarray([sharding.cp_size], dtype=np.int64), ptr, seg):
            digest.update(part.tobytes())
        split = sharding._cache["split"] = Split(
            fingerprint=digest.digest(), balance=sharding.balance, counts=tuple(sharding.counts()), seg=seg, ptr=ptr
        )
    return split


def _key(cu_seqlens, cp_size: int) -> tuple:
    return (int(cp_size), tuple(int(c) for c in cu_seqlens))


def record(sharding: CPSharding, rank: int | None = None) -> None:
    """Remember that data described by ``sharding.cu_seqlens`` was split by ``sharding``
    (``rank``: the CP rank whose tokens were taken; None: a whole split, any rank's)."""
    if sharding.cp_size < 2:  # one rank holds everything, in order: nothing to disagree on
        return
    split = layout_of(sharding)
    key = _key(sharding.cu_seqlens, sharding.cp_size)
    held = (key, split.fingerprint)
    with _LOCK:
        known = _RECENT.get(key)
        if known is not None and split.fingerprint in known:
            _RECENT.move_to_end(key)
            ranks = _RANKS.get(held, set())
            # more ranks only pass more: no new generation. A whole split arriving (rank None)
            # after this process took ranks' tokens itself is a copy of its own (deepcopy, a
            # pickle round trip), not another process's data: the ranks it took stay the record
            if ranks is not None and rank is not None and rank not in ranks:
                _RANKS[held] = ranks | {rank}
            return
        _RECENT.setdefault(key, {})[split.fingerprint] = split
        _RANKS[held] = None if rank is None else {rank}
        _RECENT.move_to_end(key)
        while len(_RECENT) > KEEP:
            old, splits_of = _RECENT.popitem(last=False)
            for fp in splits_of:
                _RANKS.pop((old, fp), None)
        _GEN[0] += 1


def recorded(cu_seqlens, cp_size: int) -> tuple[Split, ...]:
    """The splits recorded for data described by ``cu_seqlens`` at this CP size (oldest first)."""
    with _LOCK:
        known = _RECENT.get(_key(cu_seqlens, cp_size))
        return tuple(known.values()) if known else ()


def generation() -> int:
    """Changes whenever a new split is recorded (a cheap "anything new?" for cached checks)."""
    return _GEN[0]


def clear() -> None:
    """Forget every recorded split: between independent tasks, or where a run changes how it
    splits batches of the same ``cu_seqlens`` (training's split, then evaluation's)."""
    with _LOCK:
        _RECENT.clear()
        _RANKS.clear()
        _GEN[0] += 1


def packed_rows(rows: CPSharding, layer: str, fix: str) -> str | None:
    """The mismatch message when data with the ``cu_seqlens`` of ``rows`` (``b > 1`` equal
    rows of a bshd/sbhd batch as packed sequences) was split in this process by any split: a
    rank's tokens then run sequence by sequence, not row by row in Megatron's layout."""
    gen = generation()
    if rows.cp_size < 2 or rows._cache.get("rows_gen") == gen:
        return None
    data = recorded(rows.cu_seqlens, rows.cp_size)
    if data:
        cu = rows.cu_seqlens
        return (
            f"CP split mismatch: data of {len(cu) - 1} rows of {cu[1]} tokens (CP {rows.cp_size}) was split as "
            f"packed (thd) sequences by {describe(data[-1])}, but the attention layer would use {layer}: a "
            f"rank's rows would hold the sequences' chunks in another order. {fix} (The record is per cu_seqlens: "
            "if that was another batch's thd split, call megatron_cp_ext.sharding.splits.clear() where the data "
            "changes, e.g. before evaluation.)"
        )
    rows._cache["rows_gen"] = gen
    return None


def describe(split: Split) -> str:
    return f"a {split.balance!r} split (tokens per rank {list(split.counts)})"


def first_difference(a: Split, b: Split) -> str:
    """Where two splits of the same batch first differ, in words (the same on every rank)."""
    for r in range(len(a.ptr) - 1):
        sa, sb = a.seg[a.ptr[r] : a.ptr[r + 1]], b.seg[b.ptr[r] : b.ptr[r + 1]]
        if len(sa) != len(sb) or not np.array_equal(sa, sb):
            n = min(len(sa), len(sb))
            i = next((i for i in range(n) if not np.array_equal(sa[i], sb[i])), n)
            return f"CP rank {r}'s segment {i} is {_show(sa, i)} under the first and {_show(sb, i)} under the second"
    return "they agree"


def _show(seg: np.ndarray, i: int) -> str:
    return f"sequence {seg[i][0]} positions {seg[i][1]}-{seg[i][2] - 1}" if i < len(seg) else "nothing more"


def mismatch(data: tuple[Split, ...], layer: str, cu, cp_size: int, mine: Split | None, fix: str) -> str:
    """The split-mismatch message: the data's recorded split(s), the one the layer would use,
    where they first differ, and ``fix`` (what to give the layer)."""
    d = data[-1]
    where = f"; {first_difference(d, mine)}" if mine is not None else ""
    also = f" (and {len(data) - 1} other split(s) of the same cu_seqlens)" if len(data) > 1 else ""
    return (
        f"CP split mismatch: data with these cu_seqlens ({len(cu) - 1} sequences, {cu[-1]} tokens, CP {cp_size}) was "
        f"split by {describe(d)}{also} with megatron_cp_ext (CPSharding.shard, shard_batch_for_cp, or a "
        f"sharding received from a data-loader worker), but the attention layer would use {layer}{where}. {fix} "
        "(The record is per cu_seqlens: a batch cut by index after an earlier micro-batch with the same "
        "cu_seqlens was split another way is refused too; split it with CPSharding.shard, or call "
        "megatron_cp_ext.sharding.splits.clear() where the split changes, e.g. before evaluation.)"
    )


def disagreement(sharding: CPSharding, layer: str, fix: str, rank: int | None = None) -> str | None:
    """The mismatch message when data with ``sharding``'s ``cu_seqlens`` was split (in this
    process) only by other splits than ``sharding``'s, or (``rank``, the attending CP rank) by
    ``sharding`` for other ranks only, else None. ``layer`` says where the attention's split
    came from. A generation compare per call once checked (the hot path)."""
    gen = generation()
    if sharding.cp_size < 2 or sharding._cache.get("checked_gen") == (gen, rank):
        return None
    data = recorded(sharding.cu_seqlens, sharding.cp_size)
    if data:
        mine = layout_of(sharding)
        if all(d.fingerprint != mine.fingerprint for d in data):
            words = f"{describe(mine)}, {layer}"
            return mismatch(data, words, sharding.cu_seqlens, sharding.cp_size, mine, fix)
        with _LOCK:
            held = _RANKS.get((_key(sharding.cu_seqlens, sharding.cp_size), mine.fingerprint))
        if rank is not None and held is not None and rank not in held:
            return (
                f"CP shard mismatch: this process took CP rank(s) {sorted(held)}'s tokens of this micro-batch "
                f"(CPSharding.shard(x, rank)) but attends as CP rank {rank}: shard with the rank in the CP group "
                "(not the global or tensor-parallel rank)"
            )
    sharding._cache["checked_gen"] = (gen, rank)
    return None

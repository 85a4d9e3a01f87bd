"""Which global tokens each CP rank holds, and the exact shard / unshard maps.

A sharding is a list of *segments* per rank: ``(seq, start, end)`` position ranges of one
sequence. A rank's local tokens are its segments concatenated in order. Everything
downstream (plans, schedules) works from these segments, never from one balance's shape,
so any assignment of token ranges to ranks that partitions the batch is valid.

Segments are kept as numpy arrays (a 1M-token batch at cp 64 has tens of thousands of
them); :attr:`CPSharding.segments` gives the readable tuple form. Shardings pickle without
their plan cache, so a data-loader worker can build them ahead of the step. Shape legend:
``T`` global tokens, ``t`` one rank's tokens.

Beside it: TE's THD split (:mod:`.te_layout`), bshd/sbhd as THD rows (:mod:`.seq_layout`), the
split record (:mod:`.splits`), length mixes (:mod:`.batches`); the cut is :mod:`..balance`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

from ..masks import MaskSpec
from ..runtime.validation import INT32_MAX, CPArgumentError, CPArgumentTypeError, as_int, as_ints, as_seq_ids
from . import splits

__all__ = ["Segment", "CPSharding", "shard_sequences", "check_cu_seqlens", "rank_counts", "BALANCES"]

BALANCES = ("workload", "dualchunk", "contiguous")
"""Built-in assignments (``shard_sequences(balance=...)``); the first is the default."""


@dataclass(frozen=True)
class Segment:
    """Positions ``[start, end)`` of sequence ``seq`` (positions restart at 0 per sequence)."""

    seq: int
    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start


def check_cu_seqlens(cu_seqlens: torch.Tensor | Sequence[int], name: str = "cu_seqlens") -> list[int]:
    """Validate prefix sums of sequence lengths and return them as Python ints.

    Must be host data (a CPU tensor or a sequence): planning happens on the host, and pulling
    a device tensor here would hide a host-device sync inside the training step.
    """
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.device.type != "cpu":
            raise CPArgumentError(
                f"{name} must be a CPU tensor (plans are built on the host once per micro-batch); "
                f"got device {cu_seqlens.device}"
            )
        bad = cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype.is_complex or cu_seqlens.dtype == torch.bool
        if cu_seqlens.dim() != 1 or bad:
            raise CPArgumentTypeError(
                f"{name} must be a 1-D integer tensor, got {cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}"
            )
        cu = [int(x) for x in cu_seqlens.tolist()]
    else:
        cu = as_ints(cu_seqlens, name)
    if len(cu) < 1:
        raise CPArgumentError(f"{name} must hold at least one entry (the leading 0)")
    if cu[0] != 0:
        raise CPArgumentError(f"{name} must start at 0, got {cu[0]}")
    if max(cu) > INT32_MAX:  # the kernels' cu_seqlens are int32
        raise CPArgumentError(f"{name} must stay within int32 (the kernels' cu_seqlens), got {max(cu)}")
    head = cu if min(cu) >= 0 else [*cu[: next(i for i, x in enumerate(cu) if x < 0)], -1]  # no int64 overflow
    steps = np.diff(np.asarray(head, dtype=np.int64))
    if (steps < 0).any():
        i = int(np.nonzero(steps < 0)[0][0]) + 1
        raise CPArgumentError(f"{name} must be non-decreasing (lengths >= 0); entry {i} is {cu[i]} < {cu[i - 1]}")
    return cu


@dataclass(eq=False)
class CPSharding:
    """An assignment of every global token to exactly one CP rank.

    Built by :func:`shard_sequences` (or :meth:`from_segments` for custom layouts). The object
    is also the per-micro-batch cache for attention plans: reuse it across layers and the
    backward so the plan is built once.
    """

    cu_seqlens: tuple[int, ...]
    """Global prefix sums of sequence lengths (host ints)."""
    cp_size: int
    """Number of context-parallel ranks."""
    seg: np.ndarray
    """``[S, 3]`` int64 ``(seq, start, end)`` rows, rank after rank, each rank in local order."""
    rank_ptr: np.ndarray
    """``[cp_size + 1]``: rank r's segments are ``seg[rank_ptr[r]:rank_ptr[r + 1]]``."""
    balance: str = "custom"
    """How the segments were chosen (one of :data:`BALANCES`, or "custom")."""
    token_multiple: int = 1
    """The multiple the per-rank token counts were dealt in (:func:`rank_counts`); 1 for custom."""
    muted: frozenset[int] = frozenset()
    """Sequences whose tokens attend nothing, output 0 (TE-layout padding: :mod:`.te_layout`)."""
    _cache: dict = field(default_factory=dict, init=False, repr=False)  # not init: replace() gets fresh ones
    _plans: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self.seg = np.asarray(self.seg, dtype=np.int64).reshape(-1, 3)
        self.rank_ptr, self.muted = np.asarray(self.rank_ptr, np.int64), as_seq_ids(self.muted, self.num_seqs)
        if len(self.rank_ptr) != self.cp_size + 1:
            raise CPArgumentError(f"segments must list {self.cp_size} ranks, got {len(self.rank_ptr) - 1}")
        _check_partition(self.cu_seqlens, self.seg)

    def __getstate__(self) -> dict:  # plans and device caches stay with the process that built them
        state = dict(self.__dict__)
        state["_cache"], state["_plans"] = {}, {}
        state.pop("segments", None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        splits.record(self)  # a data-loader worker split the batch with it: layers check theirs (.splits)

    # ---- geometry -------------------------------------------------------------------------
    @property
    def num_seqs(self) -> int:
        return len(self.cu_seqlens) - 1

    @property
    def total_tokens(self) -> int:
        return self.cu_seqlens[-1]

    def seq_len(self, seq: int) -> int:
        return self.cu_seqlens[seq + 1] - self.cu_seqlens[seq]

    def _rank(self, rank: int) -> int:
        return as_int(rank, "rank", minimum=0, maximum=self.cp_size - 1)

    def rank_segments(self, rank: int) -> np.ndarray:
        """``[k, 3]`` ``(seq, start, end)`` of ``rank``'s segments in local order (a view)."""
        return self.seg[self.rank_ptr[(r := self._rank(rank))] : self.rank_ptr[r + 1]]

    @cached_property
    def segments(self) -> tuple[tuple[Segment, ...], ...]:
        """Per rank, its position ranges in local order (readable form of :attr:`seg`)."""
        return tuple(tuple(Segment(*map(int, s)) for s in self.rank_segments(r)) for r in range(self.cp_size))

    def num_tokens(self, rank: int) -> int:
        """Tokens rank ``rank`` holds (ranks may differ): every layer checks its inputs against it."""
        counts = self._cache.get("num_tokens")
        if counts is None:
            n, ptr = self.seg[:, 2] - self.seg[:, 1], self.rank_ptr
            counts = self._cache["num_tokens"] = tuple(int(n[ptr[r] : ptr[r + 1]].sum()) for r in range(self.cp_size))
        return counts[self._rank(rank)]

    def counts(self) -> list[int]:
        return [self.num_tokens(r) for r in range(self.cp_size)]

    def _expand(self, rank: int, base: np.ndarray) -> torch.Tensor:
        """``base[i] + j`` for every token j of segment i, in local order."""
        s = self.rank_segments(rank)
        n = s[:, 2] - s[:, 1]
        idx = np.repeat(base - (np.cumsum(n) - n), n) + np.arange(int(n.sum()), dtype=np.int64)
        with torch.inference_mode(False):  # cached: made in inference mode, no backward could save it
            return torch.from_numpy(idx)

    def global_index(self, rank: int) -> torch.Tensor:
        """Global token index (into the unsharded THD batch) of each of ``rank``'s tokens."""
        key = ("global", rank)
        if key not in self._cache:
            s = self.rank_segments(rank)
            cu = np.asarray(self.cu_seqlens, dtype=np.int64)
            self._cache[key] = self._expand(rank, cu[s[:, 0]] + s[:, 1])
        return self._cache[key]

    def positions(self, rank: int) -> torch.Tensor:
        """Position inside its sequence of each of ``rank``'s tokens (for RoPE)."""
        return self._expand(rank, self.rank_segments(rank)[:, 1].copy())

    def shard(self, x: torch.Tensor, rank: int, dim: int = 0) -> torch.Tensor:
        """Global tokens along ``dim`` -> the tokens ``rank`` holds, in its local order."""
        rank = self._rank(rank)
        if not isinstance(x, torch.Tensor):
            raise CPArgumentTypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        dim = as_int(dim, "dim", minimum=-max(x.dim(), 1), maximum=max(x.dim(), 1) - 1)
        if x.shape[dim] != self.total_tokens:
            raise CPArgumentError(
                f"x has {x.shape[dim]} tokens along dim {dim}, cu_seqlens describe {self.total_tokens}"
            )
        splits.record(self, rank)  # the data split itself: a layer that would use another one refuses
        return x.index_select(dim, self.global_index(rank).to(x.device))

    def unshard(self, xs: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
        """Exact inverse of :meth:`shard`: per-rank tensors (in rank order) -> global tokens."""
        if len(xs) != self.cp_size:
            raise CPArgumentError(f"unshard needs one tensor per rank ({self.cp_size}), got {len(xs)}")
        dim = as_int(dim, "dim", minimum=-max(xs[0].dim(), 1), maximum=max(xs[0].dim(), 1) - 1)
        for r, x in enumerate(xs):
            if x.shape[dim] != self.num_tokens(r):
                raise CPArgumentError(
                    f"rank {r}'s tensor has {x.shape[dim]} tokens, the sharding gives it {self.num_tokens(r)}"
                )
        cat = torch.cat(list(xs), dim=dim)
        idx = torch.cat([self.global_index(r) for r in range(self.cp_size)]).to(cat.device)
        return torch.empty_like(cat).index_copy_(dim, idx, cat)

    # ---- construction ---------------------------------------------------------------------
    @classmethod
    def from_segments(
        cls, cu_seqlens: torch.Tensor | Sequence[int], segments: Sequence[Sequence[Segment | tuple[int, int, int]]]
    ) -> CPSharding:
        """A custom layout: ``segments[r]`` lists rank r's ``(seq, start, end)`` ranges."""
        cu = check_cu_seqlens(cu_seqlens)
        per_rank = [np.asarray([_segment(s, r) for s in segs], dtype=np.int64).reshape(-1, 3)
                    for r, segs in enumerate(segments)]  # fmt: skip
        return cls._of(cu, per_rank, "custom")

    @classmethod
    def _of(cls, cu: list[int], per_rank: list[np.ndarray], balance: str, token_multiple: int = 1) -> CPSharding:
        ptr = np.concatenate([[0], np.cumsum([len(p) for p in per_rank])])
        seg = np.concatenate(per_rank) if per_rank else np.zeros((0, 3), np.int64)
        return cls(cu_seqlens=tuple(cu), cp_size=len(per_rank), seg=seg, rank_ptr=ptr, balance=balance,
                   token_multiple=token_multiple)  # fmt: skip


def _segment(s: Segment | Sequence[int], rank: int) -> tuple[int, int, int]:
    """A segment with strictly integer fields (a float position would index the wrong token)."""
    fields = (s.seq, s.start, s.end) if isinstance(s, Segment) else tuple(s)
    if len(fields) != 3:
        raise CPArgumentError(f"segments[{rank}] entries must be (seq, start, end), got {s!r}")
    return tuple(as_int(x, f"segments[{rank}] entry {s!r}") for x in fields)


def _check_partition(cu: Sequence[int], seg: np.ndarray) -> None:
    """Every token of every sequence in exactly one segment (vectorised: sort and compare)."""
    cu_a = np.asarray(cu, dtype=np.int64)
    seq, start, end = seg[:, 0], seg[:, 1], seg[:, 2]
    nseq = len(cu_a) - 1
    bad = (seq < 0) | (seq >= nseq) | (start < 0) | (start > end)
    if not bad.any():
        bad = end > (cu_a[1:] - cu_a[:-1])[seq]
    if bad.any():
        i = int(np.nonzero(bad)[0][0])
        raise CPArgumentError(f"segment {tuple(int(x) for x in seg[i])} lies outside its sequence")
    keep = end > start
    seq, start, end = seq[keep], start[keep], end[keep]
    order = np.lexsort((start, seq))
    seq, start, end = seq[order], start[order], end[order]
    lens = cu_a[1:] - cu_a[:-1]
    first = np.ones(len(seq), dtype=bool)
    first[1:] = seq[1:] != seq[:-1]
    prev_end = np.concatenate([[0], end[:-1]])
    ok = np.where(first, start == 0, start == prev_end)
    last = np.append(first[1:], True)
    ok &= ~last | (end == lens[seq])
    covered = np.zeros(nseq, dtype=bool)
    covered[seq] = True
    if not ok.all() or not (covered | (lens == 0)).all():
        raise CPArgumentError("segments must cover every token of every sequence exactly once")


def _dealt(prefix: np.ndarray, cp: int, m: int) -> np.ndarray:
    """``[len(prefix), cp]``: how many of the first ``prefix`` global tokens rank r is dealt when
    blocks of ``m`` consecutive tokens go to ranks 0, 1, ..., cp-1, 0, 1, ... in turn."""
    prefix = np.asarray(prefix, dtype=np.int64)[:, None]
    r = np.arange(cp, dtype=np.int64)[None, :]
    return prefix // (cp * m) * m + np.clip(prefix % (cp * m) - r * m, 0, m)


def rank_counts(total: int, cp_size: int, token_multiple: int = 1) -> list[int]:
    """Tokens every balance gives each rank: ``total`` dealt in blocks of ``token_multiple``.

    With ``q = total // m`` blocks, rank r gets ``q // cp`` blocks plus one if ``r < q % cp``; the last
    ``total % m`` tokens (only when ``total`` is not a multiple of ``m``) go to rank ``q % cp``, which
    holds one block fewer than the ranks before it. So every count is a multiple of ``m`` except that
    one, counts differ by at most ``m``, and no rank is empty while ``total >= cp * m``."""
    cp, m = as_int(cp_size, "cp_size", minimum=1), as_int(token_multiple, "token_multiple", minimum=1)
    return [int(c) for c in _dealt(np.asarray([as_int(total, "total", minimum=0)]), cp, m)[0]]


def _shares(lens: np.ndarray, cp: int, m: int) -> np.ndarray:
    """``[nseq, cp]`` tokens of every sequence that rank r holds: :func:`rank_counts`'s deal over
    the global token order, so every sequence splits within ``m`` and each rank's total is its count."""
    cu = np.concatenate([[0], np.cumsum(lens)])
    return np.diff(_dealt(cu, cp, m), axis=0)


def _cut_table(sizes: np.ndarray) -> np.ndarray:
    """``[nseq, pieces + 1]`` cut points from ``[nseq, pieces]`` piece sizes."""
    return np.concatenate([np.zeros((len(sizes), 1), np.int64), np.cumsum(sizes, axis=1)], axis=1)


def _take(lens_cuts: np.ndarray, c: int) -> np.ndarray:
    """Segments of chunk ``c`` of every sequence, empty ones dropped."""
    s, e = lens_cuts[:, c], lens_cuts[:, c + 1]
    seq = np.arange(len(s), dtype=np.int64)
    keep = e > s
    return np.stack([seq[keep], s[keep], e[keep]], axis=1)


def _dualchunk(lens: np.ndarray, cp: int, m: int) -> list[np.ndarray]:
    """Per rank segments of the dual-chunk split: chunks r and ``2 cp - 1 - r`` of every
    sequence, the rank's shares of :func:`_shares` halved."""
    shares = _shares(lens, cp, m)
    firsts = shares // 2
    cuts = _cut_table(np.concatenate([firsts, (shares - firsts)[:, ::-1]], axis=1))
    return [np.concatenate([_take(cuts, r), _take(cuts, 2 * cp - 1 - r)]) for r in range(cp)]


def _contiguous(lens: np.ndarray, cp: int, m: int) -> list[np.ndarray]:
    """Per rank segments: slice r of every sequence, the shares of :func:`_shares`."""
    cuts = _cut_table(_shares(lens, cp, m))
    return [_take(cuts, r) for r in range(cp)]


def _in_order(lens: np.ndarray, counts: list[int]) -> list[np.ndarray]:
    """Per rank segments of the batch cut in its packed order: rank r holds the ``counts[r]``
    tokens that follow rank r - 1's (whole documents, and at most two cut ones)."""
    cu = np.concatenate([[0], np.cumsum(lens)])
    edges = np.concatenate([[0], np.cumsum(counts)])
    out = []
    for a, b in zip(edges[:-1], edges[1:], strict=True):
        seq = np.arange(np.searchsorted(cu, a, "right") - 1, np.searchsorted(cu, b, "left"), dtype=np.int64)
        s, e = np.maximum(a, cu[seq]) - cu[seq], np.minimum(b, cu[seq + 1]) - cu[seq]
        keep = e > s
        out.append(np.stack([seq[keep], s[keep], e[keep]], axis=1).reshape(-1, 3))
    return out


def _even_work(lens: np.ndarray, cp: int, m: int, mask: MaskSpec) -> list[np.ndarray]:
    """The split whose per-rank work is even by construction, ``workload``'s reference.

    Dual-chunk in general. Under a full mask (no causality, window or chunks) a token's work
    is its document's length wherever it sits, so the contiguous split, with the very same
    shares and therefore the same work per rank, does it with one piece per document instead
    of two: half the ragged tiles, and a rank's rows of a step stay one slice even where a
    short document leaves some ranks without tokens of it (dual-chunk's fronts-then-backs
    layout then needs gathered rows)."""
    full = not mask.causal and mask.left < 0 and mask.right < 0 and mask.chunk is None
    return _contiguous(lens, cp, m) if full else _dualchunk(lens, cp, m)


def shard_sequences(
    cu_seqlens: torch.Tensor | Sequence[int],
    cp_size: int,
    balance: str = "workload",
    *,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    chunk_size: int | None = None,
    token_multiple: int = 1,
) -> CPSharding:
    """Assign every token of a packed batch to a CP rank, the same number to every rank.

    Every balance gives rank r exactly ``rank_counts(T, cp_size, token_multiple)[r]`` tokens:
    a multiple of ``token_multiple`` (Megatron's sequence parallelism needs its TP size
    here), except that when ``T`` itself is not a multiple, rank ``(T // token_multiple) %
    cp_size`` also takes the last ``T % token_multiple`` tokens; counts differ by at most
    ``token_multiple`` and no rank is empty while ``T >= cp_size * token_multiple``. A layer's
    linear work follows tokens, so equal counts are what makes one sharding serve a whole layer.

    ``workload`` (default): the mask's units (documents, chunks) sorted by density and split
    dual-chunk fashion as one stream, so that per-rank attention work under the mask
    (``causal``, ``window_size``, ``chunk_size`` — the mask decides the work) is balanced at
    equal tokens; documents stay whole except at the (at most two per rank) cuts, which sit at
    multiples of 128 positions where that costs nothing. See :mod:`.workload`.
    ``dualchunk``: each sequence is cut into ``2*cp_size`` near-equal chunks (sizes adjusted
    by at most ``token_multiple`` so the counts come out exact); rank r holds chunks r and
    ``2*cp_size-1-r`` of every sequence (all first chunks in sequence order, then all second
    ones, so each step's rows are slices). ``contiguous``: rank r holds slice r of ``cp_size``
    near-equal slices of every sequence. Any lengths >= 0 are allowed. Deterministic and
    host-only: every rank computes the same sharding without communicating.
    """
    cu = check_cu_seqlens(cu_seqlens)
    cp_size = as_int(cp_size, "cp_size", minimum=1)
    token_multiple = as_int(token_multiple, "token_multiple", minimum=1)
    if not isinstance(balance, str) or balance not in BALANCES:
        raise CPArgumentError(f"balance must be one of {BALANCES}, got {balance!r}")
    mask = MaskSpec.make(causal=causal, window_size=window_size, chunk_size=chunk_size)
    lens = np.diff(np.asarray(cu, dtype=np.int64))
    if cp_size == 1:
        seq = np.nonzero(lens)[0]
        return CPSharding._of(cu, [np.stack([seq, seq * 0, lens[seq]], axis=1)], balance, token_multiple)
    if balance == "workload":
        from ..balance.pick import References, pick

        counts = rank_counts(cu[-1], cp_size, token_multiple)
        refs = References(
            contiguous=lambda: _contiguous(lens, cp_size, token_multiple), in_order=lambda: _in_order(lens, counts)
        )
        per_rank = pick(lens, counts, mask, lambda: _even_work(lens, cp_size, token_multiple, mask), refs)
        return CPSharding._of(cu, per_rank, balance, token_multiple)
    if balance == "dualchunk":
        per_rank = _dualchunk(lens, cp_size, token_multiple)
    else:
        per_rank = _contiguous(lens, cp_size, token_multiple)
    return CPSharding._of(cu, per_rank, balance, token_multiple)

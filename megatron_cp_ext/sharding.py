"""Which global tokens each CP rank holds, and the exact shard / unshard maps.

A sharding is a list of *segments* per rank: ``(seq, start, end)`` position ranges of one
sequence. A rank's local tokens are its segments concatenated in order. Everything
downstream (plans, schedules) works from these segments, never from the dual-chunk shape,
so any assignment of token ranges to ranks that partitions the batch is valid.

Shape legend: ``T`` global tokens, ``t`` one rank's tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .validation import CPArgumentError, CPArgumentTypeError, as_int, as_ints

__all__ = ["Segment", "CPSharding", "shard_sequences", "check_cu_seqlens"]

BALANCES = ("dualchunk", "contiguous")


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
    a device tensor here would hide a host-device sync inside the training step. Entries must
    be integers: ``10.5`` (or ``10.0``) is refused, never truncated.
    """
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.device.type != "cpu":
            raise CPArgumentError(
                f"{name} must be a CPU tensor (plans are built on the host once per micro-batch); "
                f"got device {cu_seqlens.device}"
            )
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype.is_complex:
            raise CPArgumentTypeError(
                f"{name} must be a 1-D integer tensor, got {cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}"
            )
        if cu_seqlens.dtype == torch.bool:
            raise CPArgumentTypeError(f"{name} must be a 1-D integer tensor, got {cu_seqlens.dtype}")
        cu = [int(x) for x in cu_seqlens.tolist()]
    else:
        cu = as_ints(cu_seqlens, name)
    if len(cu) < 1:
        raise CPArgumentError(f"{name} must hold at least one entry (the leading 0)")
    if cu[0] != 0:
        raise CPArgumentError(f"{name} must start at 0, got {cu[0]}")
    for i in range(1, len(cu)):
        if cu[i] < cu[i - 1]:
            raise CPArgumentError(
                f"{name} must be non-decreasing (sequence lengths >= 0); entry {i} is {cu[i]} < {cu[i - 1]}"
            )
    return cu


def _segment(s: Segment | Sequence[int], rank: int) -> Segment:
    """A segment with strictly integer fields (a float position would index the wrong token)."""
    fields = (s.seq, s.start, s.end) if isinstance(s, Segment) else tuple(s)
    if len(fields) != 3:
        raise CPArgumentError(f"segments[{rank}] entries must be (seq, start, end), got {s!r}")
    return Segment(*(as_int(x, f"segments[{rank}] entry {s!r}") for x in fields))


def _even_cuts(length: int, pieces: int) -> list[int]:
    """Cut points of ``length`` into ``pieces`` parts whose sizes differ by at most one."""
    return [(i * length) // pieces for i in range(pieces + 1)]


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
    segments: tuple[tuple[Segment, ...], ...]
    """Per rank, its position ranges in local order."""
    balance: str = "custom"
    """How the segments were chosen ("dualchunk", "contiguous" or "custom")."""
    _global_index: list[torch.Tensor] = field(default_factory=list, repr=False)
    _plans: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if len(self.segments) != self.cp_size:
            raise ValueError(f"segments must list {self.cp_size} ranks, got {len(self.segments)}")
        covered = torch.zeros(self.cu_seqlens[-1], dtype=torch.int32)
        for r, segs in enumerate(self.segments):
            rows = []
            for s in segs:
                n = self.seq_len(s.seq) if 0 <= s.seq < self.num_seqs else -1
                if n < 0 or not 0 <= s.start <= s.end <= n:
                    raise ValueError(f"segment {s} of rank {r} lies outside its sequence")
                base = self.cu_seqlens[s.seq]
                rows.append(torch.arange(base + s.start, base + s.end, dtype=torch.long))
            idx = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)
            covered.index_add_(0, idx, torch.ones_like(idx, dtype=torch.int32))
            self._global_index.append(idx)
        if not bool((covered == 1).all()):
            raise ValueError("segments must cover every token of every sequence exactly once")

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

    def num_tokens(self, rank: int) -> int:
        """Number of tokens rank ``rank`` holds (ranks may differ)."""
        return int(self._global_index[self._rank(rank)].numel())

    def counts(self) -> list[int]:
        return [self.num_tokens(r) for r in range(self.cp_size)]

    def global_index(self, rank: int) -> torch.Tensor:
        """Global token index (into the unsharded THD batch) of each of ``rank``'s tokens."""
        return self._global_index[self._rank(rank)]

    def positions(self, rank: int) -> torch.Tensor:
        """Position inside its sequence of each of ``rank``'s tokens (for RoPE)."""
        parts = [torch.arange(s.start, s.end, dtype=torch.long) for s in self.segments[self._rank(rank)]]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)

    # ---- data movement --------------------------------------------------------------------
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
        return x.index_select(dim, self._global_index[rank].to(x.device))

    def unshard(self, xs: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
        """Exact inverse of :meth:`shard`: per-rank tensors (in rank order) -> global tokens."""
        if len(xs) != self.cp_size:
            raise ValueError(f"unshard needs one tensor per rank ({self.cp_size}), got {len(xs)}")
        for r, x in enumerate(xs):
            if x.shape[dim] != self.num_tokens(r):
                raise ValueError(
                    f"rank {r}'s tensor has {x.shape[dim]} tokens, the sharding gives it {self.num_tokens(r)}"
                )
        cat = torch.cat(list(xs), dim=dim)
        idx = torch.cat(self._global_index).to(cat.device)
        return torch.empty_like(cat).index_copy_(dim, idx, cat)

    # ---- construction ---------------------------------------------------------------------
    @classmethod
    def from_segments(
        cls, cu_seqlens: torch.Tensor | Sequence[int], segments: Sequence[Sequence[Segment | tuple[int, int, int]]]
    ) -> CPSharding:
        """A custom layout: ``segments[r]`` lists rank r's ``(seq, start, end)`` ranges."""
        cu = check_cu_seqlens(cu_seqlens)
        segs = tuple(tuple(_segment(s, r) for s in rank) for r, rank in enumerate(segments))
        return cls(cu_seqlens=tuple(cu), cp_size=len(segs), segments=segs)


def shard_sequences(cu_seqlens: torch.Tensor | Sequence[int], cp_size: int, balance: str = "dualchunk") -> CPSharding:
    """Assign every token of a packed batch to a CP rank.

    ``dualchunk``: each sequence is cut into ``2*cp_size`` chunks whose sizes differ by at most
    one; rank r holds chunks r and ``2*cp_size-1-r`` of every sequence, sequences in order, so
    causal work is balanced. ``contiguous``: rank r holds slice r of ``cp_size`` near-equal
    slices of every sequence (balanced for windowed masks; neighbours exchange only halos).
    Any lengths >= 0 are allowed; ranks may hold different token counts.
    """
    cu = check_cu_seqlens(cu_seqlens)
    cp_size = as_int(cp_size, "cp_size", minimum=1)
    if not isinstance(balance, str) or balance not in BALANCES:
        raise CPArgumentError(f"balance must be one of {BALANCES}, got {balance!r}")
    per_rank: list[list[Segment]] = [[] for _ in range(cp_size)]
    for s in range(len(cu) - 1):
        n = cu[s + 1] - cu[s]
        if balance == "dualchunk":
            cuts = _even_cuts(n, 2 * cp_size)
            for r in range(cp_size):
                for c in (r, 2 * cp_size - 1 - r):
                    if cuts[c + 1] > cuts[c]:
                        per_rank[r].append(Segment(s, cuts[c], cuts[c + 1]))
        else:
            cuts = _even_cuts(n, cp_size)
            for r in range(cp_size):
                if cuts[r + 1] > cuts[r]:
                    per_rank[r].append(Segment(s, cuts[r], cuts[r + 1]))
    return CPSharding(
        cu_seqlens=tuple(cu), cp_size=cp_size, segments=tuple(tuple(p) for p in per_rank), balance=balance
    )

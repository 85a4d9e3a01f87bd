"""Mask spec and the decomposition of a (Q range, KV range) pair into flash-expressible blocks.

Masks are defined on global positions inside one sequence (design §1): query at position q
sees key k iff ``(causal => k <= q)``, ``(left >= 0 => k >= q - left)``,
``(right >= 0 and not causal => k <= q + right)`` and ``(chunk => q // chunk == k // chunk)``.

A flash varlen call aligns causal/windows bottom-right per entry and clamps every query's
window to the entry's keys. So a (Q range ``[qs, qe)``, KV range ``[ks, ke)``) pair is one
entry: trim the queries to those that see a key and the keys to those some query sees, and
the band ``q - left <= k <= q + right`` becomes the entry's flash window, shifted by where
the ranges sit (:func:`visible_blocks`). Chunked attention is the same after cutting both
ranges at chunk boundaries.

Beside it in this folder: the same questions on numpy arrays for thousands of range pairs at
once (:mod:`.geometry`) and Megatron's mask names as these flags (:mod:`.names`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import NamedTuple

from ..runtime.validation import as_bool, as_chunk, as_window

__all__ = ["MaskSpec", "Block", "visible_blocks", "flash_visible"]


@dataclass(frozen=True)
class MaskSpec:
    """A normalised attention mask (hashable: it keys plan caches)."""

    causal: bool = True
    """Keys after the query are invisible."""
    left: int = -1
    """Keys more than ``left`` positions before the query are invisible; -1 = unbounded."""
    right: int = -1
    """Keys more than ``right`` positions after the query are invisible; -1 = unbounded.
    Ignored (treated as 0) when ``causal``."""
    chunk: int | None = None
    """Chunked attention: only keys in the same ``chunk``-token chunk are visible."""
    muted: frozenset[int] = frozenset()
    """Sequences that attend nothing (a plan's copy of :attr:`~..sharding.CPSharding.muted`)."""

    @classmethod
    def make(cls, *, causal: bool, window_size: tuple[int, int] = (-1, -1), chunk_size: int | None = None) -> MaskSpec:
        """Validate user arguments strictly (:mod:`.validation`) and build the normalised spec."""
        causal = as_bool(causal, "causal")
        left, right = as_window(window_size)
        if causal and right > 0:  # as TransformerEngine does: said once per call site, not refused
            warnings.warn(
                f"window_size={(left, right)} with a causal mask: keys after the query stay hidden, so the right "
                f"window is ignored (the mask is ({left}, 0)); pass causal=False (Megatron: attn_mask_type "
                "no_mask) for a window that sees ahead",
                stacklevel=3,
            )
        return cls(causal=causal, left=left, right=0 if causal else right, chunk=as_chunk(chunk_size))

    @property
    def upper(self) -> int | None:
        """How far after the query keys stay visible (None = unbounded)."""
        return 0 if self.causal else (None if self.right < 0 else self.right)

    @property
    def lower(self) -> int | None:
        """How far before the query keys stay visible (None = unbounded)."""
        return None if self.left < 0 else self.left

    def visible(self, q: int, k: int) -> bool:
        """Whether position q sees position k of the same sequence (the definition)."""
        up, lo = self.upper, self.lower
        if up is not None and k > q + up:
            return False
        if lo is not None and k < q - lo:
            return False
        return self.chunk is None or q // self.chunk == k // self.chunk


class Block(NamedTuple):
    """Queries ``[qs, qe)`` against keys ``[ks, ke)`` of one sequence, as one flash entry.

    ``causal``/``window`` are the flash arguments (bottom-right aligned, window entries >= 0
    or -1, ``causal`` iff the right window is 0) that make the entry exact. Every query of
    the block sees at least one key.
    """

    qs: int
    qe: int
    ks: int
    ke: int
    causal: bool
    window: tuple[int, int]


def _band_block(qs: int, qe: int, ks: int, ke: int, lo: int | None, up: int | None) -> list[Block]:
    """The band ``q - lo <= k <= q + up`` (None = unbounded) inside the ranges, as one entry.

    Trim the queries to those that see a key and the keys to those some query sees; the band
    is then flash's window ``(left, right)`` of the entry: query i (global ``a + i``) sees
    local keys ``[i + c - left, i + c + right]`` with ``c = sk - sq``, clamped to the entry.
    """
    a = qs if up is None else max(qs, ks - up)
    b = qe if lo is None else min(qe, ke + lo)
    k0 = ks if lo is None else max(ks, a - lo)
    k1 = ke if up is None else min(ke, b + up)
    if a >= b or k0 >= k1:
        return []
    sq, sk = b - a, k1 - k0
    c = sk - sq
    left = -1 if lo is None or (sq - 1) + c - (lo + k1 - b) <= 0 else lo + k1 - b
    right = -1 if up is None or c + (up + b - k1) >= sk - 1 else up + b - k1
    return [Block(a, b, k0, k1, right == 0, (left, right))]


def visible_blocks(mask: MaskSpec, qs: int, qe: int, ks: int, ke: int) -> list[Block]:
    """Exact cover of the visible pairs of ``[qs, qe) x [ks, ke)`` by flash-expressible blocks:
    one per chunk the ranges share (one in all without chunks)."""
    if mask.chunk is None:
        return _band_block(qs, qe, ks, ke, mask.lower, mask.upper)
    c = mask.chunk
    out: list[Block] = []
    if qs >= qe or ks >= ke:
        return out
    for n in range(max(qs // c, ks // c), min((qe - 1) // c, (ke - 1) // c) + 1):
        a, b = n * c, (n + 1) * c
        out += _band_block(max(qs, a), min(qe, b), max(ks, a), min(ke, b), mask.lower, mask.upper)
    return out


def flash_visible(i: int, j: int, sq: int, sk: int, causal: bool, window: tuple[int, int]) -> bool:
    """flash-attn varlen visibility of local key j for local query i in one entry."""
    shift = sk - sq
    left, right = window
    if causal:
        right = 0
    if right >= 0 and j > i + shift + right:
        return False
    return not (left >= 0 and j < i + shift - left)

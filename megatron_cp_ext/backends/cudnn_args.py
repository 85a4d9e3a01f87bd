"""What the cuDNN candidate hands cuDNN's fused attention, computed without cuDNN.

Everything here is plain torch on any device, so CI checks the translation on CPU
(``tests/L0/test_cudnn_args.py``) against the reference contract: the mask bounds, the ragged
offsets and lengths, the bucketed graph dimensions and the lse layouts. :mod:`.cudnn` builds and
runs the graphs from these values.

cuDNN's conventions (cudnn-frontend's graph API, cuDNN >= 9.10.2):

- A varlen batch is a ``[B, H, S, D]`` descriptor whose batch entries start at per-entry
  *ragged offsets* (int64 element offsets, ``B + 1`` of them) and whose valid rows are given by
  per-entry lengths (int32 ``[B, 1, 1, 1]``, with the padding mask on). ``S`` only bounds the
  lengths, and ``B`` only bounds the entries: trailing entries of length 0 are inert. Both are
  rounded up to buckets so that a training run reuses a handful of graphs instead of building
  one per micro-batch (a graph is cached per dimensions).
- The mask is a diagonal band, aligned to the bottom-right corner of each entry: query ``i`` of
  an entry with ``sq`` queries and ``sk`` keys sits on diagonal ``i + sk - sq``; the right bound
  ``r`` masks keys after ``diag + r``; the left bound ``b`` (>= 1) masks keys *at or before*
  ``diag - b``. The contract's flash-style window ``(left, right)`` (keys from ``diag - left``
  to ``diag + right`` visible, -1 open) is therefore ``b = left + 1``, ``r = right``; causal is
  ``r = 0``.
- Softmax stats come back fp32, natural log, ``[T, H, 1]`` token-major; a row that sees no key
  must read as ``-inf`` under the contract whatever sentinel the engine writes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Band", "band", "bucket", "Ragged", "ragged", "contract_lse", "padded_stats", "visible"]


@dataclass(frozen=True, kw_only=True)
class Band:
    """cuDNN's mask arguments for one call."""

    left_bound: int | None
    """``diagonal_band_left_bound`` (keys at or before ``diag - left_bound`` masked); None: open."""
    right_bound: int | None
    """``diagonal_band_right_bound`` (keys after ``diag + right_bound`` masked); None: open."""

    @property
    def bottom_right(self) -> bool:
        """Whether the band is anchored bottom-right (any bound set; with none there is no diagonal)."""
        return self.left_bound is not None or self.right_bound is not None


def band(causal: bool, window: tuple[int, int]) -> Band:
    """The contract's ``(causal, window)`` as cuDNN band bounds (module docstring)."""
    left, right = window
    right = 0 if causal else right
    return Band(left_bound=left + 1 if left >= 0 else None, right_bound=right if right >= 0 else None)


def visible(sq: int, sk: int, b: Band, top_left: bool = False) -> torch.Tensor:
    """``[sq, sk]`` bool: the keys cuDNN's band lets each query of one entry see (its documented
    rule, written out independently of the contract so tests can compare the two); anchored
    top-left (``diag = i``) when ``top_left``, which is the same mask where ``sq == sk``."""
    i, j = torch.arange(sq)[:, None], torch.arange(sk)[None]
    diag = i + (sk - sq if b.bottom_right and not top_left else 0)
    vis = torch.ones(sq, sk, dtype=torch.bool)
    if b.right_bound is not None:
        vis &= j <= diag + b.right_bound
    if b.left_bound is not None:
        vis &= j > diag - b.left_bound
    return vis


def bucket(n: int, floor: int) -> int:
    """``n`` rounded up to a power of two, at least ``floor``: a handful of distinct values over a
    training run. A looser bound costs cuDNN nothing measurable (H200, 128K tokens, causal:
    forward 9.86 ms with the longest entry as the length bound, 9.48 ms with twice it)."""
    return 1 << (max(int(n), floor, 1) - 1).bit_length()


@dataclass(frozen=True)
class Ragged:
    """Per-entry lengths and element offsets of one side (queries or keys) of a call."""

    lengths: torch.Tensor
    """int32 ``[B, 1, 1, 1]``."""
    offsets: tuple[torch.Tensor, ...]
    """int64 ``[B + 1, 1, 1, 1]``, one per row stride asked for (same order)."""


def ragged(cu: torch.Tensor, batch: int, strides: tuple[int, ...]) -> Ragged:
    """``cu`` (``E + 1`` prefix sums, on the device) padded to ``batch + 1`` entries with
    zero-length ones, as lengths and as element offsets ``cu * stride`` for each row stride.
    Device ops only (no host read of ``cu``)."""
    e = cu.numel() - 1
    assert batch >= e, f"bucketed batch {batch} below the call's {e} entries"
    cu = torch.cat([cu, cu[-1:].expand(batch - e)]) if batch > e else cu
    cu64 = cu.to(torch.int64)
    # one product per distinct stride, by a host scalar (a stride tensor would be a host copy)
    rows = {s: (cu64 * s).view(-1, 1, 1, 1) for s in dict.fromkeys(strides)}
    lengths = (cu[1:] - cu[:-1]).to(torch.int32).view(-1, 1, 1, 1)
    return Ragged(lengths=lengths, offsets=tuple(rows[s] for s in strides))


EMPTY_ROW_LSE = -1e30
"""Stats at or below this are a row that saw no key (an engine may write a large negative
sentinel instead of -inf); a real log-sum-exp of finite scores is never that low."""


def contract_lse(stats: torch.Tensor) -> torch.Tensor:
    """cuDNN's ``[T, H, 1]`` stats as the contract's ``[T, H]`` fp32: rows that saw no key
    (``+inf``, ``-inf`` or the sentinel) at ``-inf``; a NaN stays a NaN (bad input is never
    hidden)."""
    lse = stats.view(stats.shape[0], stats.shape[1])
    empty = (lse <= EMPTY_ROW_LSE) | (lse == float("inf"))
    return lse.masked_fill(empty, float("-inf"))


def padded_stats(lse: torch.Tensor, cu: torch.Tensor, batch: int, s: int) -> torch.Tensor:
    """The contract's ``[T, H]`` lse as cuDNN's padded ``[batch, H, s, 1]`` stats (row ``p`` of
    entry ``e`` at ``[e, :, p]``; padding rows 0, never read). Device ops only."""
    t, h = lse.shape
    cu64 = cu.to(torch.int64)
    tok = torch.arange(t, device=lse.device)
    e = torch.searchsorted(cu64[1:], tok, right=True)
    out = lse.new_zeros((batch, s, h), dtype=torch.float32)
    out[e, tok - cu64[e]] = lse.float()
    return out.transpose(1, 2).unsqueeze(-1)

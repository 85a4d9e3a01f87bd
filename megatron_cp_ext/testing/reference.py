"""Dense fp64 attention over whole, unsharded packed sequences: the tests' ground truth.

Independent of everything the CP engine uses (no plan, no varlen kernel semantics): it
builds the full ``[t, t]`` visibility matrix straight from the mask definition of
design §1 and runs a plain softmax in float64.
"""

from __future__ import annotations

import math

import torch

__all__ = ["visibility_matrix", "dense_attention", "entry_band", "ENTRY_WINDOWS", "random_call"]


def entry_band(sq: int, sk: int, causal: bool, window: tuple[int, int]) -> torch.Tensor:
    """``[sq, sk]`` bool: the local kernel contract's visibility inside one varlen entry of
    ``sq`` queries and ``sk`` keys (bottom-right aligned flash window, -1 open; causal: right 0),
    written from its definition for the kernel argument tests."""
    left, right = window[0], 0 if causal else window[1]
    d = torch.arange(sk)[None] - (torch.arange(sq)[:, None] + sk - sq)
    vis = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        vis &= d >= -left
    if right >= 0:
        vis &= d <= right
    return vis


def visibility_matrix(
    cu_seqlens: list[int] | torch.Tensor,
    *,
    causal: bool,
    window_size: tuple[int, int] = (-1, -1),
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Boolean ``[t, t]``: entry (i, j) says whether global query token i sees key token j."""
    cu = [int(x) for x in cu_seqlens]
    total = cu[-1]
    seq = torch.empty(total, dtype=torch.long)
    pos = torch.empty(total, dtype=torch.long)
    for s in range(len(cu) - 1):
        seq[cu[s] : cu[s + 1]] = s
        pos[cu[s] : cu[s + 1]] = torch.arange(cu[s + 1] - cu[s])
    qp, kp = pos[:, None], pos[None, :]
    vis = seq[:, None] == seq[None, :]
    left, right = window_size
    if causal:
        vis &= kp <= qp
    if left >= 0:
        vis &= kp >= qp - left
    if right >= 0 and not causal:
        vis &= kp <= qp + right
    if chunk_size is not None:
        vis &= (qp // chunk_size) == (kp // chunk_size)
    return vis


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: list[int] | torch.Tensor,
    *,
    causal: bool,
    window_size: tuple[int, int] = (-1, -1),
    chunk_size: int | None = None,
    softmax_scale: float | None = None,
    softmax_offset: torch.Tensor | None = None,
) -> torch.Tensor:
    """THD attention ``[t, hq, d] x [t, hkv, d] x [t, hkv, dv] -> [t, hq, dv]`` in float64.

    Differentiable (autograd through plain ops). Queries with no visible key output zeros.
    ``softmax_offset`` ``[hq]``: an attention sink, one extra logit per head with no value (the
    softmax runs over the keys and the sink; the sink's column is then dropped).
    """
    t, hq, d = q.shape
    hkv = k.shape[1]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    q64, k64, v64 = q.double(), k.double(), v.double()
    k64 = k64.repeat_interleave(hq // hkv, dim=1)
    v64 = v64.repeat_interleave(hq // hkv, dim=1)
    vis = visibility_matrix(cu_seqlens, causal=causal, window_size=window_size, chunk_size=chunk_size)
    s = torch.einsum("qhd,khd->hqk", q64, k64) * scale
    s = s.masked_fill(~vis[None], float("-inf"))
    if softmax_offset is not None:
        sink = softmax_offset.double()[:, None, None].expand(hq, t, 1)
        p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :t]
        return torch.einsum("hqk,khd->qhd", p, v64)
    any_vis = vis.any(dim=1)[None, :, None]
    p = torch.softmax(torch.where(any_vis, s, torch.zeros_like(s)), dim=-1)
    p = torch.where(any_vis & vis[None], p, torch.zeros_like(p))
    return torch.einsum("hqk,khd->qhd", p, v64)


ENTRY_WINDOWS = [(-1, -1), (-1, 0), (0, -1), (5, -1), (-1, 3), (4, 2), (0, 0), (70, -1), (-1, 70), (60, 2), (2, 60)]
"""Windows the kernel argument tests draw from: open, causal-like, one- and two-sided, wider
than the entries."""


def random_call(rng, heads: list[tuple[int, int, int, int]]):
    """One random varlen call for the kernel argument tests: ``(lens_q, lens_k, same, causal,
    window, (hq, hk, d, dv))`` with 1-5 entries, lengths 0 and 1 included, query entries longer
    than their key entries and the reverse, or the same entries for both (``same``)."""
    e = rng.randrange(1, 6)
    same = rng.random() < 0.4
    lens_q = [rng.choice([0, 1, 2, 7, 33, 64, 130]) for _ in range(e)]
    lens_k = lens_q if same else [rng.choice([0, 1, 5, 13, 64, 200]) for _ in range(e)]
    causal = rng.random() < 0.5
    window = rng.choice([w for w in ENTRY_WINDOWS if not causal or w[1] in (-1, 0)])
    return lens_q, lens_k, same, causal, window, rng.choice(heads)

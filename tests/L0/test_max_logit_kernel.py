"""The backends' per-call ``max_logit`` (flash varlen semantics: bottom-right aligned causal and
windows per entry) against a direct per-entry computation, whole and in small tiles, grouped
from the offsets or from the call's host entries (as on a GPU), and its memory bounded on a
call of one long entry among many short ones."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_cp_ext.backends import reference


def direct_max_logit(q, k, cu_q, cu_k, causal, window, scale) -> torch.Tensor:
    """Per entry, the bottom-right aligned mask written out row by row, in float64."""
    hq, g = q.shape[1], q.shape[1] // k.shape[1]
    best = torch.full((hq,), float("-inf"), dtype=torch.float64)
    left, right = window[0], (0 if causal else window[1])
    for e in range(len(cu_q) - 1):
        lq, lk = cu_q[e + 1] - cu_q[e], cu_k[e + 1] - cu_k[e]
        for i in range(lq):
            for j in range(lk):
                diag = i + lk - lq
                if (right >= 0 and j > diag + right) or (left >= 0 and j < diag - left):
                    continue
                qi, kj = q[cu_q[e] + i].double(), k[cu_k[e] + j].double().repeat_interleave(g, dim=0)
                best = torch.maximum(best, (qi * kj).sum(-1) * scale)
    return best


def host_entries(cu_q: list[int], cu_k: list[int]) -> np.ndarray:
    """A plan call's ``[E, 4]`` host entries (query rows, key rows) for these offsets."""
    return np.stack([cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:]], axis=1).astype(np.int64)


@pytest.mark.parametrize("tile,scores", [(1024, reference.MAX_LOGIT_SCORES), (3, reference.MAX_LOGIT_SCORES), (3, 1)])
@pytest.mark.parametrize("given", [False, True], ids=["offsets", "entries"])
@pytest.mark.parametrize(
    "causal,window", [(True, (-1, -1)), (False, (-1, -1)), (True, (2, -1)), (False, (1, 3)), (False, (0, 0))]
)
def test_max_logit_matches_direct_computation(monkeypatch, tile: int, scores: int, given: bool, causal, window) -> None:
    monkeypatch.setattr(reference, "MAX_LOGIT_TILE", tile)
    monkeypatch.setattr(reference, "MAX_LOGIT_SCORES", scores)  # 1: a tile per entry
    g = torch.Generator().manual_seed(0)
    cu_q, cu_k = [0, 5, 5, 6, 13], [0, 7, 9, 10, 19]  # sk >= sq per entry (flash-expressible)
    q = torch.randn(cu_q[-1], 6, 4, generator=g)
    k = torch.randn(cu_k[-1], 2, 4, generator=g)
    cq, ck = torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32)
    entries = host_entries(cu_q, cu_k) if given else None
    got = reference.max_logit(q, k, cq, ck, 7, 9, causal, window, 0.7, entries)
    want = direct_max_logit(q, k, cu_q, cu_k, causal, window, 0.7)
    assert got.dtype == torch.float32 and got.shape == (6,)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)


def test_a_call_without_visible_pairs_gives_minus_inf() -> None:
    q, k = torch.randn(3, 2, 4), torch.randn(0, 1, 4)
    cu_q, cu_k = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([0, 0], dtype=torch.int32)
    assert torch.isneginf(reference.max_logit(q, k, cu_q, cu_k, 3, 0, False, (-1, -1), 1.0)).all()


def test_max_logit_memory_is_bounded_by_the_rows(monkeypatch) -> None:
    """One 300-row entry among 200 of 2 rows, grouped from the host entries as on a GPU (no
    offset is read back): the padded query rows stay within twice the call's own (one batch
    padded to the longest entry would hold 201 x 300), every score tile within
    ``MAX_LOGIT_SCORES``, and the max equals a per-entry fp64 computation."""
    monkeypatch.setattr(reference, "MAX_LOGIT_TILE", 64)
    monkeypatch.setattr(reference, "MAX_LOGIT_SCORES", 1 << 14)
    lens = [2] * 100 + [300] + [2] * 100
    cu = np.concatenate([[0], np.cumsum(lens)]).tolist()
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(cu[-1], 4, 8, generator=g), torch.randn(cu[-1], 2, 8, generator=g)
    padded, tiles = [], []
    pad, vis = reference._pad, reference._tile_visibility
    monkeypatch.setattr(reference, "_pad", lambda x, c, w: padded.append(pad(x, c, w).shape[:2]) or pad(x, c, w))
    monkeypatch.setattr(reference, "_tile_visibility", lambda *a: tiles.append(vis(*a).shape) or vis(*a))

    def no_read(*a, **kw):
        raise AssertionError("max_logit read offsets back from the tensors")

    monkeypatch.setattr(torch.Tensor, "tolist", no_read)
    c = torch.tensor(cu, dtype=torch.int32)
    got = reference.max_logit(q, k, c, c, 300, 300, True, (-1, -1), 0.5, host_entries(cu, cu))
    monkeypatch.undo()
    q_rows = sum(e * w for e, w in padded[::2])  # _pad runs for q, then k, per group
    assert q_rows <= 2 * cu[-1], padded
    assert max(e * i * j for e, i, j in tiles) * q.shape[1] <= 1 << 14, tiles
    want = torch.full((4,), float("-inf"), dtype=torch.float64)
    for a, b in zip(cu[:-1], cu[1:], strict=True):
        s = torch.einsum("ihd,jhd->hij", q[a:b].double(), k[a:b].double().repeat_interleave(2, dim=1)) * 0.5
        s = s.masked_fill(~torch.ones(b - a, b - a, dtype=torch.bool).tril(), float("-inf"))
        want = torch.maximum(want, s.amax(dim=(1, 2)))
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)

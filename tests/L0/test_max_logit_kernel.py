"""The backends' per-call ``max_logit`` (flash varlen semantics: bottom-right aligned causal and
windows per entry) against a direct per-entry computation, whole and in small tiles."""

from __future__ import annotations

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


@pytest.mark.parametrize("tile", [1024, 3])
@pytest.mark.parametrize(
    "causal,window", [(True, (-1, -1)), (False, (-1, -1)), (True, (2, -1)), (False, (1, 3)), (False, (0, 0))]
)
def test_max_logit_matches_direct_computation(monkeypatch, tile: int, causal: bool, window) -> None:
    monkeypatch.setattr(reference, "MAX_LOGIT_TILE", tile)
    g = torch.Generator().manual_seed(0)
    cu_q, cu_k = [0, 5, 5, 6, 13], [0, 7, 9, 10, 19]  # sk >= sq per entry (flash-expressible)
    q = torch.randn(cu_q[-1], 6, 4, generator=g)
    k = torch.randn(cu_k[-1], 2, 4, generator=g)
    got = reference.max_logit(
        q, k, torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32), 7, 9, causal, window, 0.7
    )
    want = direct_max_logit(q, k, cu_q, cu_k, causal, window, 0.7)
    assert got.dtype == torch.float32 and got.shape == (6,)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)


def test_a_call_without_visible_pairs_gives_minus_inf() -> None:
    q, k = torch.randn(3, 2, 4), torch.randn(0, 1, 4)
    cu_q, cu_k = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([0, 0], dtype=torch.int32)
    assert torch.isneginf(reference.max_logit(q, k, cu_q, cu_k, 3, 0, False, (-1, -1), 1.0)).all()

"""a2a's backward row term on the GPU (``schedules/delta.py``): ``row_dot`` of 16-bit inputs
is widened by row chunks there, and the stand-in gives that term back."""

from __future__ import annotations

import pytest
import torch

from megatron_cp_ext.schedules import delta
from megatron_cp_ext.schedules.delta import row_dot, stand_in

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


PRECISION = {torch.bfloat16: 2e-5, torch.float16: 2e-6, torch.float32: 2e-7}
"""As ``tests/L1/test_a2a_stand_in.py``: relative to the row's magnitude ``sum_d |a_d * b_d|``."""


@pytest.mark.parametrize("chunk_rows", [None, 1000], ids=["one-chunk", "chunks"])
@pytest.mark.parametrize("dtype", list(PRECISION), ids=str)
def test_row_dot_and_stand_in_on_cuda(dtype, chunk_rows, monkeypatch):
    if chunk_rows is not None:  # 1000-row chunks over 32768 rows: a short last chunk too
        monkeypatch.setattr(delta, "CHUNK_BYTES", 4 * 128 * chunk_rows)
    g = torch.Generator(device="cuda").manual_seed(0)
    a, b = (torch.randn(4096, 8, 128, generator=g, device="cuda").to(dtype) for _ in range(2))
    got = row_dot(a, b)
    want = (a.double() * b.double()).sum(-1)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    x = stand_in(a, got)
    back = (a.double() * x.double()).sum(-1)
    scale = (a.double() * b.double()).abs().sum(-1)
    assert ((back - got.double()).abs() / scale).max() <= PRECISION[dtype]

"""The arguments the flash wrappers hand FlashAttention-2, checked on CPU against the mask the
reference contract means: FA2's own handling of windows (clamp, open side -> ``max_seqlen_k``,
one-query causal) is emulated here, so every (causal, window, lengths) combination must give the
contract's bottom-right visibility exactly. The GPU run measured the case this guards
(``tests/gpu/test_local_kernels.py``, a ``(0, -1)`` call of 50 queries over 13 keys)."""

import itertools
import random

import torch

from megatron_cp_ext.backends import flash
from megatron_cp_ext.testing.reference import entry_band


def _band(sq: int, sk: int, left: int, right: int) -> torch.Tensor:
    """Bottom-right aligned band: key ``j`` visible to query ``i`` within ``left``/``right`` (-1: open)."""
    return entry_band(sq, sk, False, (left, right))


def _contract(sq: int, sk: int, causal: bool, window: tuple[int, int]) -> torch.Tensor:
    return entry_band(sq, sk, causal, window)


def _fa2(sq: int, sk: int, max_q: int, max_k: int, causal: bool, left: int, right: int) -> torch.Tensor:
    """FA2's varlen argument handling (mha_varlen_fwd, set_params_fprop) and its mask."""
    left = -1 if left >= max_k else left
    right = -1 if right >= max_k else right
    if max_q == 1:
        causal = False
    if causal:
        right = 0
    if left < 0 and right >= 0:
        left = max_k
    if left >= 0 and right < 0:
        right = max_k
    return _band(sq, sk, left, right)


def test_wrapper_arguments_give_the_contract_mask() -> None:
    rng = random.Random(0)
    windows = [(-1, -1), (-1, 0), (0, -1), (5, -1), (-1, 3), (4, 2), (0, 0), (70, -1), (-1, 70), (60, 2), (2, 60)]
    for (sq, sk), causal, window in itertools.product([(50, 13), (13, 50), (1, 7), (7, 1), (30, 30)], [True, False],
                                                      windows):  # fmt: skip
        if causal and window[1] not in (-1, 0):
            continue
        max_q, max_k = sq + rng.randrange(3), sk + rng.randrange(3)  # plans pass upper bounds
        q, k = torch.empty(sq, 2, 8), torch.empty(sk, 2, 8)
        left, right, max_q2, max_k2 = flash._kernel_args(q, k, causal, window, max_q, max_k)
        got = _fa2(sq, sk, max_q2, max_k2, causal, left, right)
        assert torch.equal(got, _contract(sq, sk, causal, window)), (sq, sk, causal, window)


def test_only_the_cases_fa2_misreads_are_widened() -> None:
    q, k, kv = torch.empty(50, 8, 64), torch.empty(13, 2, 64), torch.empty(13, 8, 64)
    assert flash._kernel_args(q, k, False, (0, -1), 50, 13) == (0, -1, 50, 63)
    assert flash._kernel_args(q, k, False, (-1, 3), 50, 13) == (-1, 3, 50, 13)
    assert flash._kernel_args(q, k, False, (-1, 20), 50, 13) == (-1, 20, 50, 21)
    assert flash._kernel_args(q, k, True, (8, -1), 50, 13) == (8, 0, 50, 13)
    assert flash._kernel_args(q, k, False, (-1, -1), 50, 13) == (-1, -1, 50, 13)
    # FA2's one-query GQA shortcut is avoided, and only there
    assert flash._kernel_args(q, k, False, (-1, -1), 1, 13)[2] == 2
    assert flash._kernel_args(q, k, True, (-1, -1), 1, 13)[2] == 1  # causal: the general path
    assert flash._kernel_args(q, kv, False, (-1, -1), 1, 13)[2] == 1  # no GQA


def test_rows_that_see_nothing_get_minus_inf() -> None:
    inf = float("inf")
    lse_HN = torch.tensor([[inf, 1.0, -inf], [2.0, inf, 3.0]])
    got = flash._lse_nh(lse_HN)
    assert torch.equal(got, torch.tensor([[-inf, 2.0], [1.0, -inf], [-inf, 3.0]]))
    assert got.is_contiguous(), "the merges' CUDA kernel takes row-major lse only"


def test_backward_is_deterministic_when_torch_asks(monkeypatch) -> None:
    """FA2's backward gets ``deterministic`` from ``torch.use_deterministic_algorithms`` (its
    dQ accumulation otherwise uses atomics: run to run, bits differ). Stub interface: the
    arguments only."""
    import sys
    import types

    seen = []
    interface = types.ModuleType("flash_attn.flash_attn_interface")
    interface._flash_attn_varlen_backward = lambda *args: seen.append(args[20])
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", interface)
    q = k = v = out = dout = torch.zeros(5, 2, 8)
    cu, lse = torch.tensor([0, 5], dtype=torch.int32), torch.zeros(5, 2)
    for flag in (True, False):
        monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda flag=flag: flag)
        flash.fa_bwd(dout, q, k, v, out, lse, cu, cu, 5, 5, True, (-1, -1), 0.5)
    assert seen == [True, False]

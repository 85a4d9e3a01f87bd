"""How many roundings a 16-bit output carries, per comm type: the claim of docs/algorithms.md
("Precision and autocast") against dense fp64 attention over the unsharded batch.

A local kernel returns its output in the input dtype (the GPU kernels have no fp32 output), so
a query row computed by one call is rounded once, as at CP 1, and a row the ring computes in
several calls carries one rounding per call plus the final one. Measured as the rms error of the
output over the rms error of the fp64 result rounded once (1.0: one rounding)."""

import pytest
import torch

from megatron_cp_ext.testing.cases import AttnCase, global_thd, run_case
from megatron_cp_ext.testing.pool import run_on_ranks
from megatron_cp_ext.testing.reference import dense_attention

ONE_CALL = [("all_gather", 0, "staged"), ("a2a", 0, "staged"), ("p2p", 0, "staged")]


def _rounding_ratio(case: AttnCase, world: int) -> float:
    """rms(out - dense) / rms(round(dense) - dense), the output gathered in global order."""
    dtype = getattr(torch, case.dtype)
    q, k, v, _ = (x.to(dtype).double() for x in case.inputs())
    ref = dense_attention(q, k, v, case.cu_seqlens, causal=case.causal)
    got = global_thd(case, [r["out"] for r in run_on_ranks(world, run_case, case)]).double()
    once = ref.to(dtype).double() - ref
    return ((got - ref).pow(2).mean() / once.pow(2).mean()).sqrt().item()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_rows_of_one_call_are_rounded_once(dtype):
    """all_gather, a2a and staged p2p (a row's keys in one call): CP 2 equals CP 1's rounding."""
    base = dict(seqlens=(700, 300), hq=2, hkv=1, d=64, dv=64, dtype=dtype, causal=False)
    single = _rounding_ratio(AttnCase(**base), 1)
    assert single == pytest.approx(1.0, abs=0.02)
    for comm, a2a, schedule in ONE_CALL:
        ratio = _rounding_ratio(AttnCase(**base, comm_type=comm, a2a_size=a2a, p2p_schedule=schedule), 2)
        assert ratio == pytest.approx(single, abs=0.02), (comm, ratio)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_ring_rows_carry_a_rounding_per_call(dtype):
    """The ring merges 16-bit partials in fp32: about 1.4 roundings' worth at CP 2 and 4 on random
    inputs (the bound the docs state is 1.6), more than one (so the docs' statement is needed)."""
    base = dict(seqlens=(1400,), hq=2, hkv=1, d=64, dv=64, dtype=dtype, causal=False, p2p_schedule="ring")
    for world in (2, 4):
        ratio = _rounding_ratio(AttnCase(**base, comm_type="p2p"), world)
        assert 1.2 < ratio < 1.6, (world, ratio)

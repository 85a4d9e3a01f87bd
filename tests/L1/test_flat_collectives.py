"""``all_gather``'s gather and reduce-scatter in their single-tensor forms (``FLAT_COLLECTIVES``:
what runs on CUDA, where NCCL would stage list forms through a flat buffer of its own), forced
here on CPU over gloo and over the in-process runner, against the dense fp64 reference."""

import collections
import contextlib
import threading

import pytest

from megatron_cp_ext.runtime import comm
from megatron_cp_ext.testing.cases import AttnCase, check_case, run_case
from megatron_cp_ext.testing.inproc import run_threads
from megatron_cp_ext.testing.pool import run_on_ranks

CALLS: collections.Counter = collections.Counter()
"""Single-tensor collectives run, by (thread, name)."""


@contextlib.contextmanager
def flat_collectives():
    """Force the single-tensor forms and count them per calling thread (a rank)."""
    plain = comm._single

    def single(name: str, old: str):
        fn = plain(name, old)

        def counted(*a, **kw):
            CALLS[(threading.get_ident(), name)] += 1
            return fn(*a, **kw)

        return counted

    comm._single, comm.FLAT_COLLECTIVES = single, True
    try:
        yield
    finally:
        comm._single, comm.FLAT_COLLECTIVES = plain, None


def _counted_case(rank: int, world: int, case: AttnCase) -> dict:
    res = run_case(rank, world, case)
    me = {name: n for (t, name), n in CALLS.items() if t == threading.get_ident()}
    # forward's gather, backward's gather again, and the dK/dV reduce-scatter
    assert me == {"all_gather_single": 2, "reduce_scatter_single": 1}, me
    return res


def _gloo_case(rank: int, world: int, case: AttnCase) -> dict:
    CALLS.clear()  # a pool worker runs many tasks
    with flat_collectives():
        return _counted_case(rank, world, case)


@pytest.mark.parametrize("runner", ["gloo", "threads"])
@pytest.mark.parametrize("mask", [dict(causal=True), dict(causal=False, window_size=(4, 2))], ids=str)
def test_single_tensor_collectives_match_dense(runner: str, mask: dict) -> None:
    case = AttnCase(seqlens=(13, 0, 1, 30, 7, 2), comm_type="all_gather", hq=4, hkv=2, dtype="float64", **mask)
    CALLS.clear()
    if runner == "gloo":
        results = run_on_ranks(3, _gloo_case, case, timeout=120)
    else:
        with flat_collectives():
            results = run_threads(3, _counted_case, case, timeout=120)
    check_case(results, case)

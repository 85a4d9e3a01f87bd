"""Suite-wide options: the length of the seeded fuzz run (``tests/L1/test_fuzz.py``); every test
starts with no recorded data split (``megatron_cp_ext.sharding.splits``): tests are independent runs;
and every test leaves the kernels and schedule switches that tests swap as it found them."""

import pytest


def pytest_addoption(parser):
    group = parser.getgroup("megatron_cp_ext")
    group.addoption(
        "--fuzz-iters",
        type=int,
        default=None,
        help="random configurations the fuzz test checks against the dense reference "
        "(default: the module's FUZZ_ITERS, sized for CI)",
    )
    group.addoption("--fuzz-seed", type=int, default=0, help="first seed of the fuzz run (default 0)")


def pytest_generate_tests(metafunc):
    if "fuzz_seed" in metafunc.fixturenames:
        n = metafunc.config.getoption("--fuzz-iters")
        n = getattr(metafunc.module, "FUZZ_ITERS", 40) if n is None else n
        first = metafunc.config.getoption("--fuzz-seed")
        metafunc.parametrize("fuzz_seed", range(first, first + n))


@pytest.fixture(autouse=True)
def _fresh_split_record():
    from megatron_cp_ext.sharding import splits

    splits.clear()
    yield


def _swapped_globals() -> dict:
    """What tests swap for stand-ins (kernels, the no-sync guard's methods, schedule switches):
    a swap that outlives its test runs every later test of the session on the stand-in."""
    import torch

    from megatron_cp_ext import schedules
    from megatron_cp_ext.backends import reference
    from megatron_cp_ext.runtime import ops
    from megatron_cp_ext.schedules import common, delta, staged

    return {
        "reference.attn_fwd": reference.attn_fwd, "reference.attn_bwd": reference.attn_bwd,
        "reference._probs": reference._probs, "delta._row_dot16": delta._row_dot16,
        "delta._stand_in16": delta._stand_in16, "common.merge_partial": common.merge_partial,
        "common.gather_rows": common.gather_rows, "common.index_add_rows": common.index_add_rows,
        "staged.gather_rows": staged.gather_rows, "ops.merge_partial_torch": ops.merge_partial_torch,
        "schedules.P2P_SCHEDULE": schedules.P2P_SCHEDULE,
        **{f"Tensor.{n}": getattr(torch.Tensor, n) for n in ("item", "tolist", "cpu", "numpy", "__bool__", "nonzero")},
    }  # fmt: skip


@pytest.fixture(autouse=True)
def _no_leaked_swaps():
    before = _swapped_globals()
    yield
    after = _swapped_globals()
    leaked = sorted(k for k in before if after[k] is not before[k] and after[k] != before[k])
    assert not leaked, f"the test left {leaked} swapped: later tests would run on the stand-in"

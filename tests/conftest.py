"""Suite-wide options: the length of the seeded fuzz run (``tests/L1/test_fuzz.py``); every test
starts with no recorded data split (``megatron_cp_ext.sharding.splits``): tests are independent runs."""

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

"""Seeded fuzz: random valid configurations (world 2–4, lengths 0…48 incl. 0 and 1, every
mask kind, MHA/GQA/MQA/MLA, every comm type and format, fp32/bf16/fp64, built-in and random
custom shardings, explicit scales, check mode) against the dense fp64 reference.

The default run is sized for CI (well under a minute); ``--fuzz-iters N`` (and
``--fuzz-seed S``) run longer, e.g. ``python -m pytest tests/L1/test_fuzz.py --fuzz-iters 2000``.
A failure names its seed: ``--fuzz-seed SEED --fuzz-iters 1`` reproduces it alone.
"""

import pytest

from megatron_cp_ext.testing.cases import check_case, run_case
from megatron_cp_ext.testing.fuzz import random_case
from megatron_cp_ext.testing.pool import run_on_ranks

FUZZ_ITERS = 100
FP64_SEEDS = range(1000, 1024)
"""The same draws pinned to fp64: exact to 1e-10 (fp32 merges or accumulators would show ~1e-7)."""


def test_random_config_matches_dense_reference(fuzz_seed):
    world, case = random_case(fuzz_seed)
    check_case(run_on_ranks(world, run_case, case, timeout=60), case)


@pytest.mark.parametrize("seed", FP64_SEEDS)
def test_fp64_random_config_is_exact(seed):
    world, case = random_case(seed, dtype="float64")
    check_case(run_on_ranks(world, run_case, case, timeout=60), case)

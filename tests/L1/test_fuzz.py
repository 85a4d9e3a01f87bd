"""Seeded fuzz: random valid configurations (world 2–4, lengths 0…48 incl. 0 and 1, every
mask kind, MHA/GQA/MQA/MLA, every comm type and format, fp32/bf16/fp64, built-in and random
custom shardings, explicit scales, check mode) against the dense fp64 reference.

The default run is sized for CI (well under a minute); ``--fuzz-iters N`` (and
``--fuzz-seed S``) run longer, e.g. ``python -m pytest tests/L1/test_fuzz.py --fuzz-iters 2000``.
A failure names its seed: ``--fuzz-seed SEED --fuzz-iters 1`` reproduces it alone.
"""

from megatron_cp_ext.testing.cases import check_case, run_case
from megatron_cp_ext.testing.fuzz import random_case
from megatron_cp_ext.testing.pool import run_on_ranks

FUZZ_ITERS = 100


def test_random_config_matches_dense_reference(fuzz_seed):
    world, case = random_case(fuzz_seed)
    check_case(run_on_ranks(world, run_case, case, timeout=60), case)

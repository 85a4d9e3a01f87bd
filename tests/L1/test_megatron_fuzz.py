"""Seeded fuzz of the Megatron path: random ``TransformerBlock`` configurations (comm type,
heads, windows with full layers mixed in, chunks, 0- and 1-length documents, a pipeline's
own split or the params' attached one) at CP 2/4 equal their CP-1 twin — output, input
gradient and every parameter gradient (:mod:`megatron_cp_ext.testing.megatron_fuzz`).

``--fuzz-iters N`` / ``--fuzz-seed S`` run more seeds (shared with ``test_fuzz.py``); a
failure names its seed.
"""

import pytest

pytest.importorskip("megatron.core")

from megatron_cp_ext.testing.megatron_fuzz import block_case, draw  # noqa: E402
from megatron_cp_ext.testing.pool import run_on_ranks  # noqa: E402

FUZZ_ITERS = 12


def test_random_megatron_block_matches_cp1(fuzz_seed):
    world, cfg = draw(fuzz_seed)
    for rank, errs in enumerate(run_on_ranks(world, block_case, cfg, timeout=300)):
        assert len(errs) > 5, errs.keys()  # output, input gradient, parameter gradients
        bad = {k: v for k, v in errs.items() if not v <= 5e-5}
        assert not bad, f"seed {fuzz_seed}, rank {rank}, CP {world}, {cfg}: differs from CP 1: {bad}"

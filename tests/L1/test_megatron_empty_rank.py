"""A packed micro-batch with fewer tokens than CP ranks: some rank holds none.

``CPCoreAttention`` alone attends such a split exactly (dense fp64 reference, every comm type;
the empty rank still joins every exchange). A ``TransformerLayer`` cannot: Megatron's q/k/v
reshapes fail on zero rows, and the other ranks would wait in their first exchange. So every
rank raises the same ``CPArgumentError``, naming the empty rank, before Megatron's code runs.
"""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

from test_split_agreement import COMMS, _exact, _one_error_everywhere, core_case, layer_case  # noqa: E402

from megatron_cp_ext.testing.pool import run_on_ranks  # noqa: E402

TINY = {"2-0-1": [2, 0, 1], "one-token": [1], "empty": [0, 0]}  # 3, 1 and 0 tokens at CP 4


@pytest.mark.parametrize("lengths", list(TINY), ids=list(TINY))
@pytest.mark.parametrize("comm", COMMS)
def test_core_attention_runs_an_empty_rank_exactly(comm, lengths):
    results = run_on_ranks(4, core_case, "batch", "batch", TINY[lengths], comm, None, timeout=120)
    _exact(results, 1e-12)


@pytest.mark.parametrize("comm", ["p2p", "a2a"])
def test_transformer_layer_refuses_an_empty_rank_everywhere(comm):
    results = run_on_ranks(4, layer_case, "batch", TINY["2-0-1"], comm, None, timeout=120)
    _one_error_everywhere(results, "CP rank 3 gets no tokens", "counts [1, 1, 1, 0]", "Pack at least one token")

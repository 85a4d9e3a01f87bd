"""The head all-to-all's runs (``schedules/route.py``): worked out by hand from a small group,
and checked against the permutation they replace on random shardings."""

import numpy as np
import pytest

import megatron_cp_ext as mcx
from megatron_cp_ext.schedules.a2a import group_union
from megatron_cp_ext.schedules.route import Route


def test_runs_by_hand():
    """Two members, 3 and 4 tokens. Group order: member 1's rows 0-1, member 0's rows 0-2,
    member 1's rows 2-3: receive rows (member 0 first) 3, 4, 0, 1, 2, 5, 6."""
    r = Route.of(np.array([3, 4, 0, 1, 2, 5, 6]), [3, 4])
    assert list(r.runs()) == [(1, 0, 0, 2), (0, 0, 2, 3), (1, 2, 5, 2)]


def test_member_boundary_cuts_a_run():
    """Consecutive receive rows across two members are two runs (two senders)."""
    r = Route.of(np.array([0, 1, 2, 3]), [2, 2])
    assert list(r.runs()) == [(0, 0, 0, 2), (1, 0, 2, 2)]
    assert list(Route.of(np.array([], dtype=np.int64), [0, 0]).runs()) == []


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("balance", ["workload", "dualchunk"])
def test_runs_rebuild_the_permutation(seed, balance):
    """Writing each member's rows run by run into group order gives exactly ``perm``'s
    gather of the member-ordered buffer, and every token travels once."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(0, 300, size=rng.integers(1, 8)).tolist()
    cp = int(rng.choice([2, 4, 8]))
    sh = mcx.shard_sequences(np.cumsum([0, *lens]).tolist(), cp, balance=balance)
    _, perm, counts = group_union(sh, range(cp))
    r = Route.of(perm, counts)
    starts = np.cumsum(counts) - np.asarray(counts)
    placed = np.full(len(perm), -1)
    for o, s, d, n in r.runs():
        assert (placed[d : d + n] == -1).all() and s + n <= counts[o]
        placed[d : d + n] = starts[o] + s + np.arange(n)
    assert (placed == perm).all() and sum(r.n) == sum(counts)

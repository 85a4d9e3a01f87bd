"""The planner's comparison of Megatron's hybrid CP grouping with workload sharding at the full
CP size (``planner/hybrid_cp.py``, ``mcx-plan --hybrid-max-seqlen``): Megatron's own scheduler
forms the groups, and two cases whose answer is known without the comparison anchor it."""

import json

import pytest
import torch

pytest.importorskip("megatron.core")

import megatron_cp_ext as mcx  # noqa: E402
from megatron_cp_ext.planner import cli  # noqa: E402
from megatron_cp_ext.planner.cost import predict  # noqa: E402
from megatron_cp_ext.planner.hybrid_cp import compare, megatron_groups  # noqa: E402
from megatron_cp_ext.planner.profiles import load_profile  # noqa: E402

SHAPES = dict(num_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
PROF = load_profile("h100-nvlink-ib400")


def _cmp(lengths, comms=("p2p",)):
    return compare(lengths, gpus=8, max_seqlen_per_rank=4096, comm_types=comms, mask=dict(causal=True),
                   shapes=SHAPES, profile=PROF)  # fmt: skip


def test_megatron_scheduler_forms_the_groups():
    groups = megatron_groups([32768, 4096, 4096, 100], 8, 4096)
    first = groups[0]
    assert len(first) == 8 and all(ranks == [0] for ranks in first)  # 32K at 4K per rank: all 8 ranks
    held = sorted(s for g in groups for per_rank in g for s in per_rank)
    assert set(held) == {0, 1, 2, 3}


def test_one_long_document_costs_the_same_both_ways():
    """One 32K document at 4K per rank: hybrid CP gives it all 8 ranks, as one CP group of 8
    does: the same plan up to the balance (Megatron's dual-chunk split against workload)."""
    (h,) = _cmp([32768])
    assert h.groups == 1 and h.cp_sizes == {8: 1}
    sh = mcx.shard_sequences([0, 32768], 8, "dualchunk")
    want = predict(mcx.inspect_plan(sh, "p2p", causal=True, **SHAPES), PROF).total_s * 1e3
    assert h.hybrid_ms == pytest.approx(want, rel=1e-9)
    assert 0.9 < h.ratio < 1.1, h


def test_one_whole_document_per_rank_costs_the_same_both_ways():
    """Eight equal documents, each within a rank's share: hybrid CP runs each alone on a rank
    (CP 1), and workload at CP 8 hands each rank one whole document: no transfer either way."""
    (h,) = _cmp([3000] * 8)
    assert h.cp_sizes == {1: 8}
    one = predict(mcx.inspect_plan(mcx.shard_sequences([0, 3000], 1), "p2p", causal=True, **SHAPES), PROF)
    assert h.hybrid_ms == pytest.approx(one.total_s * 1e3, rel=1e-9)
    assert h.ratio == pytest.approx(1.0, rel=0.02), h


def test_cli_prints_and_reports_the_comparison(capsys):
    argv = ["--dist", "long+short", "--total", "65536", "--long", "32768", "--cp", "8", "--comm-type", "p2p,a2a",
            "--hybrid-max-seqlen", "8192", "--heads", "32", "--kv-heads", "8", "--no-progress"]  # fmt: skip
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "hybrid CP" in text and "hybrid / workload" in text and text.count("8 ranks,") == 2
    assert cli.main([*argv, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["hybrid"]
    assert [r["comm_type"] for r in rows] == ["p2p", "a2a"]
    assert all(r["ratio"] == pytest.approx(r["hybrid_ms"] / r["workload_ms"]) for r in rows)
    with pytest.raises(SystemExit) as e:
        cli.main(["--lengths", "100", "--hybrid-max-seqlen", "0"])
    assert e.value.code == 2 and "--hybrid-max-seqlen" in capsys.readouterr().err


@pytest.mark.parametrize(("cp", "max_len"), [(4, 24), (6, 17), (3, 40)])
def test_cli_refuses_a_document_that_needs_more_ranks_than_there_are(capsys, cp, max_len):
    """100 tokens at 24 (17, 40) per rank need 8 (8, 4) ranks, a power of 2: more than cp.
    Megatron's scheduler asserted with no word on the cause; the option is now named."""
    with pytest.raises(SystemExit) as e:
        cli.main(["--lengths", "100,7", "--cp", str(cp), "--hybrid-max-seqlen", str(max_len), "--no-progress"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--hybrid-max-seqlen" in err and "100 tokens" in err, err
    with pytest.raises(mcx.CPArgumentError, match="100 tokens"):
        megatron_groups([100, 7], cp, max_len)
    assert cli.main(["--lengths", "100,7", "--cp", "4", "--hybrid-max-seqlen", "25", "--no-progress"]) == 0
    for bad in (0, -3, 2.5):  # refused by name (0 looped forever in the fit check)
        with pytest.raises(mcx.CPArgumentError, match="max_seqlen_per_rank"):
            megatron_groups([100, 7], 4, bad)

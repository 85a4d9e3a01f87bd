"""The cost model's volume and work terms are inspect_plan's counts, exactly; its overlap
rules on a hand-computed timeline; profiles from names and files."""

import json

import numpy as np
import pytest
import torch

import megatron_cp_ext as mcx
from megatron_cp_ext.inspect import CallReport, PlanReport, RankReport, StepReport
from megatron_cp_ext.masks import MaskSpec
from megatron_cp_ext.planner.cost import predict
from megatron_cp_ext.planner.profiles import PROFILES, load_profile

CASES = [  # (seqlens, cp, balance, mask)
    ((300, 7, 0, 129, 1000, 64), 4, "workload", dict(causal=True)),
    ((300, 7, 0, 129, 1000, 64), 4, "dualchunk", dict(causal=False)),
    ((513, 250, 40), 4, "workload", dict(causal=True, window_size=(100, 0))),
    ((700, 90), 8, "contiguous", dict(causal=True, chunk_size=128)),
]
COMMS = [("p2p", None), ("all_gather", None), ("a2a", None), ("a2a+p2p", 2)]
SHAPES = dict(num_heads=8, num_kv_heads=2, head_dim=16, v_head_dim=8, dtype=torch.bfloat16)


@pytest.mark.parametrize("comm", COMMS, ids=[c for c, _ in COMMS])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_terms_equal_inspect_counts(case, comm):
    seqlens, cp, balance, mask = CASES[case]
    sharding = mcx.shard_sequences(np.cumsum([0, *seqlens]).tolist(), cp, balance, **mask)
    rep = mcx.inspect_plan(sharding, comm[0], a2a_size=comm[1], **mask, **SHAPES)
    cost = predict(rep, PROFILES["h100"])
    es, kv_row = 2, 2 * (16 + 8) * 2
    assert rep.kv_row_bytes == kv_row
    heads_total = 0
    for k, r in rep.ranks.items():
        c = cost.ranks[k]
        assert c.bytes_sent == r.bytes_sent and c.bytes_received == r.bytes_received
        assert c.tile_area == r.tile_area and c.calls == len(r.calls) and c.work == r.work
        heads_total += r.heads
        # FLOPs from the calls' tile areas, counted independently of the model's code
        fwd = sum(x.tile_area for x in r.calls) * r.heads * 2 * (16 + 8)
        bwd = sum(x.tile_area for x in r.calls) * r.heads * 2 * (3 * 16 + 2 * 8)
        assert c.flops == {"forward": fwd, "backward": bwd}
        for phase in ("forward", "backward"):  # the steps partition the totals
            assert sum(s.bytes_sent[phase] for s in r.steps) == r.bytes_sent[phase]
            assert sum(s.bytes_received[phase] for s in r.steps) == r.bytes_received[phase]
        if comm[0] == "p2p":  # exactly the needed rows move: ring steps to the ring's peers, or
            # the staged schedule's one exchange (within its memory bound)
            assert r.bytes_received["forward"] == r.bytes_needed["forward"]
            if any(s.kind == "staged" for s in r.steps):
                assert len(r.steps) == 1 and set(r.steps[0].peers) <= set(range(cp)) - {k}
            else:
                assert all(s.kind == "ring" and s.peers == ((k - s.step) % cp, (k + s.step) % cp) for s in r.steps)
        if comm[0] == "all_gather":
            pad = max(sharding.num_tokens(j) for j in range(cp))
            assert r.bytes_received["forward"] == (cp - 1) * pad * kv_row
            assert r.tokens + r.padding == pad
        assert es == rep.element_size
    # head shards cover the heads once per a2a group; the work sums to the batch's pairs
    assert heads_total == 8 * cp // rep.a2a_size
    # the a2a shares' work sums to the batch's visible pairs (up to rounding per rank)
    p2p = mcx.inspect_plan(sharding, "p2p", **mask, **SHAPES)
    assert abs(sum(c.work for c in cost.ranks.values()) - sum(r.work for r in p2p.ranks.values())) <= cp


def _fake_report(compute_tiles: int, ring_bytes: int) -> PlanReport:
    """One rank, three steps (own + two ring steps), equal compute and comm per step."""
    calls = [CallReport(s, [0, 1], [0, 1], True, (-1, 0), 0, 1, compute_tiles) for s in range(3)]
    steps = [
        StepReport(s, "ring", (0, 1), {"forward": ring_bytes, "backward": 0}, {"forward": ring_bytes, "backward": 0})
        for s in (1, 2)
    ]
    r = RankReport(rank=0, tokens=1, padding=0, work=1, calls=calls, bytes_sent={"forward": 2 * ring_bytes,
                   "backward": 0}, bytes_received={"forward": 2 * ring_bytes, "backward": 0},
                   bytes_needed={"forward": 0, "backward": 0}, steps=steps, heads=1)  # fmt: skip
    rep = PlanReport("p2p", 2, MaskSpec.make(causal=True), 1, 1, num_heads=1, num_kv_heads=1, head_dim=1,
                     v_head_dim=1, element_size=2)  # fmt: skip
    rep.ranks[0] = r
    return rep


def test_overlap_timeline_by_hand():
    # 4 FLOPs per tile entry forward (2 * (d + dv)); 1e12 entries at 4 TFLOP/s = 1 s per step
    prof = load_profile("h100", fwd_tflops=4.0, launch_us=0.0, latency_us=0.0, intra_gbps=1.0, inter_gbps=1.0)
    # comm 2 s per step: compute0 [0,1], comm1 [0,2], compute1 [2,3], comm2 posted at 2 -> [2,4], compute2 [4,5]
    cost = predict(_fake_report(10**12, 2 * 10**9), prof)
    assert cost.ranks[0].compute_s["forward"] == pytest.approx(3.0)
    assert cost.ranks[0].comm_s["forward"] == pytest.approx(4.0)
    assert cost.forward_s == pytest.approx(5.0) and not cost.hidden("forward")
    # comm 0.5 s per step: fully hidden behind the previous step's compute
    cost = predict(_fake_report(10**12, 5 * 10**8), prof)
    assert cost.forward_s == pytest.approx(3.0) and cost.hidden("forward")
    # a collective is exposed: it adds to the compute
    rep = _fake_report(10**12, 0)
    r = rep.ranks[0]
    r.steps[:] = [
        StepReport(0, "all_gather", (1,), {"forward": 10**9, "backward": 0}, {"forward": 10**9, "backward": 0})
    ]
    assert predict(rep, prof).forward_s == pytest.approx(4.0)


def test_staged_timeline_by_hand():
    """The staged exchange is posted with the local stage (step 0) and awaited by the joined
    stage (step 1); backward's partials go home after the joined stage, exposed."""
    # forward: 4 FLOPs per entry at 4 TFLOP/s; backward: 2 (3d + 2dv) = 10 FLOPs at 10 TFLOP/s
    prof = load_profile("h100", fwd_tflops=4.0, bwd_tflops=10.0, launch_us=0.0, latency_us=0.0,
                        intra_gbps=1.0, inter_gbps=1.0)  # fmt: skip
    calls = [CallReport(s, [0, 1], [0, 1], True, (-1, 0), 0, 1, 10**12) for s in (0, 1)]  # 1 s each
    for kv_s, home_s, fwd, bwd in ((3, 0.5, 4.0, 4.5), (0.5, 2, 2.0, 4.0)):
        kv, home = int(kv_s * 10**9), int(home_s * 10**9)
        st = StepReport(
            1, "staged", (1, 2), {"forward": kv, "backward": kv + home}, {"forward": kv, "backward": kv + home}
        )
        r = RankReport(rank=0, tokens=1, padding=0, work=1, calls=calls, bytes_sent=dict(st.bytes_sent),
                       bytes_received=dict(st.bytes_received), bytes_needed={"forward": 0, "backward": 0},
                       steps=[st], heads=1)  # fmt: skip
        rep = PlanReport("p2p", 3, MaskSpec.make(causal=True), 1, 1, num_heads=1, num_kv_heads=1, head_dim=1,
                         v_head_dim=1, element_size=2)  # fmt: skip
        rep.ranks[0] = r
        cost = predict(rep, prof)
        # forward: max(local 1 s, exchange) + joined 1 s; backward: the same, then the partials home
        assert (cost.forward_s, cost.backward_s) == (pytest.approx(fwd), pytest.approx(bwd))


def test_link_choice_follows_nodes():
    """Ring steps inside a node use NVLink, across nodes InfiniBand (ranks_per_node)."""
    sharding = mcx.shard_sequences([0, 4096, 8192], 4, "dualchunk")
    rep = mcx.inspect_plan(sharding, "p2p", **SHAPES)
    one_node = predict(rep, load_profile("h100", ranks_per_node=4)).ranks
    two_nodes = predict(rep, load_profile("h100", ranks_per_node=2)).ranks
    assert all(two_nodes[k].comm_s["forward"] > one_node[k].comm_s["forward"] for k in one_node)


def test_profile_files(tmp_path):
    f = tmp_path / "mine.json"
    f.write_text(json.dumps({"base": "h100", "ranks_per_node": 4, "inter_gbps": 25.0}))
    p = load_profile(str(f))
    assert (p.ranks_per_node, p.inter_gbps, p.fwd_tflops) == (4, 25.0, PROFILES["h100"].fwd_tflops)
    t = tmp_path / "mine.toml"
    fields = dict(fwd_tflops=1.0, bwd_tflops=1.0, launch_us=1.0, intra_gbps=1.0, inter_gbps=1.0, latency_us=1.0)
    t.write_text("\n".join(f"{k} = {v}" for k, v in fields.items()) + "\nranks_per_node = 2\nname = 'x'\n")
    assert load_profile(str(t)).name == "x"
    f.write_text(json.dumps({"base": "h100", "tflops": 3}))
    with pytest.raises(ValueError, match="unknown fields"):
        load_profile(str(f))
    with pytest.raises(ValueError, match="unknown profile"):
        load_profile("tpu")
    with pytest.raises(ValueError, match="inter_gbps"):
        load_profile("h100", inter_gbps=0.0)


def test_megatron_accepts_auto():
    pytest.importorskip("megatron.core")
    import argparse

    from megatron_cp_ext.megatron.args import add_megatron_cp_arguments

    args = add_megatron_cp_arguments(argparse.ArgumentParser()).parse_args(["--cp-comm-type", "auto"])
    assert args.cp_comm_type == ["auto"]


def test_reference_kernel_priced_by_its_padded_rectangles(monkeypatch):
    """cpu-gloo prices each call by the padded score rectangles the reference backend builds:
    count them by recording the shapes its forward actually materialises."""
    from megatron_cp_ext.backends import reference
    from megatron_cp_ext.planner.cost import call_area

    seen = []
    real = reference._probs

    def spy(qh, kh, vis, scale, lse=None):
        seen.append(vis.numel())  # [E, Wq, Wk]: the padded rectangles of one head
        return real(qh, kh, vis, scale, lse)

    monkeypatch.setattr(reference, "_probs", spy)
    prof = PROFILES["cpu-gloo"]
    assert prof.kernel == "reference"
    for cu_q, cu_k in (([0, 300, 307, 1307], [0, 300, 307, 1307]), ([0, 5, 9, 2000], [0, 500, 509, 2100])):
        call = CallReport(0, cu_q, cu_k, True, (-1, 0), 0, 1, 1)
        seen.clear()
        q = torch.randn(cu_q[-1], 1, 4)
        k = torch.randn(cu_k[-1], 1, 4)
        reference.attn_fwd(q, k, k, torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32),
                           max(np.diff(cu_q)), max(np.diff(cu_k)), True, (-1, 0), 0.5)  # fmt: skip
        assert call_area(call, prof) == sum(seen) == reference.visited_area(cu_q, cu_k)
        assert call_area(call, PROFILES["h100"]) == 1  # flash: the reported tile area
    with pytest.raises(ValueError, match="kernel"):
        load_profile("h100", kernel="dense")


def test_calibration_file_replaces_kernel_constants(tmp_path):
    """Measured kernel constants (benchmarks/kernel_throughput.py) replace a named profile's
    datasheet ones; links stay; unknown profile names are refused."""
    from megatron_cp_ext.planner.profiles import _calibrated

    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({"h100-nvlink-ib400": {"fwd_tflops": 321.5, "bwd_tflops": 210.0, "launch_us": 12.0,
                                                      "source": "a test"}}))  # fmt: skip
    out = _calibrated(PROFILES, str(path))
    h = out["h100-nvlink-ib400"]
    assert (h.fwd_tflops, h.bwd_tflops, h.launch_us) == (321.5, 210.0, 12.0)
    assert h.intra_gbps == PROFILES["h100-nvlink-ib400"].intra_gbps and "a test" in h.description
    assert out["a100-nvlink-ib200"] == PROFILES["a100-nvlink-ib200"]
    assert _calibrated(PROFILES, str(tmp_path / "absent.json")) is PROFILES
    path.write_text(json.dumps({"b200": {"fwd_tflops": 1.0}}))
    with pytest.raises(ValueError, match="unknown profile 'b200'"):
        _calibrated(PROFILES, str(path))


# ---- whole layer: linear work on the rank's tokens plus attention ----------------------------
def test_whole_layer_time_is_linear_work_on_tokens_plus_attention():
    from megatron_cp_ext.planner.cost import LinearShape

    # one rank holds 3x the tokens of the others (a custom layout), the same attention pairs
    # nowhere: only linear work differs, and the layer waits for that rank
    cu = [0, 300, 400, 500, 600]
    sh = mcx.CPSharding.from_segments(cu, [[(0, 0, 300)], [(1, 0, 100)], [(2, 0, 100)], [(3, 0, 100)]])
    rep = mcx.inspect_plan(sh, "p2p", causal=False, **SHAPES)
    assert rep.tokens == [300, 100, 100, 100] and rep.token_imbalance == pytest.approx(300 / 150)
    prof = load_profile("h100", gemm_tflops=2.0)
    shape = LinearShape(hidden=64, ffn=96, gated=True)
    cost = predict(rep, prof, shape)
    # per token: Q (8 heads x 16) + K (2 x 16) + V (2 x 8) from 64; out 8 x 8 -> 64; MLP 3 x 64 x 96
    per_token = 2 * (64 * (8 * 16 + 2 * 16 + 2 * 8) + 8 * 8 * 64 + 3 * 64 * 96)
    for k, r in cost.ranks.items():
        assert r.tokens == rep.ranks[k].tokens
        assert r.linear_s["forward"] == pytest.approx(rep.ranks[k].tokens * per_token / 2e12)
        assert r.linear_s["backward"] == pytest.approx(2 * r.linear_s["forward"])
        assert r.layer_s("forward") == pytest.approx(r.time_s["forward"] + r.linear_s["forward"])
    slow = max(cost.ranks.values(), key=lambda r: r.layer_s("forward"))
    assert slow.rank == 0 and cost.layer_time_s("forward") == pytest.approx(slow.layer_s("forward"))
    assert cost.layer_total_s == pytest.approx(cost.layer_time_s("forward") + cost.layer_time_s("backward"))
    # without widths the layer is the attention alone
    bare = predict(rep, prof)
    assert bare.layer_total_s == pytest.approx(bare.total_s)
    with pytest.raises(ValueError, match="ffn"):
        LinearShape(hidden=64, ffn=0)
    with pytest.raises(ValueError, match="gemm_tflops"):
        load_profile("h100", gemm_tflops=0.0)


def test_equal_tokens_beat_drifting_tokens_on_the_whole_layer():
    """Same attention pairs, tokens moved between ranks: the whole-layer prediction follows
    the largest rank's tokens (what a balance that lets tokens drift would cost)."""
    from megatron_cp_ext.planner.cost import LinearShape

    cu = [0, 256, 512]
    even = mcx.CPSharding.from_segments(cu, [[(0, 0, 256)], [(1, 0, 256)]])
    uneven = mcx.CPSharding.from_segments(cu, [[(0, 0, 256), (1, 0, 128)], [(1, 128, 256)]])
    shape = LinearShape(hidden=4096, ffn=14336)
    t = [predict(mcx.inspect_plan(s, "p2p", **SHAPES), PROFILES["h100"], shape).layer_total_s for s in (even, uneven)]
    assert t[1] > 1.3 * t[0]

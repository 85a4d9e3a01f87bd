"""mcx-plan: its rows hold the counts worked out here from the documents and the split alone
(visible pairs, tokens, bytes moved), the cost model's predictions, the winner is the fastest
row, inputs parse the same from every source, and bad input exits 2 naming the flag."""

import json
import subprocess
import sys

import pytest

import megatron_cp_ext as mcx
from megatron_cp_ext.planner import cli
from megatron_cp_ext.planner.cost import predict
from megatron_cp_ext.planner.profiles import PROFILES

LENGTHS = [700, 3, 0, 250, 1300, 64]
BASE = ["--heads", "8", "--kv-heads", "2", "--head-dim", "16", "--no-progress"]


def _json(capsys, argv):
    assert cli.main([*argv, *BASE, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


KV_TOKEN_BYTES = 2 * 16 * 2 * 2  # K and V of one token: 2 KV heads x d 16 x bf16


def _independent(sh, comm_type):
    """Per-rank causal (query, key) pairs per head, tokens, and the forward's largest bytes
    sent or received, from the split's segments alone (no plan): a query at position i sees
    i + 1 keys; p2p moves to rank r the K|V of a peer's tokens at or before r's last query
    of that document; all_gather sends every token's K|V to every peer; a2a sends each peer
    its share of q (hq / cp heads), of K and V (one KV head each here) and returns its share
    of the output."""
    cp, segs = sh.cp_size, sh.segments
    tokens = [sum(s.end - s.start for s in segs[r]) for r in range(cp)]
    work = [sum((s.start + 1 + s.end) * (s.end - s.start) // 2 for s in segs[r]) for r in range(cp)]

    def needed(r, p):
        last = {}
        for s in segs[r]:
            last[s.seq] = max(last.get(s.seq, -1), s.end - 1)
        return sum(max(0, min(s.end, last.get(s.seq, -1) + 1) - s.start) for s in segs[p])

    others = [sum(tokens) - t for t in tokens]
    if comm_type == "p2p":
        sent = [sum(needed(p, r) for p in range(cp) if p != r) * KV_TOKEN_BYTES for r in range(cp)]
        recv = [sum(needed(r, p) for p in range(cp) if p != r) * KV_TOKEN_BYTES for r in range(cp)]
    elif comm_type == "all_gather":
        sent = [t * (cp - 1) * KV_TOKEN_BYTES for t in tokens]
        recv = [o * KV_TOKEN_BYTES for o in others]
    else:  # a2a: q share, one K and one V head, the output share back
        q_share = 8 // cp * 16 * 2
        sent = [t * (q_share + 2 * 16 * 2) * (cp - 1) + o * q_share for t, o in zip(tokens, others, strict=True)]
        recv = [o * (q_share + 2 * 16 * 2) + t * q_share * (cp - 1) for t, o in zip(tokens, others, strict=True)]
    return work, tokens, max(max(a, b) for a, b in zip(sent, recv, strict=True))


def test_rows_match_independent_counts(capsys):
    out = _json(capsys, ["--lengths", ",".join(map(str, LENGTHS)), "--cp", "2,4", "--balance", "workload,dualchunk",
                         "--a2a-size", "2"])  # fmt: skip
    assert len(out["rows"]) == 2 * 2 * 4  # cp x balance x comm type (a2a size 2 divides both)
    cu = [0]
    for n in LENGTHS:
        cu.append(cu[-1] + n)
    for row in out["rows"]:
        sh = mcx.shard_sequences(cu, row["cp"], row["balance"])
        a = row["a2a_size"] if row["comm_type"] == "a2a+p2p" else None
        rep = mcx.inspect_plan(sh, row["comm_type"], a2a_size=a, num_heads=8, num_kv_heads=2, head_dim=16)
        cost = predict(rep, PROFILES["h100-nvlink-ib400"])
        rk = list(rep.ranks.values())
        work, tokens, fwd_bytes = _independent(sh, row["comm_type"])
        assert row["tokens"] == tokens
        if row["comm_type"] in ("p2p", "all_gather"):
            assert row["work"] == work
        else:  # the ranks split the heads: every pair of the batch, divided among them
            assert (
                abs(sum(row["work"]) - sum(work)) < row["cp"] and max(row["work"]) - min(row["work"]) < sum(work) / 500
            )
        if row["comm_type"] != "a2a+p2p":
            assert row["fwd_bytes"] == fwd_bytes, (row, fwd_bytes)
        assert row["work"] == [r.work for r in rk]
        assert row["max_work"] == max(r.work for r in rk)
        assert row["fwd_bytes"] == max(max(r.bytes_sent["forward"], r.bytes_received["forward"]) for r in rk)
        assert row["calls"] == max(len(r.calls) for r in rk)
        assert row["tile_efficiency"] == pytest.approx(rep.tile_efficiency)
        assert row["fwd_ms"] == pytest.approx(cost.forward_s * 1e3)
        assert row["bwd_ms"] == pytest.approx(cost.backward_s * 1e3)
    for cp in (2, 4):
        rows = [r for r in out["rows"] if r["cp"] == cp]
        best = min(rows, key=lambda r: r["fwd_ms"] + r["bwd_ms"])
        assert out["winner"][str(cp)] == {"comm_type": best["comm_type"], "balance": best["balance"]}


def test_whole_layer_rows(capsys):
    """--hidden/--ffn add the whole layer's time (the cost model's, slowest rank); tokens per
    rank and their imbalance are in every row; the winner is the fastest whole layer."""
    from megatron_cp_ext.planner.cost import LinearShape

    lengths = ",".join(map(str, LENGTHS))
    out = _json(capsys, ["--lengths", lengths, "--cp", "4", "--comm-type", "p2p,all_gather",
                         "--balance", "workload,dualchunk", "--hidden", "256", "--ffn", "512"])  # fmt: skip
    cu = [0]
    for n in LENGTHS:
        cu.append(cu[-1] + n)
    for row in out["rows"]:
        sh = mcx.shard_sequences(cu, 4, row["balance"])
        rep = mcx.inspect_plan(sh, row["comm_type"], num_heads=8, num_kv_heads=2, head_dim=16)
        cost = predict(rep, PROFILES["h100-nvlink-ib400"], LinearShape(hidden=256, ffn=512))
        assert row["tokens"] == sh.counts() and max(row["tokens"]) - min(row["tokens"]) <= 1
        assert row["token_imbalance"] == pytest.approx(max(sh.counts()) / (sum(LENGTHS) / 4))
        assert row["layer_ms"] == pytest.approx(cost.layer_total_s * 1e3)
        assert row["layer_ms"] > row["fwd_ms"] + row["bwd_ms"]
    best = min(out["rows"], key=lambda r: r["layer_ms"])
    assert out["winner"]["4"] == {"comm_type": best["comm_type"], "balance": best["balance"]}
    assert cli.main(["--lengths", lengths, "--cp", "4", "--hidden", "256", "--ffn", "512", *BASE]) == 0
    text = capsys.readouterr().out
    assert "tok max/mean" in text and "layer ms" in text and "whole layer" in text
    assert _json(capsys, ["--lengths", lengths, "--cp", "2"])["rows"][0]["layer_ms"] is None


def test_sources_agree(capsys, tmp_path):
    lengths = ",".join(map(str, LENGTHS))
    a = _json(capsys, ["--lengths", lengths, "--cp", "4"])
    f = tmp_path / "lens.txt"
    f.write_text("\n".join(map(str, LENGTHS)))
    b = _json(capsys, ["--lengths-file", str(f), "--cp", "4"])
    cu = [0]
    for n in LENGTHS:
        cu.append(cu[-1] + n)
    f.write_text(" ".join(map(str, cu)))
    c = _json(capsys, ["--lengths-file", str(f), "--cp", "4"])
    assert a["rows"] == b["rows"] == c["rows"]
    d = _json(capsys, ["--dist", "long+short", "--total", "20000", "--long", "8000", "--cp", "4"])
    assert d["tokens"] == 20000


def test_table_and_plot(capsys, tmp_path):
    assert cli.main(["--dist", "lognormal", "--total", "30000", "--cp", "4", *BASE]) == 0
    text = capsys.readouterr().out
    assert "<- best" in text and "predicted best" in text and "a2a+p2p(4)" in text
    pytest.importorskip("matplotlib")
    png = tmp_path / "p.png"
    assert cli.main(["--lengths", "900,100", "--cp", "2", "--plot", str(png), *BASE]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_plot_axes_show_the_real_spread(tmp_path):
    """A spread of 0.1 % stays flat (the work axis spans at least max/mean 1 ± 0.1) and traffic
    starts at 0; a 40 % spread widens the axis to hold it."""
    pytest.importorskip("matplotlib")
    from megatron_cp_ext.planner.plot import plot_rows
    from megatron_cp_ext.planner.rows import Row

    def row(work):
        return Row(cp=2, comm_type="p2p", balance="workload", a2a_size=None, max_work=max(work),
                   mean_work=sum(work) / 2, tile_efficiency=1.0, padding=0, fwd_bytes=5, bwd_bytes=5, calls=1,
                   fwd_ms=1.0, bwd_ms=1.0, fwd_hidden=True, bwd_hidden=True, work=work, sent=[5, 7], tokens=[1, 1],
                   token_imbalance=1.0)  # fmt: skip

    ((top, bottom),) = plot_rows([row([1000, 1001])], str(tmp_path / "a.png"))
    assert top[0] <= 0.9 and top[1] >= 1.1 and bottom[0] == 0
    ((top, _),) = plot_rows([row([1000, 1800])], str(tmp_path / "b.png"))
    assert top[0] <= 1000 / 1400 and top[1] >= 1800 / 1400


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--lengths", "10,x"], "--lengths"),
        (["--lengths", "10,-3"], "--lengths"),
        (["--lengths", "10", "--cp", "0"], "--cp"),
        (["--lengths", "10", "--comm-type", "ring"], "--comm-type"),
        (["--lengths", "10", "--balance", "zigzag"], "--balance"),
        (["--lengths", "10", "--heads", "8", "--kv-heads", "3"], "--kv-heads"),
        (["--lengths", "10", "--window", "a,b"], "--window"),
        (["--lengths", "10", "--profile", "tpu-v9"], "--profile"),
        (["--lengths", "10", "--cp", "8", "--a2a-size", "3"], "--a2a-size"),
        (["--lengths-file", "/nonexistent/lens"], "--lengths-file"),
        (["--dist", "lognormal", "--total", "0"], "--total"),
        (["--dist", "lognormal", "--total", "4096", "--sigma", "-1"], "--sigma"),
        (["--dist", "lognormal", "--total", "4096", "--sigma", "nan"], "--sigma"),
        (["--dist", "long+short", "--total", "65600"], "--total"),  # was a traceback in the batch maker
        (["--lengths", "10", "--plot", "/nonexistent/plan.png"], "--plot"),  # was after the whole sweep
        (["--lengths", "10", "--hidden", "64"], "--ffn"),
        (["--lengths", "10", "--hidden", "0", "--ffn", "8"], "--hidden"),
        ([], "--lengths"),
    ],
)
def test_bad_input_exits_2(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    assert flag in capsys.readouterr().err


def test_plot_without_matplotlib(monkeypatch, capsys):
    from megatron_cp_ext.planner import plot

    monkeypatch.setattr(plot.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SystemExit) as e:
        cli.main(["--lengths", "10", "--plot", "x.png"])
    assert e.value.code == 2 and "matplotlib" in capsys.readouterr().err


@pytest.mark.parametrize("module", ["megatron_cp_ext.planner", "megatron_cp_ext.planner.cli"])
def test_module_entry_point(module):
    """Both module forms run the CLI (``.cli`` ignored its arguments and printed nothing)."""
    r = subprocess.run([sys.executable, "-m", module, "--lengths", "100,20", "--cp", "2", "--json"],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["documents"] == 2


def test_window_takes_a_negative_value_either_way(capsys):
    """``--window -1,0`` (space-separated) plans the same as ``--window=-1,0``: argparse alone
    reads ``-1,0`` as an option and reports ``--window`` without its value."""
    lengths = ",".join(map(str, LENGTHS))
    spaced = _json(capsys, ["--lengths", lengths, "--cp", "4", "--window", "-1,0"])
    joined = _json(capsys, ["--lengths", lengths, "--cp", "4", "--window=-1,0"])
    causal = _json(capsys, ["--lengths", lengths, "--cp", "4", "--causal"])
    assert spaced["rows"] == joined["rows"] == causal["rows"]  # a left-unbounded, right-0 window is causal
    assert spaced["rows"] != _json(capsys, ["--lengths", lengths, "--cp", "4", "--window", "8,0"])["rows"]

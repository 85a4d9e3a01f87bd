"""Sliding-window and chunked masks on every comm type and layout, against the dense fp64
reference (forward and dq/dk/dv), on gloo worlds of 2 and 4.

The full product: 4 comm types x 4 layouts (thd dual-chunk, thd contiguous, bshd, sbhd) x
8 masks x {MHA, GQA} x worlds {2, 4} — the pool runs a case in well under 0.1 s. thd lengths
are not divisible by 2*cp and include empty and one-token sequences; bshd/sbhd use Megatron's
zigzag split (their only layout).
"""

import re
from pathlib import Path

import pytest

from megatron_cp_ext.testing.cases import AttnCase, check_case, run_case
from megatron_cp_ext.testing.pool import run_on_ranks

SUPPORT_MATRIX = Path(__file__).resolve().parents[2] / "docs" / "support_matrix.md"
THD_SEQLENS = (13, 0, 1, 45, 7, 2)
SEQ_FORMAT_SEQLENS = (40, 40)  # bshd/sbhd: b equal sequences, s divisible by 2*cp
HEADS = {"mha": (4, 4), "gqa": (4, 2)}
COMM_TYPES = ["p2p", "all_gather", "a2a", "a2a+p2p"]
LAYOUTS = [("thd", "dualchunk"), ("thd", "contiguous"), ("bshd", "dualchunk"), ("sbhd", "dualchunk")]
MASKS = {
    "causal-left5": dict(causal=True, window_size=(5, 0)),
    "bidir-4-6": dict(causal=False, window_size=(4, 6)),
    "window0": dict(causal=False, window_size=(0, 0)),
    "window-ge-seq": dict(causal=False, window_size=(64, 64)),
    "chunk6-causal": dict(causal=True, chunk_size=6),
    "chunk5-noncausal": dict(causal=False, chunk_size=5),
    "chunk1": dict(causal=False, chunk_size=1),
    "chunk-ge-seq": dict(causal=True, chunk_size=64),
}


def _grid() -> list:
    params = []
    for comm in COMM_TYPES:
        for fmt, balance in LAYOUTS:
            for name in MASKS:
                for world in (2, 4):
                    for heads in HEADS:
                        case_id = f"{comm}-{fmt}-{balance}-{name}-w{world}-{heads}"
                        params.append(pytest.param(comm, fmt, balance, name, world, heads, id=case_id))
    return params


def _a2a_size(comm: str, world: int) -> int:
    """a2a+p2p: a 2x2 grid on 4 ranks; on 2 ranks a trivial a2a and a ring of 2."""
    return {"a2a+p2p": 2 if world == 4 else 1}.get(comm, 0)


def refused_by_design() -> list[tuple[str, str, str]]:
    """``(comm type, format, mask)`` rows of ``docs/support_matrix.md``'s "Refused by design"
    table: the only combinations a test here may see refused."""
    text = SUPPORT_MATRIX.read_text()
    assert "## Refused by design" in text, "docs/support_matrix.md lost its 'Refused by design' section"
    section = text.split("## Refused by design", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `?([\w+]+)`? \| `?(\w+)`? \| `?([\w-]+)`? \|", section, flags=re.M)
    return [r for r in rows if r[0] != "comm"]


def run_checked(world: int, case: AttnCase, mask: str = "") -> None:
    """Run and check a case against dense fp64. Nothing skips: a refusal fails, unless the
    combination is listed as refused by design (then it must refuse)."""
    listed = (case.comm_type, case.qkv_format, mask) in refused_by_design()
    try:
        results = run_on_ranks(world, run_case, case)
    except RuntimeError as e:
        if listed and ("NotImplementedError" in str(e) or "CPArgumentError" in str(e)):
            return
        raise
    assert not listed, f"{case.comm_type}/{case.qkv_format}/{mask} is listed as refused by design but ran"
    check_case(results, case)


def test_refused_by_design_list_is_read():
    """The list exists and names real comm types, formats and masks (today: none is refused)."""
    for comm, fmt, mask in refused_by_design():
        assert comm in COMM_TYPES and fmt in {f for f, _ in LAYOUTS} and mask in MASKS, (comm, fmt, mask)


@pytest.mark.parametrize("comm, fmt, balance, mask, world, heads", _grid())
def test_mask_matches_dense(comm, fmt, balance, mask, world, heads):
    hq, hkv = HEADS[heads]
    case = AttnCase(
        seqlens=THD_SEQLENS if fmt == "thd" else SEQ_FORMAT_SEQLENS, comm_type=comm, qkv_format=fmt,
        balance=balance, hq=hq, hkv=hkv, a2a_size=_a2a_size(comm, world), **MASKS[mask],
    )  # fmt: skip
    run_checked(world, case, mask)


@pytest.mark.parametrize("mask", ["causal-left5", "bidir-4-6", "chunk6-causal"])
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("comm", COMM_TYPES)
def test_fp16_above_cp1(comm, world, mask):
    """fp16 on every comm type at CP 2 and 4 (windows, chunks), thd with GQA, against dense fp64."""
    case = AttnCase(seqlens=THD_SEQLENS, comm_type=comm, qkv_format="thd", balance="dualchunk", hq=4, hkv=2,
                    dtype="float16", a2a_size=_a2a_size(comm, world), **MASKS[mask])  # fmt: skip
    run_checked(world, case, mask)


@pytest.mark.parametrize("seqlens", [(3, 0, 2), (1,), (0, 61, 0)], ids=["tiny", "one-token", "one-long"])
@pytest.mark.parametrize("balance", ["dualchunk", "contiguous"])
def test_windows_with_empty_ranks_world4(balance, seqlens):
    """Ranks holding no tokens (or no visible KV) still take part in the ring."""
    case = AttnCase(seqlens=seqlens, balance=balance, causal=False, window_size=(3, 1), hkv=2)
    run_checked(4, case)


@pytest.mark.parametrize("comm", ["p2p", "a2a+p2p"])
def test_bf16_window_contiguous(comm):
    case = AttnCase(
        seqlens=THD_SEQLENS, comm_type=comm, balance="contiguous", window_size=(6, 0), dtype="bfloat16",
        hkv=2, a2a_size=_a2a_size(comm, 4),
    )  # fmt: skip
    run_checked(4, case)


def _no_sync_worker(rank: int, world: int, case: AttnCase) -> bool:
    """Second call (plan cached): forward and backward read no tensor data on the host
    (``testing.syncguard``: every read refused, the kernel a sync-free stand-in)."""
    import torch.distributed as dist

    import megatron_cp_ext as mcx
    from megatron_cp_ext.testing.syncguard import no_host_reads, sync_free_kernel

    sharding = case.sharding(world)
    q, k, v = (sharding.shard(x, rank).float().requires_grad_() for x in case.inputs()[:3])
    kw = dict(cp_group=dist.group.WORLD, sharding=sharding, causal=case.causal, window_size=case.window_size)
    mcx.cp_attention(q, k, v, **kw).sum().backward()  # builds the plan (one small exchange)
    with sync_free_kernel(), no_host_reads():
        mcx.cp_attention(q, k, v, **kw).sum().backward()
    return True


def test_no_host_sync_in_windowed_ring():
    case = AttnCase(seqlens=THD_SEQLENS, balance="contiguous", causal=False, window_size=(4, 6), hkv=2)
    assert run_on_ranks(4, _no_sync_worker, case) == [True] * 4

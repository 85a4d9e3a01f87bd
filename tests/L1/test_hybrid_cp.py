"""Megatron's hybrid context parallelism through ``CPCoreAttention``: a ``TransformerLayer`` from
our spec on sub-samples whose CP groups are Megatron's hybrid DP×CP groups of 4, 2 and 1 ranks
(a DP×CP world of 4: DP 4, CP 1, ``hybrid_context_parallel``) equals its CP-1 twin on each whole
sub-sample: output, input gradient and every parameter gradient (summed over the sub-group), for
``p2p``, ``all_gather`` and ``a2a``, with RoPE (the full table: the layer takes the rows of its
sub-group's split). The data split is Megatron's own ``get_batch_on_this_cp_rank`` over the
sub-group. The ``PackedSeqParams`` are built by hand exactly as megatron-core 0.16's
``get_batch_on_this_hybrid_cp_rank`` builds them, because that helper puts its ``cu_seqlens`` on
CUDA (``device="cuda", pin_memory=True``); 0.19 moved the split into
``get_batch_on_this_cp_rank(batch, is_hybrid_cp=True, ...)`` and the params into its training
script. Bad params are refused on every rank of the sub-group before any collective.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from test_megatron_layer import HEADS, HIDDEN, make_config  # noqa: E402

from megatron_cp_ext.testing.pool import run_on_ranks  # noqa: E402

SEQ = 32  # per sub-sample: divisible by 2 x 4


def _params(seq: int, n: int, group):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0, seq], dtype=torch.int32)
    return PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                           cu_seqlens_kv_padded=cu, max_seqlen_q=seq, max_seqlen_kv=seq, local_cp_size=n,
                           cp_group=group)  # fmt: skip


def _layers(comm: str):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import build_module

    from megatron_cp_ext.megatron import get_gpt_layer_cp_spec

    spec = get_gpt_layer_cp_spec()
    torch.manual_seed(0)
    layer = build_module(spec, config=make_config(1, comm, None, hybrid_context_parallel=True), layer_number=1)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    pgs.cp = None
    ref = build_module(spec, config=make_config(1, comm, None), layer_number=1, pg_collection=pgs)
    ref.load_state_dict(layer.state_dict())
    return layer, ref


def hybrid_case(rank: int, world: int, comm: str) -> dict:
    """Worker: max |hybrid CP - CP 1| per sub-group size."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_cp_ext.megatron import CPRotaryEmbedding
    from megatron_cp_ext.testing.megatron import megatron_dual_chunk, setup_parallel_state

    setup_parallel_state(1, hybrid=True)
    layer, ref = _layers(comm)
    rope = CPRotaryEmbedding(HIDDEN // HEADS)  # Megatron's table, on CPU (its own moves to CUDA)
    errs = {}
    for n in (4, 2, 1):
        group = parallel_state.get_hybrid_data_context_parallel_groups(group_size=n) if n > 1 else None
        first = dist.get_process_group_ranks(group)[0] if group is not None else rank
        gen = torch.Generator().manual_seed(100 * n + first)  # one sub-sample per sub-group
        x = torch.randn(SEQ, 1, HIDDEN, generator=gen)
        w = torch.randn(SEQ, 1, HIDDEN, generator=gen)
        local = megatron_dual_chunk(
            {"x": x.transpose(0, 1), "w": w.transpose(0, 1), "pos": torch.arange(SEQ)[None]}, group
        )
        x_loc, w_loc, idx = local["x"].transpose(0, 1), local["w"].transpose(0, 1), local["pos"][0]
        for m in (layer, ref):
            m.zero_grad(set_to_none=True)
        x_ref, x_cp = x.clone().requires_grad_(), x_loc.clone().requires_grad_()
        y_ref, _ = ref(x_ref, attention_mask=None, rotary_pos_emb=rope(SEQ))
        (y_ref * w).sum().backward()
        # the full table, as the CP-1 twin gets: the layer picks the rows of its sub-group's split
        y_cp, _ = layer(x_cp, attention_mask=None, rotary_pos_emb=rope(SEQ),
                        packed_seq_params=_params(SEQ, n, group))  # fmt: skip
        (y_cp * w_loc).sum().backward()
        e = {"out": (y_cp - y_ref[idx]).abs().max().item(), "dx": (x_cp.grad - x_ref.grad[idx]).abs().max().item()}
        ref_params = dict(ref.named_parameters())
        for name, p in layer.named_parameters():
            g = p.grad.clone()
            if group is not None:
                dist.all_reduce(g, group=group)
            e[name] = (g - ref_params[name].grad).abs().max().item()
        errs[n] = max(e.values())
    return errs


@pytest.mark.parametrize("comm", ["p2p", "all_gather", "a2a"])
def test_hybrid_subgroups_match_cp1(comm):
    for rank, per_size in enumerate(run_on_ranks(4, hybrid_case, comm, timeout=300)):
        bad = {n: v for n, v in per_size.items() if v > 2e-5}
        assert not bad, f"rank {rank}: {comm} over hybrid sub-groups differs from CP 1: {bad}"


def bad_params_case(rank: int, world: int, what: str) -> str:
    """Worker: the error each rank gets for a malformed hybrid call (or "no error")."""
    from megatron.core import parallel_state

    from megatron_cp_ext.testing.megatron import setup_parallel_state

    setup_parallel_state(1, hybrid=True)
    layer, _ = _layers("a2a+p2p" if what == "a2a+p2p" else "p2p")
    g2 = parallel_state.get_hybrid_data_context_parallel_groups(group_size=2)
    params = {
        "size": _params(16, 4, g2),  # a group of 2 said to be of 4
        "pow2": _params(24, 3, None),
        "a2a+p2p": _params(16, 2, g2),
    }[what]
    x = torch.randn(16 // (2 if what != "pow2" else 1), 1, HIDDEN)
    try:
        layer(x, attention_mask=None, packed_seq_params=params)
    except ValueError as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


@pytest.mark.parametrize(
    "what,words",
    [("size", ["2 ranks", "local_cp_size is 4"]), ("pow2", ["power of 2", "3"]), ("a2a+p2p", ["a2a+p2p", "sub-group"])],
)
def test_bad_hybrid_params_refused_on_every_rank(what, words):
    for msg in run_on_ranks(4, bad_params_case, what, timeout=300):
        assert msg.startswith("CPArgumentError") and all(w in msg for w in words), msg


def non_member_case(rank: int, world: int) -> str:
    """Worker: every rank passes the group of ranks 0 and 1 (a rank outside it holds Megatron's
    non-member placeholder): ranks 0 and 1 run CP 2 over it, ranks 2 and 3 are refused."""
    import torch.distributed as dist

    from megatron_cp_ext.testing.megatron import setup_parallel_state

    setup_parallel_state(1, hybrid=True)
    layer, _ = _layers("p2p")
    g01 = dist.new_group([0, 1])  # collective: every rank makes it
    try:
        layer(torch.randn(8, 1, HIDDEN), attention_mask=None, packed_seq_params=_params(16, 2, g01))
    except ValueError as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


def test_group_without_the_rank_refused():
    msgs = run_on_ranks(4, non_member_case, timeout=300)
    assert msgs[:2] == ["no error", "no error"], msgs
    assert all(m.startswith("CPArgumentError") and "does not hold rank" in m for m in msgs[2:]), msgs


def one_rank_case(rank: int, world: int, what: str) -> str:
    """Worker: ranks 0 and 1 share a sub-group of 2, ranks 2 and 3 another; only rank 1's call is
    malformed. Its partner (valid params, waiting in the sub-group's first exchange) must get the
    same error, and the other sub-group run untouched."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_cp_ext.megatron import CPRotaryEmbedding
    from megatron_cp_ext.testing.megatron import setup_parallel_state

    setup_parallel_state(1, hybrid=True)
    layer, _ = _layers("p2p")
    g2 = parallel_state.get_hybrid_data_context_parallel_groups(group_size=2)
    params, rows = _params(16, 2, g2), 8
    if dist.get_rank() == 1:
        if what == "pow2":  # no group, a size that names none
            params = _params(16, 3, None)
        elif what == "no group of 8":  # a power of 2 no hybrid group has
            params = _params(16, 8, None)
        elif what == "not a group":
            params = _params(16, 2, "g2")
        elif what == "rope":  # a token count no dual-chunk split of 2 gives
            rows = 7
        else:  # the sub-group with THD params
            params.qkv_format = "thd"
    try:
        layer(torch.randn(rows, 1, HIDDEN), attention_mask=None, rotary_pos_emb=CPRotaryEmbedding(HIDDEN // HEADS)(16),
              packed_seq_params=params)  # fmt: skip
    except ValueError as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


@pytest.mark.parametrize(
    "what,words",
    [("pow2", ["power of 2"]), ("no group of 8", ["local_cp_size=8", "not available"]),
     ("not a group", ["ProcessGroup", "'g2'"]), ("rope", ["divisible"]), ("thd", ["thd"])],
)  # fmt: skip
def test_one_rank_bad_params_refused_on_its_sub_group(what, words):
    msgs = run_on_ranks(4, one_rank_case, what, timeout=300)
    assert all(m.startswith("CPArgumentError") and all(w in m for w in words) for m in msgs[:2]), msgs
    assert msgs[0] == msgs[1] and "rejected on CP rank 1;" in msgs[0], msgs  # its rank in the sub-group
    assert msgs[2:] == ["no error", "no error"], msgs

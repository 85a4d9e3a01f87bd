"""A Megatron ``TransformerLayer`` from our spec at CP 2 and 4 == the same layer at CP 1.

Each case builds the layer (RoPE, GQA) on every rank of a gloo pool, copies its weights into
a CP-1 twin, runs both on the same global input (the CP layer on its shard), and compares
outputs, input gradients and every parameter gradient (CP partial gradients summed over the
group). Packed lengths are deliberately not multiples of 2*cp.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_cp_ext.testing.pool import run_on_ranks  # noqa: E402

THD_LENGTHS = [7, 13, 1, 10, 0, 6]  # 37 tokens; odd lengths, an empty and a 1-token sequence
THD_LONG = [300, 7, 1, 270, 0, 13]  # the workload balance cuts the long ones across ranks
SBHD_SHAPE = (16, 2)  # s (divisible by 2*4), b
HIDDEN, HEADS, GROUPS = 64, 8, 4  # head dim 8, GQA 2:1, heads divisible by cp for a2a
# Comm types the engine does not implement yet (strict: an XPASS fails, so drop the entry
# the day the engine lands them).
_NOT_YET: dict[str, str] = {}


def setup_megatron(cp: int, hcp_sizes: tuple[int, ...] | None) -> None:
    """(Re)initialise Megatron's parallel_state in a pool worker when the layout differs."""
    from megatron_cp_ext.testing.megatron import setup_parallel_state

    setup_parallel_state(cp, hcp_sizes)


def make_config(cp: int, comm_type, window, num_layers: int = 1, **extra):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=num_layers,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        ffn_hidden_size=2 * HIDDEN,
        context_parallel_size=cp,
        cp_comm_type=comm_type,
        window_size=window,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        **extra,
    )


def build_pair(cp: int, comm_type, window, layer_number: int = 1, num_layers: int = 1, **extra):
    """(layer at CP ``cp``, its CP-1 twin with identical weights)."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import build_module

    from megatron_cp_ext.megatron import get_gpt_layer_cp_spec

    spec = get_gpt_layer_cp_spec()
    torch.manual_seed(0)
    cfg_cp, cfg_1 = (make_config(n, comm_type, window, num_layers, **extra) for n in (cp, 1))
    layer = build_module(spec, config=cfg_cp, layer_number=layer_number)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    pgs.cp = None  # the twin runs alone: CP size 1 through the same code path
    ref = build_module(spec, config=cfg_1, layer_number=layer_number, pg_collection=pgs)
    ref.load_state_dict(layer.state_dict())
    return layer, ref


def _inputs(fmt: str, cp: int, rank: int):
    """(global x, local x, global rope table, packed params global/local or None, local index)."""
    from megatron_cp_ext.megatron import CPRotaryEmbedding, make_packed_seq_params
    from megatron_cp_ext.megatron.batch import zigzag_positions

    gen = torch.Generator().manual_seed(1)
    rope = CPRotaryEmbedding(HIDDEN // HEADS)
    if fmt.startswith("thd"):
        from megatron.core import parallel_state

        lengths = THD_LONG if fmt == "thd-long" else THD_LENGTHS
        cu = torch.tensor([0] + lengths).cumsum(0)
        x = torch.randn(int(cu[-1]), 1, HIDDEN, generator=gen)
        local = make_packed_seq_params(cu, cp_group=parallel_state.get_context_parallel_group())
        if fmt == "thd-long":
            sh = local._mcx_cp_context.sharding
            assert sh.balance == "workload" and any(a > 0 for _, a, _ in sh.seg.tolist()), "expected cut documents"
        glob = make_packed_seq_params(cu)
        idx = local._mcx_cp_context.sharding.global_index(rank)
        return x, x[idx], rope(max(lengths)), glob, local, idx
    s, b = SBHD_SHAPE
    x = torch.randn(s, b, HIDDEN, generator=gen)
    idx = zigzag_positions(s // cp, cp, rank)
    return x, x[idx], rope(s), None, None, idx


def layer_case(rank: int, world: int, fmt: str, comm_type, window, hcp, extra: dict | None = None) -> dict:
    """Worker: max |CP - CP1| over output, input grad and every parameter grad."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    setup_megatron(world, hcp)
    layer, ref = build_pair(world, comm_type, window, **(extra or {}))
    x, x_loc, table, psp_glob, psp_loc, idx = _inputs(fmt, world, rank)
    w = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))
    x_ref, x_cp = x.clone().requires_grad_(), x_loc.clone().requires_grad_()
    y_ref, _ = ref(x_ref, attention_mask=None, rotary_pos_emb=table, packed_seq_params=psp_glob)
    (y_ref * w).sum().backward()
    y_cp, _ = layer(x_cp, attention_mask=None, rotary_pos_emb=table, packed_seq_params=psp_loc)
    (y_cp * w[idx]).sum().backward()
    errs = {"out": (y_cp - y_ref[idx]).abs().max().item(), "dx": (x_cp.grad - x_ref.grad[idx]).abs().max().item()}
    ref_params = dict(ref.named_parameters())
    group = parallel_state.get_context_parallel_group()
    for name, p in layer.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g, group=group)
        errs[name] = (g - ref_params[name].grad).abs().max().item()
    return errs


def _marks(comm: str) -> list:
    if comm not in _NOT_YET:
        return []
    return [pytest.mark.xfail(raises=NotImplementedError, strict=True, reason=_NOT_YET[comm])]


def run_cases(world: int, fn, *args):
    """``run_on_ranks``, re-raising an engine NotImplementedError as such (for xfail)."""
    try:
        return run_on_ranks(world, fn, *args)
    except RuntimeError as e:
        if "NotImplementedError" in str(e):
            raise NotImplementedError(str(e)) from e
        raise


CASES = [
    pytest.param(
        world, fmt, comm, window, id=f"cp{world}-{fmt}-{comm}-{'win' if window else 'causal'}", marks=_marks(comm)
    )
    for world in (2, 4)
    for comm in ("p2p", "all_gather", "a2a", "a2a+p2p")
    for fmt in ("thd", "sbhd", "thd-long")
    for window in (None, (5, 0))
    if fmt != "thd-long" or window is None or comm == "p2p"
]


@pytest.mark.parametrize("world,fmt,comm,window", CASES)
def test_layer_matches_cp1(world: int, fmt: str, comm: str, window) -> None:
    hcp = (2, world // 2)
    errs = run_cases(world, layer_case, fmt, comm, window, hcp)
    for rank, per_rank in enumerate(errs):
        bad = {k: v for k, v in per_rank.items() if v > 2e-5}
        assert not bad, f"rank {rank}: CP{world} {comm} {fmt} differs from CP1: {bad}"


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("comm", ["p2p", "all_gather", "a2a", "a2a+p2p"])
@pytest.mark.parametrize("fmt", ["thd-long", "sbhd"])
def test_learnable_softmax_layer_matches_cp1(world: int, comm: str, fmt: str) -> None:
    """softmax_type='learnable': output, input and every parameter gradient (the offset's, summed
    over the CP group as Megatron's data-parallel reduction does) match CP 1."""
    errs = run_cases(world, layer_case, fmt, comm, None, (2, world // 2), {"softmax_type": "learnable"})
    for rank, per_rank in enumerate(errs):
        assert any("softmax_offset" in k for k in per_rank), per_rank.keys()
        bad = {k: v for k, v in per_rank.items() if v > 2e-5}
        assert not bad, f"rank {rank}: CP{world} {comm} {fmt} differs from CP1: {bad}"


def comm_types_case(rank: int, world: int) -> list[str]:
    """Worker: the comm type each layer of a per-layer list ends up with."""
    from megatron.core.transformer.transformer_block import TransformerBlock

    from megatron_cp_ext.megatron import get_gpt_layer_cp_spec

    setup_megatron(world, (2, world // 2))
    kinds = ["all_gather", "p2p", "a2a+p2p"]
    block = TransformerBlock(make_config(world, kinds, None, num_layers=3), get_gpt_layer_cp_spec())
    return [layer.self_attention.core_attention.cp_comm_type for layer in block.layers]


def test_per_layer_comm_type_list_honoured() -> None:
    # megatron-core 0.16's own TransformerLayer indexes the list off by one (IndexError on the
    # last layer); our spec's layer must give layer i (1-based) entry i-1.
    assert run_on_ranks(4, comm_types_case) == [["all_gather", "p2p", "a2a+p2p"]] * 4


def missing_hcp_case(rank: int, world: int) -> str:
    """Worker: build an a2a+p2p layer with no hierarchical groups anywhere; return the error."""
    setup_megatron(world, None)
    try:
        build_pair(world, "a2a+p2p", None)
    except ValueError as e:
        return str(e)
    return "no error"


def test_a2a_p2p_without_hierarchical_sizes_is_a_clear_error() -> None:
    for msg in run_on_ranks(2, missing_hcp_case):
        assert "hierarchical" in msg and "a2a+p2p" in msg, msg

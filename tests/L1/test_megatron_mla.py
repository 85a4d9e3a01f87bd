"""Multi-latent attention (MLA) from our spec at CP 2 and 4 == the same model at CP 1.

A two-layer Megatron ``TransformerBlock`` (and a ``GPTModel``) of MLA layers (``q_lora_rank``, ``kv_lora_rank``,
q/k head dim 8 + 8 RoPE dims, v head dim 6) runs at CP > 1 on its shard and as a CP-1 twin
with identical weights on the whole batch; output, input gradient and every parameter gradient
must agree, for THD with documents cut across ranks (workload balance) and sbhd, every comm
type, and both ``rope_type`` values (YaRN with a concentration factor != 1).

The CP-1 twin itself is anchored to Megatron: with its own ``MLASelfAttention`` (its own
RoPE/YaRN tables and THD ``cu_seqlens`` rotation) and the same weights, it gives the same
output, so "true position" means what Megatron means by it.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_cp_ext.testing.pool import run_on_ranks  # noqa: E402

THD_LENGTHS = [300, 7, 1, 270, 0, 13]  # the workload balance cuts the long documents
SBHD_SHAPE = (16, 2)  # s (divisible by 2*4), b
HIDDEN, HEADS = 32, 4


def mla_config(cp: int, comm_type: str, rope_type: str, **extra):
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    base = dict(
        num_layers=2,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        ffn_hidden_size=2 * HIDDEN,
        q_lora_rank=16,
        kv_lora_rank=12,
        qk_head_dim=8,
        qk_pos_emb_head_dim=8,
        v_head_dim=6,
        rope_type=rope_type,
        rotary_base=10000,
        rotary_scaling_factor=4.0,  # YaRN: blended frequencies and mscale 1 + 0.1 ln 4
        original_max_position_embeddings=64,
        context_parallel_size=cp,
        cp_comm_type=comm_type,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
    )
    return MLATransformerConfig(**{**base, **extra})


def _block(config, spec, pg_collection=None):
    from megatron.core.transformer.transformer_block import TransformerBlock

    torch.manual_seed(0)
    kwargs = {"pg_collection": pg_collection} if pg_collection is not None else {}
    return TransformerBlock(config, spec, **kwargs)


def _twin_pgs():
    from megatron.core.process_groups_config import ProcessGroupCollection

    pgs = ProcessGroupCollection.use_mpu_process_groups()
    pgs.cp = None  # the twin runs alone: CP size 1 through the same code path
    return pgs


def _data(fmt: str, cp: int, rank: int):
    """(global x, this rank's row index, global packed params, local packed params)."""
    from megatron.core import parallel_state

    from megatron_cp_ext.megatron import make_packed_seq_params
    from megatron_cp_ext.megatron.batch import zigzag_positions

    gen = torch.Generator().manual_seed(1)
    if fmt == "thd":
        cu = torch.tensor([0] + THD_LENGTHS).cumsum(0)
        x = torch.randn(int(cu[-1]), 1, HIDDEN, generator=gen)
        local = make_packed_seq_params(cu, cp_group=parallel_state.get_context_parallel_group())
        sharding = local._mcx_cp_context.sharding
        if cp > 1:
            assert any(a > 0 for _, a, _ in sharding.seg.tolist()), "expected documents cut across ranks"
        return x, sharding.global_index(rank), make_packed_seq_params(cu), local
    s, b = SBHD_SHAPE
    return torch.randn(s, b, HIDDEN, generator=gen), zigzag_positions(s // cp, cp, rank), None, None


def mla_case(rank: int, world: int, fmt: str, comm: str, rope_type: str, hcp) -> dict:
    """Worker: max |CP - CP1| over output, input grad and every parameter grad."""
    from megatron.core import parallel_state

    from megatron_cp_ext.megatron import cp_layer_spec
    from megatron_cp_ext.megatron.mla import CPMLASelfAttention
    from megatron_cp_ext.testing.megatron import cp_vs_cp1_errors, setup_parallel_state

    setup_parallel_state(world, hcp)
    extra = dict(qk_layernorm=True, normalization="RMSNorm")
    config = mla_config(world, comm, rope_type, **extra)
    spec = cp_layer_spec(config)  # reads multi_latent_attention, qk_layernorm, normalization
    model = _block(config, spec)
    ref = _block(mla_config(1, comm, rope_type, **extra), spec, _twin_pgs())
    ref.load_state_dict(model.state_dict())
    assert all(isinstance(layer.self_attention, CPMLASelfAttention) for layer in model.layers)
    x, idx, psp_glob, psp_loc = _data(fmt, world, rank)

    def run(module, inp, is_cp):
        return module(inp, attention_mask=None, packed_seq_params=psp_loc if is_cp else psp_glob)

    return cp_vs_cp1_errors(model, ref, run, x, idx, parallel_state.get_context_parallel_group())


CASES = [
    pytest.param(world, fmt, comm, rope, id=f"cp{world}-{fmt}-{comm}-{rope}")
    for world in (2, 4)
    for comm in ("p2p", "all_gather", "a2a", "a2a+p2p")
    for fmt in ("thd", "sbhd")
    for rope in ("rope", "yarn")
    if comm != "a2a+p2p" or world == 4
]


@pytest.mark.parametrize("world,fmt,comm,rope_type", CASES)
def test_mla_block_matches_cp1(world: int, fmt: str, comm: str, rope_type: str) -> None:
    errs = run_on_ranks(world, mla_case, fmt, comm, rope_type, (2, world // 2))
    for rank, per_rank in enumerate(errs):
        assert len(per_rank) > 20, per_rank.keys()  # output, dx and every parameter of 2 layers
        bad = {k: v for k, v in per_rank.items() if not v <= 2e-5}
        assert not bad, f"rank {rank}: CP{world} {comm} {fmt} {rope_type} differs from CP1: {bad}"


def gpt_case(rank: int, world: int, fmt: str, comm: str, rope_type: str, hcp) -> dict:
    """Worker: a GPTModel of MLA layers, tokens split by shard_batch_for_cp: max |CP - CP1|
    over logits and every parameter gradient."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    from megatron_cp_ext.megatron import cp_layer_spec
    from megatron_cp_ext.testing.megatron import model_vs_cp1_errors, setup_parallel_state, token_batches

    setup_parallel_state(world, hcp)
    group = parallel_state.get_context_parallel_group()
    extra = {"hierarchical_context_parallel_sizes": list(hcp)} if comm == "a2a+p2p" else {}

    def gpt(config, pg_collection=None):
        torch.manual_seed(0)
        kw = {"pg_collection": pg_collection} if pg_collection is not None else {}
        spec = cp_layer_spec(config)
        return GPTModel(config, spec, vocab_size=64, max_sequence_length=1024, position_embedding_type="rope", **kw)

    model, ref = gpt(mla_config(world, comm, rope_type, **extra)), gpt(mla_config(1, comm, rope_type), _twin_pgs())
    ref.load_state_dict(model.state_dict())
    full, local, idx = token_batches(rank, world, group, fmt, lengths=THD_LENGTHS, shape=SBHD_SHAPE, vocab=64)

    # Relative to each tensor's scale (at least 1): bias and output-layer gradients sum over
    # hundreds of tokens, where fp32 summation order alone moves them by ~1e-4 absolute.
    def rel(a, b):
        return ((a - b).abs().max() / b.abs().max().clamp(min=1.0)).item()

    return model_vs_cp1_errors(model, ref, full, local, idx, group, rel)


@pytest.mark.parametrize(
    "world,fmt,comm,rope_type",
    [
        (2, "thd", "p2p", "yarn"),
        (4, "sbhd", "a2a+p2p", "rope"),
    ],
)
def test_mla_gpt_matches_cp1(world: int, fmt: str, comm: str, rope_type: str) -> None:
    errs = run_on_ranks(world, gpt_case, fmt, comm, rope_type, (2, world // 2))
    for rank, per_rank in enumerate(errs):
        assert len(per_rank) > 20, per_rank.keys()
        bad = {k: v for k, v in per_rank.items() if not v <= 2e-5}
        assert not bad, f"rank {rank}: MLA GPT CP{world} {comm} {fmt} {rope_type} differs from CP1: {bad}"


def megatron_anchor_case(rank: int, world: int, fmt: str, rope_type: str, q_lora_rank) -> float:
    """Worker (1 rank): our CP-1 MLA == Megatron's own ``MLASelfAttention`` (its RoPE/YaRN
    tables; THD rotated by ``cu_seqlens``) with the same weights and core attention."""
    import dataclasses
    from unittest import mock

    from megatron.core.transformer import multi_latent_attention as mla_module
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_cp_ext.megatron import get_gpt_layer_cp_spec
    from megatron_cp_ext.testing.megatron import setup_parallel_state

    setup_parallel_state(1)
    config = mla_config(1, "p2p", rope_type, q_lora_rank=q_lora_rank)
    ours = get_gpt_layer_cp_spec(multi_latent_attention=True)
    attn = ours.submodules.self_attention
    theirs = dataclasses.replace(
        ours,
        submodules=dataclasses.replace(
            ours.submodules,
            self_attention=ModuleSpec(module=MLASelfAttention, params=attn.params, submodules=attn.submodules),
        ),
    )
    model = _block(config, ours)
    # Megatron's tables insist on CUDA; on CPU let "the current CUDA device" be the CPU. 0.16
    # also believes TE is present when only its placeholder classes are.
    no_te = not isinstance(getattr(mla_module, "TELinear", None), type)
    with (
        mock.patch.object(torch.cuda, "current_device", lambda: "cpu"),
        mock.patch.object(mla_module, "HAVE_TE", getattr(mla_module, "HAVE_TE", False) and not no_te),
    ):
        ref = _block(config, theirs)
        ref.load_state_dict(model.state_dict())
        x, _, psp, _ = _data(fmt, 1, 0)
        with torch.no_grad():
            y_ref = ref(x, attention_mask=None, packed_seq_params=psp)
    assert type(ref.layers[0].self_attention) is MLASelfAttention
    with torch.no_grad():
        y = model(x, attention_mask=None, packed_seq_params=psp)
    return (y - y_ref).abs().max().item()


@pytest.mark.parametrize("q_lora_rank", [16, None], ids=["q_lora", "q_proj"])
@pytest.mark.parametrize("rope_type", ["rope", "yarn"])
@pytest.mark.parametrize("fmt", ["thd", "sbhd"])
def test_cp1_mla_matches_megatrons_own_mla(fmt: str, rope_type: str, q_lora_rank) -> None:
    assert run_on_ranks(1, megatron_anchor_case, fmt, rope_type, q_lora_rank)[0] < 1e-5


def test_mla_refuses_what_it_cannot_honour() -> None:
    from megatron_cp_ext.megatron import get_gpt_layer_cp_spec

    with pytest.raises(ValueError, match="qk_l2_norm"):
        get_gpt_layer_cp_spec(multi_latent_attention=True, qk_l2_norm=True)


def no_sync_case(rank: int, world: int) -> bool:
    """Worker: the second THD step of an MLA block (plan and positions cached on the params)
    reads no device values in forward or backward: positions come from the plan, not from
    ``cu_seqlens`` (``testing.syncguard``: no path exempt, the kernel a sync-free stand-in)."""
    from megatron.core import parallel_state

    from megatron_cp_ext.megatron import cp_layer_spec
    from megatron_cp_ext.testing.megatron import setup_parallel_state
    from megatron_cp_ext.testing.syncguard import no_host_reads, sync_free_kernel

    setup_parallel_state(world)
    config = mla_config(world, "p2p", "yarn")
    model = _block(config, cp_layer_spec(config))
    x, idx, _, psp = _data("thd", world, rank)
    x_loc = x[idx].requires_grad_()
    model(x_loc, attention_mask=None, packed_seq_params=psp).sum().backward()  # builds the plan
    with sync_free_kernel(), no_host_reads():  # every host read refused, the kernel included
        model(x_loc, attention_mask=None, packed_seq_params=psp).sum().backward()
    assert parallel_state.get_context_parallel_world_size() == world
    return True


def test_mla_thd_step_has_no_host_sync() -> None:
    assert run_on_ranks(2, no_sync_case) == [True, True]


def packed_as_sbhd_case(rank: int, world: int) -> str:
    """Worker: an MLA block given THD-split params switched to qkv_format='sbhd'."""
    from megatron.core import parallel_state

    import megatron_cp_ext as mcx
    from megatron_cp_ext.megatron import cp_layer_spec, make_packed_seq_params
    from megatron_cp_ext.testing.megatron import setup_parallel_state

    setup_parallel_state(world)
    config = mla_config(world, "p2p", "rope")
    model = _block(config, cp_layer_spec(config))
    cu = torch.tensor([0] + THD_LENGTHS).cumsum(0)
    params = make_packed_seq_params(cu, cp_group=parallel_state.get_context_parallel_group())
    n = params._mcx_cp_context.sharding.num_tokens(rank)
    params.qkv_format = "sbhd"
    try:
        model(torch.randn(n, 1, HIDDEN), attention_mask=None, packed_seq_params=params)
    except mcx.CPArgumentError as err:
        return str(err)
    return "ran"


def test_mla_refuses_packed_params_switched_to_sbhd() -> None:
    """The refusal comes before MLA's own positions (the dual-chunk rule's length message)."""
    results = run_on_ranks(2, packed_as_sbhd_case, timeout=120)
    assert len(set(results)) == 1 and "qkv_format is 'sbhd'" in results[0], results

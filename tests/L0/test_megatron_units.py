"""Single-rank checks of the Megatron integration: RoPE table and positions, the core
attention against the dense fp64 reference, construction-time errors, spec and arguments."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import math

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.spec_utils import ModuleSpec  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from megatron_cp_ext.megatron import (  # noqa: E402
    CPAttentionOptions,
    CPCoreAttention,
    CPRotaryEmbedding,
    add_arguments,
    add_megatron_cp_arguments,
    cp_attention_options_from_args,
    cp_layer_spec,
    get_gpt_layer_cp_spec,
    shard_batch_for_cp,
)
from megatron_cp_ext.megatron.batch import zigzag_positions  # noqa: E402
from megatron_cp_ext.megatron.context import CONTEXT_ATTR  # noqa: E402
from megatron_cp_ext.megatron.core_attention import resolve_cp_comm_type  # noqa: E402
from megatron_cp_ext.testing.pool import run_on_ranks  # noqa: E402
from megatron_cp_ext.testing.reference import dense_attention  # noqa: E402


def config(**kw) -> TransformerConfig:
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, attention_dropout=0.0)
    return TransformerConfig(**{**base, **kw})


def core(cfg: TransformerConfig | None = None, **kw) -> CPCoreAttention:
    pgs = ProcessGroupCollection()
    pgs.cp = None  # CP size 1: no process group needed at all
    return CPCoreAttention(cfg or config(), 1, kw.pop("mask", AttnMaskType.causal), pg_collection=pgs, **kw)


def test_rope_table_is_the_standard_formula_on_cpu() -> None:
    rope = CPRotaryEmbedding(8, rotary_base=10000)
    table = rope(11)
    assert table.shape == (11, 1, 1, 8) and table.device.type == "cpu"
    inv = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    expect = torch.outer(torch.arange(11).float(), inv)
    torch.testing.assert_close(table[:, 0, 0], torch.cat([expect, expect], -1))
    inter = CPRotaryEmbedding(8, rotary_interleaved=True)(3)[:, 0, 0]
    torch.testing.assert_close(inter[:, 0::2], inter[:, 1::2])
    assert "inv_freq" not in rope.state_dict()  # recomputed, never checkpointed


@pytest.mark.parametrize("cast", ["bfloat16", "half", "Float16Module"])
def test_rope_frequencies_stay_fp32_through_casts(cast: str) -> None:
    """``--bf16`` wraps the model in ``Float16Module``, which casts every buffer: a bf16
    ``inv_freq`` rounded the table's positions past 256 (257 -> 256, 1001 -> 1000; angles off by
    4 rad at 2K). The table, and MLA's angles, must stay the fp32 formula at every position,
    and the buffer must still follow device moves."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.module import Float16Module

    from megatron_cp_ext.megatron.mla import CPMLARotaryEmbedding

    n = 2048
    inv = 1.0 / (10000 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8))
    want = torch.outer(torch.arange(n, dtype=torch.float64), inv).float()  # fp32 angles of exact positions
    rope, mla = CPRotaryEmbedding(8), CPMLARotaryEmbedding.rope(8)
    mega = RotaryEmbedding(8, 1.0, use_cpu_initialization=True)  # Megatron's own: a plain fp32 attribute
    for m in (rope, mla):
        if cast == "Float16Module":
            Float16Module(config(bf16=True), torch.nn.Sequential(m))
        else:
            getattr(m, cast)()
        assert m.inv_freq.dtype == torch.float32 == mega.inv_freq.dtype, cast
    for moved in (CPRotaryEmbedding(8).to("meta", torch.bfloat16), CPMLARotaryEmbedding.rope(8).to("meta")):
        assert moved.inv_freq.device.type == "meta" and moved.inv_freq.dtype == torch.float32  # moves apply
    rope.inv_freq, mla.inv_freq = mega.inv_freq.clone(), mega.inv_freq.clone()  # the same fp32 values
    torch.testing.assert_close(rope(n)[:, 0, 0, :4], want, rtol=1e-6, atol=0)
    mla.positions = torch.arange(n)
    torch.testing.assert_close(mla()[:, 0, 0, :4], want, rtol=1e-6, atol=0)


def test_old_batch_name_points_to_the_new_one() -> None:
    with pytest.raises(ImportError, match="shard_batch_for_cp"):
        from megatron_cp_ext.megatron import get_batch_on_this_cp_rank  # noqa: F401
    with pytest.raises(TypeError):
        shard_batch_for_cp({}, torch.tensor([0, 3]))  # keyword-only: no positional cu_seqlens


def test_zigzag_positions_match_megatron_split() -> None:
    assert zigzag_positions(8, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert zigzag_positions(8, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert zigzag_positions(5, 1, 0).tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="divisible"):
        zigzag_positions(3, 2, 0)


def test_thd_batch_at_cp1_gets_true_positions_and_params() -> None:
    cu = torch.tensor([0, 3, 8])
    batch = {"tokens": torch.arange(8)[None], "labels": torch.arange(8)[None], "attention_mask": torch.ones(1)}
    out = shard_batch_for_cp(batch, cu_seqlens=cu, cp_group=None)
    assert out["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 4]]
    assert out["tokens"].tolist() == batch["tokens"].tolist() and out["attention_mask"] is None
    params = out["packed_seq_params"]
    assert params.qkv_format == "thd" and params.cu_seqlens_q.tolist() == [0, 3, 8] and params.max_seqlen_q == 5
    ctx = getattr(params, CONTEXT_ATTR)
    out["position_ids"].add_(100)  # the batch's own tensor: the positions RoPE reads stay put
    assert ctx.positions("cpu").tolist() == [0, 1, 2, 0, 1, 2, 3, 4]


def test_positions_first_made_in_inference_mode_serve_training() -> None:
    """An evaluation under inference mode first: the cached positions and shard indices are
    normal tensors, so a later training step can save them for its backward."""
    cu = torch.tensor([0, 3, 8])
    with torch.inference_mode():
        out = shard_batch_for_cp({"tokens": torch.arange(8)[None]}, cu_seqlens=cu, cp_group=None)
        sharding = getattr(out["packed_seq_params"], CONTEXT_ATTR).sharding
        sharding.shard(torch.randn(8, 2), 0)
    ctx = getattr(out["packed_seq_params"], CONTEXT_ATTR)
    assert not ctx.positions("cpu").is_inference() and not sharding.global_index(0).is_inference()
    w = torch.randn(8, 2, requires_grad=True)
    sharding.shard(w, 0).pow(2).sum().backward()
    torch.testing.assert_close(w.grad, 2 * w.detach())


def test_packed_seq_params_takes_megatrons_no_window() -> None:
    """``window_size=None`` (Megatron's ``config.window_size`` without a window) is no window."""
    from megatron_cp_ext.megatron import make_packed_seq_params

    cu = [0, 5, 6, 15]
    got = make_packed_seq_params(cu, window_size=None)._mcx_cp_context.recipe
    assert got == make_packed_seq_params(cu)._mcx_cp_context.recipe and got.window_size == (-1, -1)


@pytest.mark.parametrize("window,chunk", [(None, None), ((3, 0), None), (None, 4), ((2, 0), 4)])
def test_core_attention_thd_matches_dense_reference(window, chunk) -> None:
    """CP 1 ``CPCoreAttention`` against dense fp64 for causal, windowed, chunked, and chunked
    plus windowed layers (the anchor the CP-vs-CP-1 Megatron tests build on)."""
    from megatron_cp_ext.megatron import CPAttentionOptions, make_packed_seq_params

    lengths = [5, 1, 9, 0, 4]
    cu = torch.tensor([0] + lengths).cumsum(0)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(19, h, 8, generator=gen, requires_grad=True) for h in (4, 2, 2))
    attn = core(config(window_size=window), options=CPAttentionOptions(chunk_size=chunk))
    assert attn.chunk_size == chunk
    out = attn(q, k, v, None, packed_seq_params=make_packed_seq_params(cu))
    ref = dense_attention(q, k, v, cu, causal=True, window_size=window or (-1, -1), chunk_size=chunk)
    if chunk is not None:  # the mask really is chunked: a chunk-free layer would differ
        plain = dense_attention(q, k, v, cu, causal=True, window_size=window or (-1, -1))
        assert (plain - ref).abs().max() > 0.05
    assert out.shape == (19, 32)
    torch.testing.assert_close(out.double(), ref.reshape(19, 32), atol=1e-5, rtol=1e-5)


def test_core_attention_sbhd_softmax_scale_and_no_mask() -> None:
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(6, 2, h, 8, generator=gen) for h in (4, 2, 2))
    out = core(mask=AttnMaskType.no_mask, softmax_scale=0.3)(q, k, v, None)
    assert out.shape == (6, 2, 32)
    for b in range(2):
        ref = dense_attention(q[:, b], k[:, b], v[:, b], [0, 6], causal=False, softmax_scale=0.3)
        torch.testing.assert_close(out[:, b].double(), ref.reshape(6, 32), atol=1e-5, rtol=1e-5)
    assert math.isclose(core(softmax_scale=0.3).softmax_scale, 0.3)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"cfg": config(attention_dropout=0.1)}, "dropout"),
        ({"attention_dropout": 0.2}, "dropout"),
        ({"attention_type": "cross"}, "self attention"),
        ({"mask": AttnMaskType.arbitrary}, "attn_mask_type"),
        ({"cp_comm_type": "ring"}, "p2p"),
    ],
)
def test_unsupported_options_fail_at_construction(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        core(**kwargs)


@pytest.mark.parametrize("softmax_type", ["off-by-one", "learnable"])
def test_softmax_types_match_the_dense_reference_with_a_sink(softmax_type) -> None:
    torch.manual_seed(0)
    attn = core(config(softmax_type=softmax_type, use_cpu_initialization=True))
    offset = attn.softmax_offset
    assert offset.shape == (4,) and isinstance(offset, torch.nn.Parameter) == (softmax_type == "learnable")
    if softmax_type == "off-by-one":
        assert torch.equal(offset, torch.zeros(4))
    q, k, v = torch.randn(7, 1, 4, 8), torch.randn(7, 1, 2, 8), torch.randn(7, 1, 2, 8)
    out = attn(q, k, v, None)
    ref = dense_attention(q[:, 0], k[:, 0], v[:, 0], [0, 7], causal=True, softmax_offset=offset.detach())
    torch.testing.assert_close(out[:, 0].double(), ref.reshape(7, 32), atol=1e-5, rtol=1e-5)
    if softmax_type == "learnable":
        out.sum().backward()
        assert offset.grad is not None and offset.grad.shape == (4,)
    assert core().softmax_offset is None


def test_attention_bias_is_rejected() -> None:
    q = torch.randn(4, 1, 4, 8)
    with pytest.raises(ValueError, match="attention_bias"):
        core()(q, q[:, :, :2], q[:, :, :2], None, attention_bias=torch.zeros(1))


def test_options_and_comm_type_resolution() -> None:
    with pytest.raises(ValueError, match="load_balance"):
        CPAttentionOptions(load_balance="zigzag")
    with pytest.raises(ValueError, match="backend"):
        CPAttentionOptions(backend="nope")
    with pytest.raises(TypeError):
        CPAttentionOptions("dualchunk")  # keyword-only
    cfg = config(cp_comm_type=["p2p", "a2a"])
    assert resolve_cp_comm_type(None, cfg, 1) == "p2p" and resolve_cp_comm_type(None, cfg, 2) == "a2a"
    assert resolve_cp_comm_type("all_gather", cfg, 2) == "all_gather"
    assert resolve_cp_comm_type(None, config(), 1) == "p2p"
    with pytest.raises(ValueError, match="no entry"):
        resolve_cp_comm_type(None, cfg, 3)


def _structure(obj, swap: dict):
    """A comparable picture of a spec: ModuleSpecs, submodule dataclasses and
    ``functools.partial`` (megatron-core >= 0.18 builds MLPs as partials, which compare by
    identity) unwrapped into their parts, classes mapped through ``swap``."""
    if isinstance(obj, functools.partial):
        kw = {k: _structure(v, swap) for k, v in sorted(obj.keywords.items())}
        return ("partial", _structure(obj.func, swap), tuple(_structure(a, swap) for a in obj.args), kw)
    if isinstance(obj, ModuleSpec):
        params = {k: _structure(v, swap) for k, v in sorted(obj.params.items())}
        return ("spec", _structure(obj.module, swap), params, _structure(obj.submodules, swap))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = {f.name: _structure(getattr(obj, f.name), swap) for f in dataclasses.fields(obj)}
        return (type(obj), fields)
    if isinstance(obj, dict):
        return {k: _structure(v, swap) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return tuple(_structure(v, swap) for v in obj)
    if isinstance(obj, type):
        return swap.get(obj, obj)
    return obj


def _without_core(spec: ModuleSpec) -> tuple[ModuleSpec, object]:
    """(spec with its core-attention entry blanked, that entry)."""
    attn = spec.submodules.self_attention
    core = attn.submodules.core_attention
    attn = dataclasses.replace(attn, submodules=dataclasses.replace(attn.submodules, core_attention=None))
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=attn)), core


def _assert_same_layer_as_megatron(ours: ModuleSpec, theirs: ModuleSpec) -> None:
    """Ours == Megatron's local spec except the three swapped classes and the core attention."""
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from megatron_cp_ext.megatron import CPSelfAttention, CPTransformerLayer
    from megatron_cp_ext.megatron.mla import CPMLASelfAttention

    swap = {CPTransformerLayer: TransformerLayer, CPSelfAttention: SelfAttention, CPMLASelfAttention: MLASelfAttention}
    (ours_rest, core), (theirs_rest, _) = _without_core(ours), _without_core(theirs)
    assert ours.module is CPTransformerLayer
    assert getattr(core, "func", getattr(core, "module", None)) is CPCoreAttention
    assert _structure(ours_rest, swap) == _structure(theirs_rest, {})


def test_spec_swaps_exactly_attention_and_layer() -> None:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    ours, theirs = get_gpt_layer_cp_spec(qk_layernorm=True), get_gpt_layer_local_spec(qk_layernorm=True)
    _assert_same_layer_as_megatron(ours, theirs)
    assert ours.submodules.self_attention.module.__name__ == "CPSelfAttention"
    # The comparison sees through partials: a different MLP must not compare equal.
    other = get_gpt_layer_local_spec(qk_layernorm=True, num_experts=2)
    with pytest.raises(AssertionError):
        _assert_same_layer_as_megatron(ours, other)


# Config settings per local-spec argument; Megatron's own config -> block spec path builds
# the reference layer. MoE with grouped GEMM needs its kernels only at build time.
_SETTINGS = {
    "num_experts": [{"num_moe_experts": 4}],
    "moe_grouped_gemm": [{"num_moe_experts": 4, "moe_grouped_gemm": True}],
    "qk_layernorm": [{"qk_layernorm": True}, {"qk_layernorm": True, "multi_latent_attention": True}],
    "multi_latent_attention": [{"multi_latent_attention": True}],
    "normalization": [{"normalization": "RMSNorm"}, {"normalization": "RMSNorm", "multi_latent_attention": True}],
    "qk_l2_norm": [{"qk_l2_norm": True}],
    "moe_use_legacy_grouped_gemm": [
        {"num_moe_experts": 4, "moe_grouped_gemm": True, "moe_use_legacy_grouped_gemm": True}
    ],
}


def _local_spec_args() -> list[str]:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return list(inspect.signature(get_gpt_layer_local_spec).parameters)


def test_every_local_spec_argument_is_honoured_or_refused() -> None:
    """A new argument of Megatron's local spec fails here until it is mapped or refused."""
    from megatron_cp_ext.megatron import spec

    known = set(spec._CONFIG_FIELD) | set(spec.REFUSED_LOCAL_SPEC_ARGS) | set(spec.IGNORED_LOCAL_SPEC_ARGS)
    assert not set(_local_spec_args()) - known, "map to a config field, refuse, or justify ignoring"
    assert set(_SETTINGS) == set(spec._CONFIG_FIELD), "every honoured argument needs a setting below"


@pytest.mark.parametrize(
    "arg,setting", [(a, s) for a, settings in _SETTINGS.items() for s in settings], ids=lambda v: str(v)
)
def test_cp_layer_spec_builds_megatrons_layer_for_each_config_field(arg: str, setting: dict) -> None:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from megatron_cp_ext.megatron import cp_layer_spec
    from megatron_cp_ext.megatron.spec import _CONFIG_FIELD

    if arg not in _local_spec_args():
        pytest.skip(f"this megatron-core's local spec has no {arg}")
    field = _CONFIG_FIELD[arg]
    if not hasattr(TransformerConfig, field):
        pytest.skip(f"this megatron-core's config has no {field}")
    setting = dict(setting)
    cls = MLATransformerConfig if setting.pop("multi_latent_attention", False) else TransformerConfig
    cfg = cls(num_layers=1, hidden_size=32, num_attention_heads=4, **setting)
    theirs = get_gpt_decoder_block_spec(
        cfg, use_transformer_engine=False, normalization=cfg.normalization, qk_l2_norm=cfg.qk_l2_norm, pp_rank=0
    ).layer_specs[0]
    _assert_same_layer_as_megatron(cp_layer_spec(cfg), theirs)


def test_cp_layer_spec_refuses_mixed_dense_and_moe_layers() -> None:
    with pytest.raises(ValueError, match="moe_layer_freq"):
        cp_layer_spec(config(num_moe_experts=4, moe_layer_freq=2))
    cp_layer_spec(config(num_moe_experts=4, moe_layer_freq=[1, 1]))  # all MoE: one spec fits
    cp_layer_spec(config(num_moe_experts=4, moe_layer_freq=2, num_layers=1))  # layer 1 is MoE for any int


@pytest.mark.parametrize("arg", ["use_kitchen", "use_kitchen_attention"])
def test_refused_local_spec_arguments_name_the_field(arg: str) -> None:
    from megatron_cp_ext.megatron import cp_layer_spec

    if arg not in _local_spec_args():
        pytest.skip(f"this megatron-core's local spec has no {arg}")
    with pytest.raises(ValueError, match=arg):
        get_gpt_layer_cp_spec(**{arg: True})
    cfg = config()
    cfg.__dict__[arg] = True  # set after __post_init__ (Kitchen itself is not installed)
    with pytest.raises(ValueError, match=arg):
        cp_layer_spec(cfg)


def test_arguments_reuse_megatron_names() -> None:
    parser = add_megatron_cp_arguments(add_arguments(argparse.ArgumentParser()))
    add_megatron_cp_arguments(parser)  # idempotent: Megatron-LM parsers already have these
    args = parser.parse_args(
        "--context-parallel-size 4 --cp-comm-type p2p a2a --hierarchical-context-parallel-sizes 2 2 "
        "--window-size 128,0 --cp-load-balance contiguous --cp-attention-chunk-size 64".split()
    )
    assert args.cp_comm_type == ["p2p", "a2a"] and args.window_size == (128, 0)
    assert args.hierarchical_context_parallel_sizes == [2, 2]
    opts = cp_attention_options_from_args(args)
    assert (opts.load_balance, opts.backend, opts.chunk_size) == ("contiguous", "auto", 64)


def thd_vs_sequences_case(rank: int, world: int) -> float:
    """Worker (1 rank): one packed THD pass == each sequence alone in sbhd (RoPE restarts)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.spec_utils import build_module

    from megatron_cp_ext.megatron import make_packed_seq_params

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    torch.manual_seed(0)
    layer = build_module(get_gpt_layer_cp_spec(), config=config(hidden_dropout=0.0, use_cpu_initialization=True))
    lengths = [6, 10, 4]
    cu = torch.tensor([0] + lengths).cumsum(0)
    x = torch.randn(20, 1, 32, generator=torch.Generator().manual_seed(1))
    rope = CPRotaryEmbedding(8)
    y, _ = layer(x, attention_mask=None, rotary_pos_emb=rope(10), packed_seq_params=make_packed_seq_params(cu))
    parts = [layer(x[cu[i] : cu[i + 1]], attention_mask=None, rotary_pos_emb=rope(n))[0] for i, n in enumerate(lengths)]
    return (torch.cat(parts) - y).abs().max().item()


def test_packed_layer_equals_per_sequence_layer() -> None:
    assert run_on_ranks(1, thd_vs_sequences_case)[0] < 1e-5


def test_padded_cu_seqlens_layout_is_exact_for_real_tokens() -> None:
    from megatron.core.packed_seq_params import PackedSeqParams

    # Megatron/TE padded layout: sequences of 3 and 5 tokens stored in slots of 4 and 6.
    real, padded = torch.tensor([0, 3, 8], dtype=torch.int32), torch.tensor([0, 4, 10], dtype=torch.int32)
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=real, cu_seqlens_kv=real, cu_seqlens_q_padded=padded,
        cu_seqlens_kv_padded=padded, max_seqlen_q=6, max_seqlen_kv=6,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(10, h, 8, generator=gen) for h in (4, 2, 2))
    out = core()(q, k, v, None, packed_seq_params=params)
    rows = torch.tensor([0, 1, 2, 4, 5, 6, 7, 8])
    ref = dense_attention(q[rows], k[rows], v[rows], real, causal=True)
    torch.testing.assert_close(out[rows].double(), ref.reshape(8, 32), atol=1e-5, rtol=1e-5)
    # Padding is its own sequence, so real tokens never see it under any mask.
    out = core(mask=AttnMaskType.no_mask)(q, k, v, None, packed_seq_params=params)
    ref = dense_attention(q[rows], k[rows], v[rows], real, causal=False)
    torch.testing.assert_close(out[rows].double(), ref.reshape(8, 32), atol=1e-5, rtol=1e-5)


def test_per_micro_batch_cp_size_is_refused_by_name() -> None:
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0, 4, 6], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, local_cp_size=2)
    q, k, v = (torch.randn(6, h, 8) for h in (4, 2, 2))
    with pytest.raises(ValueError, match="local_cp_size=2.*hybrid"):
        core()(q, k, v, None, packed_seq_params=params)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--context-parallel-size", "0"], "argument --context-parallel-size: expected an int >= 1"),
        (["--context-parallel-size", "-2"], "argument --context-parallel-size: expected an int >= 1"),
        (["--cp-attention-chunk-size", "0"], "argument --cp-attention-chunk-size: expected an int >= 1"),
        (["--context-parallel-size", "2", "--hierarchical-context-parallel-sizes", "3", "1"], "product 2"),
        (["--context-parallel-size", "2", "--cp-comm-type", "a2a+p2p"], "needs --hierarchical-context-parallel"),
    ],
)
def test_cp_flags_are_refused_by_name(argv, message, capsys) -> None:
    """A CP size of 0 failed in Megatron's rank generator (ZeroDivisionError in the demo), sizes
    whose product is not the CP size in Megatron's bare assert, chunk size 0 named chunk_size."""
    from megatron_cp_ext.megatron.args import add_arguments, add_megatron_cp_arguments, check_cp_args

    parser = argparse.ArgumentParser(prog="train")
    add_megatron_cp_arguments(add_arguments(parser))
    with pytest.raises(SystemExit):
        args = parser.parse_args(argv)
        parser.error(check_cp_args(args) or "accepted")
    assert message in capsys.readouterr().err
    ok = parser.parse_args(["--context-parallel-size", "4", "--hierarchical-context-parallel-sizes", "2", "2"])
    assert check_cp_args(ok) is None


@pytest.mark.parametrize("flag", ["fp8_dot_product_attention", "fp8_multi_head_attention"])
def test_fp8_attention_is_refused_not_ignored(flag) -> None:
    """fp8 attention would silently run in the inputs' dtype here: refused at construction, as
    is fp8 in the CP layer spec (its linears are Megatron's local ones)."""
    cfg = config()
    setattr(cfg, flag, True)  # set after construction: the check is ours, not the config's
    with pytest.raises(ValueError, match=flag):
        core(cfg)
    for low, value in (("fp8", "hybrid"), ("fp4", "nvfp4")):
        cfg = config()
        setattr(cfg, low, value)
        with pytest.raises(ValueError, match=f"config.{low}"):
            cp_layer_spec(cfg)

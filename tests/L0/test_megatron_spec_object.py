"""Megatron-LM's ``--spec megatron_cp_ext.megatron.spec gpt_layer_spec``: the object is fetched the
way ``gpt_builders.py`` fetches it (``spec_utils.import_module([module, name])``, i.e.
``vars(module)[name]``), handed to ``GPTModel`` as its ``transformer_layer_spec``, and every built
layer must be the layer Megatron's own config -> block-spec path chooses (dense or MoE per
``moe_layer_freq``, MLA, qk norms), with our attention swapped in."""

from __future__ import annotations

import argparse
import sys
import types

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_cp_ext.testing.pool import run_on_ranks  # noqa: E402

SETTINGS = {
    "plain": {},
    "qk_norms_rmsnorm": {"qk_layernorm": True, "normalization": "RMSNorm"},
    "mla": {"multi_latent_attention": True},
    "moe_every_other": {"num_moe_experts": 4, "moe_layer_freq": 2},
    "moe_pattern": {"num_moe_experts": 4, "moe_layer_freq": [0, 1, 1]},
}


def _config(setting: dict):
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    setting = dict(setting)
    cls = MLATransformerConfig if setting.pop("multi_latent_attention", False) else TransformerConfig
    base = dict(num_layers=3, hidden_size=32, num_attention_heads=4, attention_dropout=0.0, hidden_dropout=0.0)
    return cls(**base, use_cpu_initialization=True, **setting)


def _spec_the_megatron_lm_way():
    from megatron.core.transformer.spec_utils import import_module

    return import_module(["megatron_cp_ext.megatron.spec", "gpt_layer_spec"])  # args.spec, as parsed


def _mlp_class(mlp) -> str:
    """The MLP class a layer spec names (a ModuleSpec, or a partial from megatron-core 0.18 on)."""
    target = getattr(mlp, "func", None) or getattr(mlp, "module", None)
    return getattr(target, "__name__", "") if isinstance(target, type) else ""


def spec_object_case(rank: int, world: int, setting: dict) -> dict:
    """Worker (1 rank): GPTModel from the --spec object vs Megatron's block spec, and its weights
    and output vs a GPTModel from explicit per-layer ``get_gpt_layer_cp_spec`` specs (same seed)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from megatron_cp_ext.megatron import get_gpt_layer_cp_spec, install_cp_rope
    from megatron_cp_ext.megatron.spec import _local_spec_kwargs

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    cfg = _config(setting)
    theirs = get_gpt_decoder_block_spec(
        cfg, use_transformer_engine=False, normalization=cfg.normalization, qk_l2_norm=cfg.qk_l2_norm, pp_rank=0
    )

    def model(spec):
        torch.manual_seed(0)
        m = GPTModel(cfg, transformer_layer_spec=spec, vocab_size=64, max_sequence_length=16)
        install_cp_rope(m)
        return m

    ours = model(_spec_the_megatron_lm_way())
    moe = [_mlp_class(s.submodules.mlp) == "MoELayer" for s in theirs.layer_specs]
    explicit = []
    for is_moe in moe:
        kw = _local_spec_kwargs(cfg) | ({} if is_moe else {"num_experts": None, "moe_grouped_gemm": False})
        explicit.append(get_gpt_layer_cp_spec(**kw))
    layer_norm = theirs.layer_norm
    twin = model(TransformerBlockSubmodules(layer_specs=explicit, layer_norm=layer_norm))
    a, b = ours.state_dict(), twin.state_dict()
    diff = (
        max((a[k] - b[k]).abs().max().item() for k in a if isinstance(a[k], torch.Tensor))
        if a.keys() == b.keys()
        else 1
    )
    if not any(moe):  # Megatron's MoE forward needs CUDA
        tokens = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(1))
        position_ids = torch.arange(16)[None]
        out, out_twin = (m(tokens, position_ids, None) for m in (ours, twin))
        diff = max(diff, (out - out_twin).abs().max().item())
    built = [ModuleSpec(module=type(layer), submodules=layer.submodules_config) for layer in ours.decoder.layers]
    return {"built": built, "theirs": theirs.layer_specs, "moe": moe, "diff": diff}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_spec_object_builds_the_configs_layers(name: str) -> None:
    from test_megatron_units import _assert_same_layer_as_megatron

    result = run_on_ranks(1, spec_object_case, SETTINGS[name])[0]
    assert len(result["built"]) == len(result["theirs"]) == 3
    for built, theirs in zip(result["built"], result["theirs"]):
        _assert_same_layer_as_megatron(built, theirs)
    if "moe_layer_freq" in SETTINGS[name]:  # the reference itself mixes dense and MoE layers
        assert len(set(result["moe"])) == 2
    assert result["diff"] == 0.0


def test_spec_object_is_a_module_spec_megatron_accepts() -> None:
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import BaseTransformerLayer

    spec = _spec_the_megatron_lm_way()
    # TransformerBlock repeats a layer ModuleSpec per layer only for BaseTransformerLayer subclasses.
    assert isinstance(spec, ModuleSpec) and issubclass(spec.module, BaseTransformerLayer)


def test_options_come_from_megatron_lm_arguments(monkeypatch) -> None:
    from megatron_cp_ext.megatron import add_arguments
    from megatron_cp_ext.megatron.spec import _options_from_training_args

    args = add_arguments(argparse.ArgumentParser()).parse_args(["--cp-load-balance", "contiguous"])
    try:  # megatron-core >= 0.17 ships megatron.training
        from megatron.training import global_vars
    except ImportError:
        global_vars = types.ModuleType("megatron.training.global_vars")
        global_vars._GLOBAL_ARGS = None
        monkeypatch.setitem(sys.modules, "megatron.training.global_vars", global_vars)
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", None)
    assert _options_from_training_args() is None  # arguments not parsed: defaults
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", args)
    assert _options_from_training_args().load_balance == "contiguous"

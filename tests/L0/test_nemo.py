"""``megatron_cp_ext.nemo.apply_cp`` on real nemo_run recipe objects.

NeMo itself (``nemo.collections.llm``) is not installable here, so the recipe is built
exactly as NeMo 2's ``llama3_8b.pretrain_recipe`` builds it - ``run.Partial(pretrain,
model=run.Config(Model, config=run.Config(GPTConfig, ...)), trainer=run.Config(Trainer,
strategy=run.Config(MegatronStrategy, ...)))`` - with small stand-ins for those four NeMo
classes. The GPT config stand-in is a real megatron-core ``TransformerConfig`` subclass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

run = pytest.importorskip("nemo_run")
pytest.importorskip("megatron.core")
import fiddle as fdl  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from megatron_cp_ext.nemo import FIELDS, apply_cp  # noqa: E402


@dataclass
class GPTConfig(TransformerConfig):
    """Stand-in for NeMo 2's GPTConfig: a TransformerConfig plus the layer-spec field."""

    transformer_layer_spec: Any = None
    seq_length: int = 1024


class MegatronStrategy:
    def __init__(self, tensor_model_parallel_size: int = 1, context_parallel_size: int = 1, sequence_parallel=False):
        self.tensor_model_parallel_size = tensor_model_parallel_size
        self.context_parallel_size = context_parallel_size
        self.sequence_parallel = sequence_parallel


class Trainer:
    def __init__(self, strategy=None, devices: int = 8, max_steps: int = 100):
        self.strategy, self.devices, self.max_steps = strategy, devices, max_steps


class LlamaModel:
    def __init__(self, config):
        self.config = config


def pretrain(model, trainer, data=None):
    return model, trainer


def make_recipe(num_layers: int = 4, attention_dropout: float = 0.0):
    config = run.Config(
        GPTConfig,
        num_layers=num_layers,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        attention_dropout=attention_dropout,
        hidden_dropout=0.0,
        use_cpu_initialization=True,
    )
    strategy = run.Config(MegatronStrategy, tensor_model_parallel_size=1, context_parallel_size=1)
    return run.Partial(
        pretrain,
        model=run.Config(LlamaModel, config=config),
        trainer=run.Config(Trainer, strategy=strategy, devices=8),
    )


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted path -> leaf for every argument of a fiddle tree (callables as leaves)."""
    if isinstance(value, fdl.Buildable):
        out = {f"{prefix}<fn>": fdl.get_callable(value)}
        for name, arg in fdl.ordered_arguments(value).items():
            out.update(flatten(arg, f"{prefix}{name}."))
        return out
    return {prefix.rstrip("."): value}


def test_apply_cp_sets_exactly_the_fields_it_claims() -> None:
    recipe = make_recipe()
    before = flatten(recipe)
    assert apply_cp(recipe, context_parallel_size=4, cp_comm_type="a2a+p2p", hierarchical_sizes=[2, 2]) is recipe
    after = flatten(recipe)
    changed = {k for k in before.keys() | after.keys() if before.get(k, "<unset>") != after.get(k, "<unset>")}
    unclaimed = {k for k in changed if not any(k == f or k.startswith(f + ".") for f in FIELDS)}
    assert not unclaimed, f"apply_cp touched fields it does not claim: {sorted(unclaimed)}"
    assert recipe.trainer.strategy.context_parallel_size == 4
    assert recipe.model.config.cp_comm_type == "a2a+p2p"
    assert recipe.model.config.hierarchical_context_parallel_sizes == [2, 2]
    assert recipe.trainer.devices == 8 and recipe.trainer.strategy.tensor_model_parallel_size == 1


def test_built_recipe_yields_our_layer_spec() -> None:
    from megatron_cp_ext.megatron import CPCoreAttention, CPSelfAttention, CPTransformerLayer

    recipe = make_recipe()
    apply_cp(
        recipe, context_parallel_size=2, cp_comm_type=["p2p", "all_gather", "a2a", "auto"], load_balance="contiguous"
    )
    model, trainer = fdl.build(recipe)()
    assert trainer.strategy.context_parallel_size == 2
    config = model.config
    assert config.cp_comm_type == ["p2p", "all_gather", "a2a", "auto"]
    for spec in (config.transformer_layer_spec(config), config.transformer_layer_spec(config, vp_stage=0)):
        assert spec.module is CPTransformerLayer
        attn = spec.submodules.self_attention
        assert attn.module is CPSelfAttention
        core = attn.submodules.core_attention
        assert core.func is CPCoreAttention and core.keywords["options"].load_balance == "contiguous"


def test_recipe_stays_serialisable() -> None:
    from nemo_run.core.serialization.zlib_json import ZlibJSONSerializer

    recipe = apply_cp(make_recipe(), context_parallel_size=2, cp_comm_type="p2p", chunk_size=64)
    ser = ZlibJSONSerializer()
    again = ser.deserialize(ser.serialize(recipe))
    assert again.model.config.transformer_layer_spec.options.chunk_size == 64
    assert again.trainer.strategy.context_parallel_size == 2


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"context_parallel_size": 4, "cp_comm_type": "a2a+p2p"}, "hierarchical"),
        ({"context_parallel_size": 4, "cp_comm_type": "a2a+p2p", "hierarchical_sizes": [2, 3]}, "product 4"),
        ({"context_parallel_size": 2, "cp_comm_type": "ring"}, "p2p"),
        ({"context_parallel_size": 2, "cp_comm_type": ["p2p", "a2a"]}, "4 layers"),
        ({"context_parallel_size": 0}, "context_parallel_size"),
        ({"context_parallel_size": True}, "context_parallel_size"),  # was written as True
        ({"context_parallel_size": 4, "cp_comm_type": "a2a+p2p", "hierarchical_sizes": [2.7, 1.2]}, "two ints"),
        ({"context_parallel_size": 4, "cp_comm_type": "a2a+p2p", "hierarchical_sizes": "22"}, "two ints"),
    ],
)
def test_invalid_requests_raise_before_touching_the_recipe(kwargs, match) -> None:
    recipe = make_recipe()
    before = flatten(recipe)
    with pytest.raises(ValueError, match=match):
        apply_cp(recipe, **kwargs)
    assert flatten(recipe) == before


def test_attention_dropout_must_be_off_and_recipe_shape_is_checked() -> None:
    with pytest.raises(ValueError, match="attention_dropout"):
        apply_cp(make_recipe(attention_dropout=0.1), context_parallel_size=2)
    with pytest.raises(TypeError, match="NeMo 2 recipe"):
        apply_cp(run.Config(LlamaModel, config=None), context_parallel_size=2)


def test_mixed_dense_and_moe_layers_are_refused_when_applied() -> None:
    recipe = make_recipe()
    recipe.model.config.num_moe_experts = 4
    recipe.model.config.moe_layer_freq = 2
    before = flatten(recipe)
    with pytest.raises(ValueError, match="moe_layer_freq"):
        apply_cp(recipe, context_parallel_size=2)
    assert flatten(recipe) == before
    recipe.model.config.moe_layer_freq = [1, 1, 1, 1]  # every layer MoE: one spec fits
    apply_cp(recipe, context_parallel_size=2)


def test_local_attention_backend_and_model_config_alone_are_refused() -> None:
    """NeMo 2's model construction swaps core attention for DotProductAttention under the local
    backend, as Bridge's does: refused when applied, and when the spec is built after a later
    edit. The model config alone (its CP size lives on the strategy) is not a Bridge config."""
    from megatron.core.transformer.enums import AttnBackend

    recipe = make_recipe()
    recipe.model.config.attention_backend = AttnBackend.local
    before = flatten(recipe)
    with pytest.raises(ValueError, match="attention_backend"):
        apply_cp(recipe, context_parallel_size=2)
    assert flatten(recipe) == before
    recipe = make_recipe()
    apply_cp(recipe, context_parallel_size=2)
    recipe.model.config.attention_backend = AttnBackend.local  # e.g. a CLI override afterwards
    config = fdl.build(recipe)()[0].config
    with pytest.raises(ValueError, match="attention_backend"):
        config.transformer_layer_spec(config)
    with pytest.raises(TypeError, match="NeMo 2 recipe"):
        apply_cp(make_recipe().model.config, context_parallel_size=2)

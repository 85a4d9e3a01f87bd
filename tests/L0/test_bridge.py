"""``megatron_cp_ext.bridge.apply_cp`` on Megatron-Bridge-shaped configs.

Megatron-Bridge 0.6.2 does not import on these machines (Python 3.11; it needs 3.12 and imports
TransformerEngine unconditionally), so when ``megatron.bridge`` is missing the model object is a
stand-in with Bridge 0.6.2's field names: ``GPTModelProvider`` is a real megatron-core
``TransformerConfig`` subclass with Bridge's ``transformer_layer_spec``, ``seq_length`` and
``vocab_size`` fields, held at ``ConfigContainer.model``. The YAML test uses megatron-core's real
``megatron.training`` config container (0.18+; the ``to_yaml``/``from_yaml`` and target allowlist
that Bridge's ``ConfigContainer`` inherits), with ``typing.override`` backfilled on Python 3.11.
When ``megatron.bridge`` imports, the real ``GPTModelProvider`` is used instead.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
import warnings
from dataclasses import dataclass
from typing import Any

import pytest

pytest.importorskip("megatron.core")
from megatron.core.transformer.enums import AttnBackend  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from megatron_cp_ext import bridge, nemo  # noqa: E402

try:
    from megatron.bridge.models import GPTModelProvider  # type: ignore[import-not-found]

    REAL_BRIDGE, BRIDGE_IMPORT_ERROR = True, ""
except Exception as _err:  # noqa: BLE001 - absent, or fails to import without TransformerEngine
    REAL_BRIDGE, BRIDGE_IMPORT_ERROR = False, f"{type(_err).__name__}: {_err}"

    @dataclass
    class GPTModelProvider(TransformerConfig):  # type: ignore[no-redef]
        """Stand-in for Bridge's GPTModelProvider (its field names, no model building)."""

        transformer_layer_spec: Any = None
        seq_length: int = 1024
        vocab_size: int | None = None


@dataclass
class ConfigContainer:
    """Stand-in for Bridge's ConfigContainer: only ``.model`` matters to ``apply_cp``."""

    model: Any
    train: Any = None


def test_real_bridge_or_the_stand_in_is_said() -> None:
    """Which ``GPTModelProvider`` the tests of this module run on, said: Bridge's own when it
    imports, else a skip naming why it does not and that a stand-in with its field names is used."""
    if not REAL_BRIDGE:
        pytest.skip(
            f"megatron.bridge does not import here ({BRIDGE_IMPORT_ERROR[:200]}): this module's other tests run "
            "apply_cp on a stand-in GPTModelProvider with Bridge 0.6.2's field names"
        )
    assert GPTModelProvider.__module__.startswith("megatron.bridge")
    config = ConfigContainer(model=make_model())
    bridge.apply_cp(config, context_parallel_size=2)
    assert config.model.context_parallel_size == 2


def make_model(num_layers: int = 4, **kw: Any) -> Any:
    fields = dict(num_layers=num_layers, hidden_size=64, num_attention_heads=4, num_query_groups=2)
    fields.update(hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True, vocab_size=128)
    fields.update(kw)
    return GPTModelProvider(**fields)


def snapshot(model: Any) -> dict[str, Any]:
    return {f.name: getattr(model, f.name) for f in dataclasses.fields(model)}


def test_apply_cp_sets_exactly_the_fields_it_claims() -> None:
    config = ConfigContainer(model=make_model())
    before = snapshot(config.model)
    assert bridge.apply_cp(config, context_parallel_size=4, cp_comm_type="a2a+p2p", hierarchical_sizes=[2, 2]) is config
    after = snapshot(config.model)
    changed = {k for k in before if before[k] != after[k]}
    assert changed <= set(bridge.FIELDS) and {"context_parallel_size", "transformer_layer_spec"} <= changed
    assert config.model.context_parallel_size == 4 and config.model.cp_comm_type == "a2a+p2p"
    assert config.model.hierarchical_context_parallel_sizes == [2, 2]


def test_nemo_apply_cp_hands_bridge_configs_over() -> None:
    model = make_model()
    assert bridge.is_bridge_config(model) and bridge.is_bridge_config(ConfigContainer(model=model))
    assert nemo.apply_cp(model, context_parallel_size=2, load_balance="dualchunk") is model
    assert model.context_parallel_size == 2 and model.transformer_layer_spec.keywords["load_balance"] == "dualchunk"


def test_spec_is_built_the_way_bridge_builds_it() -> None:
    from megatron_cp_ext.megatron import CPCoreAttention, CPSelfAttention, CPTransformerLayer

    model = make_model()
    bridge.apply_cp(model, context_parallel_size=2, cp_comm_type=["p2p", "all_gather", "a2a", "p2p"], chunk_size=64)
    spec_fn = model.transformer_layer_spec
    # Bridge's provide(): call with vp_stage when the callable accepts it, else with the config only.
    assert "vp_stage" in inspect.signature(spec_fn).parameters
    for spec in (spec_fn(model, vp_stage=0), spec_fn(model)):
        assert spec.module is CPTransformerLayer
        attn = spec.submodules.self_attention
        assert attn.module is CPSelfAttention
        core = attn.submodules.core_attention
        assert core.func is CPCoreAttention
        assert core.keywords["options"].chunk_size == 64 and core.keywords["options"].load_balance == "te"
    assert model.cp_comm_type == ["p2p", "all_gather", "a2a", "p2p"]


@pytest.mark.parametrize("backend", [AttnBackend.local, "local", "AttnBackend.local"])
def test_local_attention_backend_is_refused(backend) -> None:
    model = make_model()
    model.attention_backend = backend
    before = snapshot(model)
    with pytest.raises(ValueError, match="attention_backend"):
        bridge.apply_cp(ConfigContainer(model=model), context_parallel_size=2)
    assert snapshot(model) == before
    model = make_model()
    bridge.apply_cp(model, context_parallel_size=2)
    model.attention_backend = backend  # set afterwards (a CLI or YAML override): the spec refuses
    with pytest.raises(ValueError, match="attention_backend"):
        model.transformer_layer_spec(model, vp_stage=0)


def test_per_rank_loss_averaging_is_warned_about() -> None:
    """Without calculate_per_token_loss Megatron averages the CP ranks' own per-token means:
    apply_cp says so at CP > 1, and is silent with it (or at CP 1)."""
    per_rank, per_token, cp1 = make_model(), make_model(calculate_per_token_loss=True), make_model()
    with pytest.warns(UserWarning, match="calculate_per_token_loss"):
        bridge.apply_cp(per_rank, context_parallel_size=2)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        bridge.apply_cp(per_token, context_parallel_size=2)
        bridge.apply_cp(cp1, context_parallel_size=1)
    assert not [w for w in seen if "calculate_per_token_loss" in str(w.message)]


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"context_parallel_size": 4, "cp_comm_type": "a2a+p2p"}, ValueError, "hierarchical"),
        ({"context_parallel_size": 4, "cp_comm_type": "a2a+p2p", "hierarchical_sizes": [2, 3]}, ValueError, "product"),
        ({"context_parallel_size": 2, "cp_comm_type": ["p2p", "a2a"]}, ValueError, "4 layers"),
        ({"context_parallel_size": 2, "load_balance": "zigzag"}, Exception, "load_balance"),
        ({"context_parallel_size": 0}, ValueError, "context_parallel_size"),
    ],
)
def test_invalid_requests_raise_before_touching_the_config(kwargs, error, match) -> None:
    model = make_model()
    before = snapshot(model)
    with pytest.raises(error, match=match):
        bridge.apply_cp(model, **kwargs)
    assert snapshot(model) == before


def test_dropout_and_shape_checks() -> None:
    with pytest.raises(ValueError, match="attention_dropout"):
        bridge.apply_cp(make_model(attention_dropout=0.1), context_parallel_size=2)
    with pytest.raises(TypeError, match="ConfigContainer"):
        bridge.apply_cp(ConfigContainer(model=object()), context_parallel_size=2)


def test_mixed_dense_and_moe_layers_are_refused_when_applied() -> None:
    model = make_model(num_moe_experts=4, moe_layer_freq=[1, 0, 1, 0])
    before = snapshot(model)
    with pytest.raises(ValueError, match="moe_layer_freq"):
        bridge.apply_cp(model, context_parallel_size=2)
    assert snapshot(model) == before
    bridge.apply_cp(make_model(num_moe_experts=4, moe_layer_freq=1), context_parallel_size=2)  # all MoE
    bridge.apply_cp(make_model(num_moe_experts=4, moe_layer_freq=(1, 1, 1, 1)), context_parallel_size=2)  # as a list
    with pytest.raises(ValueError, match="moe_layer_freq"):
        bridge.apply_cp(make_model(num_moe_experts=4, moe_layer_freq=(1, 0, 1, 0)), context_parallel_size=2)


def test_cp_size_of_any_integer_type() -> None:
    """A CP size computed with NumPy (np.int64) is a CP size; a bool or a float is not."""
    import numpy as np

    model = bridge.apply_cp(make_model(), context_parallel_size=np.int64(2))
    assert model.context_parallel_size == 2 and type(model.context_parallel_size) is int
    for bad in (True, 2.0, "2"):
        with pytest.raises(ValueError, match="context_parallel_size"):
            bridge.apply_cp(make_model(), context_parallel_size=bad)


def _megatron_training_container():
    """megatron-core's real config container (0.18+), importable on Python 3.11 too."""
    if not hasattr(typing, "override"):  # Python 3.12 API that megatron.training imports
        typing.override = lambda fn: fn  # type: ignore[attr-defined]
    pytest.importorskip("yaml")
    pytest.importorskip("omegaconf")
    try:
        from megatron.training.config.container import ConfigContainerBase
        from megatron.training.config.instantiate_utils import target_allowlist
    except ImportError as e:
        pytest.skip(f"megatron.training config container not importable (megatron-core < 0.18?): {e}")
    return ConfigContainerBase, target_allowlist


def test_yaml_round_trip_keeps_our_spec_and_needs_the_prefix(tmp_path) -> None:
    base, allowlist = _megatron_training_container()

    @dataclass
    class Container(base):
        model: Any = None

    # The stand-ins live in this test module; Bridge's own classes are under megatron.*.
    globals()["YamlContainer"] = Container
    Container.__qualname__ = Container.__name__ = "YamlContainer"
    allowlist.add_prefix(__name__ + ".")
    config = Container(model=make_model())
    bridge.apply_cp(config, context_parallel_size=2, cp_comm_type="all_gather", load_balance="contiguous")
    path = tmp_path / "config.yaml"
    config.to_yaml(str(path))
    text = path.read_text()
    assert "_target_: megatron_cp_ext.bridge.cp_bridge_layer_spec" in text and "load_balance: contiguous" in text

    allowlist.remove_prefix(bridge.YAML_PREFIX + ".")
    with pytest.raises(Exception, match="megatron_cp_ext"):
        Container.from_yaml(str(path))
    assert "megatron.training" in bridge.register_yaml_targets()
    again = Container.from_yaml(str(path))
    spec_fn = again.model.transformer_layer_spec
    assert isinstance(spec_fn, functools.partial) and spec_fn.func is bridge.cp_bridge_layer_spec
    assert spec_fn.keywords["load_balance"] == "contiguous" and spec_fn.keywords["chunk_size"] is None
    assert again.model.context_parallel_size == 2 and again.model.cp_comm_type == "all_gather"


def test_real_gpt_model_config_of_megatron_training() -> None:
    """megatron-core 0.19's ``GPTModelConfig`` (one of the model types Bridge's ConfigContainer
    holds): CP fields land on its ``transformer`` config, the spec is built from the proxy."""
    _megatron_training_container()
    try:
        from megatron.training.models.gpt import GPTModelConfig
    except ImportError as e:
        pytest.skip(f"megatron.training.models.gpt not importable (megatron-core < 0.19?): {e}")
    from megatron_cp_ext.megatron import CPCoreAttention, CPTransformerLayer

    transformer = make_model(num_layers=2)
    model = GPTModelConfig(
        transformer=TransformerConfig(
            **{f.name: getattr(transformer, f.name) for f in dataclasses.fields(TransformerConfig) if f.init}
        )
    )
    config = ConfigContainer(model=model)
    assert bridge.is_bridge_config(config)
    bridge.apply_cp(config, context_parallel_size=2, cp_comm_type=["p2p", "a2a"])
    assert model.transformer.context_parallel_size == 2 and model.transformer.cp_comm_type == ["p2p", "a2a"]
    spec = model.transformer_layer_spec(model, vp_stage=None)
    assert spec.module is CPTransformerLayer
    assert spec.submodules.self_attention.submodules.core_attention.func is CPCoreAttention
    model.transformer.attention_backend = AttnBackend.local
    with pytest.raises(ValueError, match="attention_backend"):
        bridge.apply_cp(config, context_parallel_size=2)

"""A GPT ``TransformerLayer`` spec with CP attention, RoPE at true positions, local modules.

:func:`get_gpt_layer_cp_spec` starts from Megatron's own local (non-TransformerEngine) GPT
spec and swaps three things:

* ``core_attention`` -> :class:`~.core_attention.CPCoreAttention`;
* ``SelfAttention`` -> :class:`CPSelfAttention`, which rotates q and k by each token's true
  position in its sequence (from the micro-batch's plan, sync-free) instead of Megatron's
  THD RoPE, which assumes TransformerEngine's padded per-rank layout and syncs every layer
  (with ``multi_latent_attention``: ``MLASelfAttention`` -> :class:`~.mla.CPMLASelfAttention`,
  the same idea for MLA's own RoPE/YaRN table);
* ``TransformerLayer`` -> :class:`CPTransformerLayer`, which reads a per-layer
  ``cp_comm_type`` list with the 1-based global layer number. megatron-core 0.16 indexes
  the list with ``layer_number`` directly, which is off by one and raises ``IndexError``
  for the last layer.

Use it as ``GPTModel(config, transformer_layer_spec=get_gpt_layer_cp_spec(), ...)``; on CPU
also call :func:`~.rope.install_cp_rope` on the model.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import sys
from typing import Any

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, get_transformer_layer_offset
from megatron.core.utils import get_pg_rank

from ..recipe_checks import check_attention_backend, check_one_layer_kind
from .core_attention import CPAttentionOptions, CPCoreAttention
from .mla import CPMLASelfAttention, _local_seq_len
from .rope import apply_rope_at_positions, local_rope_freqs
from .subgroups import split_group

try:  # yarn's attention scaling, as Megatron's Attention.forward applies it
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        _yarn_get_concentration_factor_from_config as _rope_mscale,
    )
except ImportError:  # pragma: no cover - older/newer megatron-core

    def _rope_mscale(config: TransformerConfig) -> float:
        return 1.0


_FORWARD_SIGNATURE = inspect.signature(SelfAttention.forward)

__all__ = [
    "CPLayerFromConfig",
    "CPSelfAttention",
    "CPTransformerLayer",
    "cp_layer_spec",
    "get_gpt_layer_cp_spec",
    "gpt_layer_spec",
]


class CPSelfAttention(SelfAttention):
    """Megatron ``SelfAttention`` that applies RoPE at each local token's true position.

    Megatron's ``rotary_pos_emb`` is read as a table indexed by position (the full table
    from :class:`~.rope.CPRotaryEmbedding` or from Megatron's THD path; for sbhd a table
    already sliced to this rank is used as is). The per-token angles are computed once per
    forward and applied right after the q/k projections (and q/k layernorm), where Megatron
    would apply them; Megatron's own RoPE step is then skipped.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.config.fused_single_qkv_rope:
            raise ValueError("CPSelfAttention does not support fused_single_qkv_rope (TransformerEngine-only)")
        self._rope_freqs: torch.Tensor | None = None

    def _local_freqs(self, rotary_pos_emb, hidden_states: torch.Tensor, packed_seq_params) -> torch.Tensor | None:
        if rotary_pos_emb is None:
            return None
        no_rope = self.config.no_rope_freq
        if no_rope and no_rope[self.layer_number - 1]:
            return None
        if isinstance(rotary_pos_emb, tuple):
            if rotary_pos_emb[0] is not rotary_pos_emb[1]:
                raise ValueError("CPSelfAttention needs one RoPE table for q and k (self attention)")
            rotary_pos_emb = rotary_pos_emb[0]
        cp = split_group(self, packed_seq_params)  # Megatron's hybrid CP: the params' own sub-group
        cp_size, cp_rank = (cp.size(), cp.rank()) if cp is not None else (1, 0)
        positions = None
        s_local = _local_seq_len(self, hidden_states)
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            core = self.core_attention
            positions = core.local_positions(packed_seq_params, s_local, rotary_pos_emb.device, rotary_pos_emb.shape[0])
        try:
            return local_rope_freqs(
                rotary_pos_emb, positions=positions, s_local=s_local, cp_size=cp_size, cp_rank=cp_rank
            )
        except ValueError as err:  # sbhd/bshd lengths, table rows: this rank's own values
            if cp_size > 1:  # its peers wait in the exchange of the layer's group or of the params' sub-group
                self.core_attention._refuse_everywhere(err, packed_seq_params)
            raise

    def forward(self, hidden_states, attention_mask, *args: Any, **kwargs: Any):
        """Megatron's forward with RoPE moved to true positions (training/prefill only)."""
        bound = _FORWARD_SIGNATURE.bind(self, hidden_states, attention_mask, *args, **kwargs)
        call = dict(bound.arguments)
        call.pop("self")
        if call.get("inference_context") is not None or call.get("inference_params") is not None:
            raise ValueError("CPSelfAttention is for training; run inference with Megatron's own attention")
        params = call.get("packed_seq_params")
        self._rope_freqs = self._local_freqs(call.get("rotary_pos_emb"), hidden_states, params)
        if self._rope_freqs is None and params is not None and params.qkv_format == "thd":
            self.core_attention.layer_context(params, _local_seq_len(self, hidden_states))  # no RoPE: the checks
        call["rotary_pos_emb"] = None
        try:
            return super().forward(**call)
        finally:
            self._rope_freqs = None

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, *args: Any, **kwargs: Any):
        """Megatron's q/k/v projections, then RoPE on q and k at true positions."""
        out = super().get_query_key_value_tensors(hidden_states, key_value_states, *args, **kwargs)
        freqs = self._rope_freqs
        if freqs is None:
            return out
        query, key, *rest = out
        mscale = _rope_mscale(self.config)
        query = apply_rope_at_positions(query, freqs, self.config, mscale=mscale, cp_group=self.pg_collection.cp)
        key = apply_rope_at_positions(key, freqs, self.config, mscale=mscale, cp_group=self.pg_collection.cp)
        return (query, key, *rest)


def _layer_config(config: TransformerConfig, layer_number: int, vp_stage, pg_collection) -> TransformerConfig:
    """A shallow config copy whose ``cp_comm_type`` is this layer's string (see module doc)."""
    pp_rank = get_pg_rank(pg_collection.pp) if pg_collection is not None and hasattr(pg_collection, "pp") else None
    global_layer = layer_number + get_transformer_layer_offset(config, vp_stage, pp_rank)
    comm_types = config.cp_comm_type
    if not 1 <= global_layer <= len(comm_types):
        raise ValueError(f"cp_comm_type lists {len(comm_types)} layers; layer {global_layer} has no entry")
    layer_config = copy.copy(config)
    layer_config.cp_comm_type = comm_types[global_layer - 1]
    return layer_config


class CPTransformerLayer(TransformerLayer):
    """Megatron ``TransformerLayer`` that honours a per-layer ``cp_comm_type`` list correctly."""

    def __init__(self, config: TransformerConfig, submodules, layer_number: int = 1, *args: Any, **kwargs: Any):
        if isinstance(config.cp_comm_type, (list, tuple)):
            vp_stage = kwargs.get("vp_stage", args[2] if len(args) > 2 else None)
            pg_collection = kwargs.get("pg_collection", args[1] if len(args) > 1 else None)
            config = _layer_config(config, layer_number, vp_stage, pg_collection)
        super().__init__(config, submodules, layer_number, *args, **kwargs)


_CONFIG_FIELD = {
    "num_experts": "num_moe_experts",
    "moe_grouped_gemm": "moe_grouped_gemm",
    "qk_layernorm": "qk_layernorm",
    "multi_latent_attention": "multi_latent_attention",
    "normalization": "normalization",
    "qk_l2_norm": "qk_l2_norm",
    "moe_use_legacy_grouped_gemm": "moe_use_legacy_grouped_gemm",  # megatron-core <= 0.16
}
"""``get_gpt_layer_local_spec`` argument -> the ``TransformerConfig`` field it mirrors; these
are honoured (forwarded to Megatron's local spec, whose modules we keep)."""

REFUSED_LOCAL_SPEC_ARGS = {
    "use_kitchen": "Kitchen replaces linear layers and core attention with its own modules",
    "use_kitchen_attention": "Kitchen attention replaces the core attention this spec provides",
}
"""Local-spec arguments this spec refuses when set (a clear ``ValueError`` naming them)."""

IGNORED_LOCAL_SPEC_ARGS = {
    "fp8": "deprecated and unused by Megatron's local spec itself",
    "kitchen_attention_backend": "only read together with use_kitchen (refused)",
}
"""Local-spec arguments without effect on a non-Kitchen local spec; accepted and forwarded."""

_CP_ATTENTION = {SelfAttention: CPSelfAttention, MLASelfAttention: CPMLASelfAttention}


def _local_spec(kwargs: dict[str, Any]) -> ModuleSpec:
    """Megatron's local spec for ``kwargs``, refusing what our attention cannot honour."""
    accepted = inspect.signature(get_gpt_layer_local_spec).parameters
    for name, why in REFUSED_LOCAL_SPEC_ARGS.items():
        if kwargs.get(name):
            raise ValueError(f"get_gpt_layer_cp_spec does not support {name}=True ({why}); set {name}=False")
    if kwargs.get("multi_latent_attention") and kwargs.get("qk_l2_norm"):
        raise ValueError("qk_l2_norm is not supported with multi_latent_attention (as in Megatron's local spec)")
    unknown = [k for k, v in kwargs.items() if k not in accepted and v not in (None, False)]
    if unknown:
        raise ValueError(f"this megatron-core's get_gpt_layer_local_spec has no argument {unknown}")
    return get_gpt_layer_local_spec(**{k: v for k, v in kwargs.items() if k in accepted})


def get_gpt_layer_cp_spec(
    *,
    qk_layernorm: bool = False,
    normalization: str | None = None,
    qk_l2_norm: bool = False,
    num_experts: int | None = None,
    moe_grouped_gemm: bool = False,
    multi_latent_attention: bool = False,
    options: CPAttentionOptions | None = None,
    **local_spec_kwargs: Any,
) -> ModuleSpec:
    """``ModuleSpec`` of a GPT ``TransformerLayer`` with CP attention (local, non-TE modules).

    Args are ``get_gpt_layer_local_spec``'s (any other of its arguments may be passed by
    keyword; Kitchen is refused); ``options`` carries what Megatron's config lacks (THD load
    balance, attention backend, chunk size). ``multi_latent_attention=True`` builds Megatron's
    MLA as :class:`~.mla.CPMLASelfAttention`.
    """
    base = _local_spec(
        dict(
            num_experts=num_experts,
            moe_grouped_gemm=moe_grouped_gemm,
            qk_layernorm=qk_layernorm,
            multi_latent_attention=multi_latent_attention,
            normalization=normalization,
            qk_l2_norm=qk_l2_norm,
            **local_spec_kwargs,
        )
    )
    attn = base.submodules.self_attention
    cp_module = _CP_ATTENTION.get(attn.module)
    if cp_module is None:  # pragma: no cover - a future megatron-core attention class
        raise ValueError(f"no CP variant of {attn.module.__name__}; this megatron-core is untested")
    opts = options or CPAttentionOptions()
    # SelfAttention calls its core_attention entry; MLA passes it through build_module.
    if cp_module is CPMLASelfAttention:
        core: Any = ModuleSpec(module=CPCoreAttention, params={"options": opts})
    else:
        core = functools.partial(CPCoreAttention, options=opts)
    self_attention = ModuleSpec(
        module=cp_module,
        params=dict(attn.params),
        submodules=dataclasses.replace(attn.submodules, core_attention=core),
    )
    return ModuleSpec(
        module=CPTransformerLayer,
        params=dict(base.params),
        submodules=dataclasses.replace(base.submodules, self_attention=self_attention),
    )


def cp_layer_spec(
    config: TransformerConfig, vp_stage: int | None = None, *, options: CPAttentionOptions | None = None
) -> ModuleSpec:
    """``transformer_layer_spec`` callable for NeMo-style configs: ``spec = fn(config)``.

    Reads every config field Megatron's local spec has an argument for (``_CONFIG_FIELD``)
    and refuses Kitchen; bind ``options`` with a partial (what
    :func:`megatron_cp_ext.nemo.apply_cp` does).
    """
    check_one_layer_kind(config)
    check_attention_backend(config, "config.attention_backend")
    for low in ("fp8", "fp4"):
        if getattr(config, low, None):
            raise ValueError(
                f"config.{low} is {getattr(config, low)!r}, but this spec's linear layers are Megatron's local "
                f"ones, which do not run {low} (it would silently train in the params' dtype): unset it"
            )
    return get_gpt_layer_cp_spec(options=options, **_local_spec_kwargs(config))


def _local_spec_kwargs(config: TransformerConfig) -> dict[str, Any]:
    """``get_gpt_layer_local_spec`` keyword arguments that mirror ``config`` (see ``_CONFIG_FIELD``)."""
    accepted = inspect.signature(get_gpt_layer_local_spec).parameters
    kwargs = {
        arg: getattr(config, field, accepted[arg].default) for arg, field in _CONFIG_FIELD.items() if arg in accepted
    }
    for arg in REFUSED_LOCAL_SPEC_ARGS:
        if arg in accepted:
            kwargs[arg] = bool(getattr(config, arg, False))
    return kwargs


def _is_moe_layer(config: TransformerConfig, global_layer: int) -> bool:
    """Megatron's ``moe_layer_freq`` rule (``get_gpt_decoder_block_spec``) for a 1-based layer."""
    if not getattr(config, "num_moe_experts", None):
        return False
    freq = getattr(config, "moe_layer_freq", 1)
    if isinstance(freq, int):
        return (global_layer - 1) % freq == 0
    if len(freq) != config.num_layers:
        raise ValueError(f"moe_layer_freq lists {len(freq)} layers, config.num_layers is {config.num_layers}")
    return bool(freq[global_layer - 1])


def _options_from_training_args() -> CPAttentionOptions | None:
    """The package's options from Megatron-LM's parsed arguments, when this process is a
    Megatron-LM training script (``megatron.training`` imported and its arguments parsed)."""
    global_vars = sys.modules.get("megatron.training.global_vars")
    args = getattr(global_vars, "_GLOBAL_ARGS", None)
    if args is None:
        return None
    from .args import cp_attention_options_from_args

    return cp_attention_options_from_args(args)


class CPLayerFromConfig(CPTransformerLayer):
    """The layer class of :data:`gpt_layer_spec`: constructing it builds the layer that the
    config asks for.

    Megatron-LM's ``--spec MODULE NAME`` takes a spec *object*, fixed before any config exists,
    while the right layer depends on the config (MLA, MoE per ``moe_layer_freq``, qk norms,
    normalization). Megatron repeats a layer ``ModuleSpec`` for every layer and builds each with
    ``build_module(spec, config=..., layer_number=..., ...)``, so this class defers there:
    ``__new__`` builds :func:`get_gpt_layer_cp_spec` for that layer's config and returns it (a
    :class:`CPTransformerLayer`; ``__init__`` of this class never runs). Options come from
    Megatron-LM's parsed arguments (:func:`~.args.add_arguments`) when present, else defaults.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> CPTransformerLayer:  # type: ignore[misc]
        bound = _LAYER_SIGNATURE.bind_partial(None, *args, **kwargs).arguments
        config, layer_number = bound["config"], bound.get("layer_number", 1)
        pg_collection, vp_stage = bound.get("pg_collection"), bound.get("vp_stage")
        pp_rank = get_pg_rank(pg_collection.pp) if pg_collection is not None and hasattr(pg_collection, "pp") else None
        global_layer = layer_number + get_transformer_layer_offset(config, vp_stage, pp_rank)
        local_kwargs = _local_spec_kwargs(config)
        if not _is_moe_layer(config, global_layer):
            local_kwargs.update(num_experts=None, moe_grouped_gemm=False)
        spec = get_gpt_layer_cp_spec(options=_options_from_training_args(), **local_kwargs)
        kwargs.pop("submodules", None)
        return build_module(spec, *args, **kwargs)


_LAYER_SIGNATURE = inspect.signature(TransformerLayer.__init__)

gpt_layer_spec = ModuleSpec(module=CPLayerFromConfig)
"""A GPT layer spec object for Megatron-LM's ``--spec megatron_cp_ext.megatron.spec gpt_layer_spec``:
every layer is built from the run's config as :func:`cp_layer_spec` builds it (and dense or MoE
per ``moe_layer_freq``); see :class:`CPLayerFromConfig` and ``docs/megatron.md``."""

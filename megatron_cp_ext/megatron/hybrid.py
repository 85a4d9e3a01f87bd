"""CP attention layers for megatron-core's ``HybridModel`` (0.19+: Mamba / attention hybrids).

``HybridModel`` builds its layers from a ``HybridStack`` spec with one entry per layer symbol
of ``hybrid_layer_pattern`` (``*`` attention, ``-`` MLP, ``M`` Mamba, ...). Its attention
layers are ordinary ``TransformerLayer`` specs without an MLP, so the GPT layer spec of
:mod:`.spec` carries over with the MLP half removed. :func:`get_hybrid_stack_cp_spec` either
starts from a given stack spec (e.g. Megatron's TransformerEngine ``hybrid_stack_spec`` on a
GPU machine) and swaps its attention and MLA layers for ours, or builds a local (non-TE) stack
of attention (``*``), MLA (``+``) and MLP (``-``) layers in which every other layer kind refuses to be built, by name,
instead of silently becoming an identity.

Mamba layers need the ``mamba-ssm`` / ``causal-conv1d`` CUDA kernels; they are untested here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
from megatron.core.ssm.mlp_layer import MLPLayer
from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec

from .core_attention import CPAttentionOptions
from .spec import get_gpt_layer_cp_spec

__all__ = ["get_hybrid_stack_cp_spec"]


class _RefusedLayer:
    """Stands for a hybrid layer kind the local stack has no module for."""

    def __init__(self, *args: Any, symbol: str, kind: str, **kwargs: Any) -> None:
        raise ValueError(
            f"hybrid_layer_pattern uses {symbol!r} ({kind}), which get_hybrid_stack_cp_spec's local stack does not "
            "build; pass base= a stack spec that has it (e.g. Megatron's TransformerEngine hybrid_stack_spec)"
        )


_REFUSED = {
    "mamba_layer": ("M", "Mamba"),
    "gdn_layer": ("G", "gated delta net"),
    "dsa_layer": ("D", "DSA"),
    "moe_layer": ("E", "MoE"),
}


def _attention_only(layer: ModuleSpec) -> ModuleSpec:
    """A GPT layer spec with its MLP half removed (hybrid attention layers have none)."""
    sub = dataclasses.replace(layer.submodules, pre_mlp_layernorm=IdentityOp, mlp=IdentityOp, mlp_bda=IdentityFuncOp)
    return dataclasses.replace(layer, submodules=sub)


def get_hybrid_stack_cp_spec(
    *,
    base: ModuleSpec | None = None,
    options: CPAttentionOptions | None = None,
    post_layer_norm: bool | None = None,
    **layer_kwargs: Any,
) -> ModuleSpec:
    """``hybrid_stack_spec`` for ``HybridModel`` whose attention (``*``) and MLA layers use CP.

    ``base``: a stack spec to start from (its other layer kinds are kept); ``None`` builds a
    local stack of attention and MLP (``-``) layers. ``layer_kwargs`` are
    :func:`~.spec.get_gpt_layer_cp_spec`'s (``normalization``, ``qk_layernorm``, ...).
    ``post_layer_norm``: the stack's final norm, which ``HybridStack`` always builds with
    TransformerEngine; the local stack defaults it to ``False``.
    """
    layer_kwargs.pop("multi_latent_attention", None)
    attention = _attention_only(get_gpt_layer_cp_spec(options=options, **layer_kwargs))
    mla = _attention_only(get_gpt_layer_cp_spec(options=options, multi_latent_attention=True, **layer_kwargs))
    if base is not None:
        submodules = dataclasses.replace(base.submodules, attention_layer=attention, mla_layer=mla)
        params = dict(base.params)
    else:
        dense = get_gpt_layer_cp_spec(options=options, **layer_kwargs).submodules
        mlp = ModuleSpec(
            module=MLPLayer,
            submodules=dataclasses.replace(
                dense, input_layernorm=IdentityOp, self_attention=IdentityOp, self_attn_bda=IdentityFuncOp
            ),
        )
        refused = {
            name: ModuleSpec(module=_RefusedLayer, params={"symbol": symbol, "kind": kind})
            for name, (symbol, kind) in _REFUSED.items()
        }
        submodules = HybridStackSubmodules(attention_layer=attention, mla_layer=mla, mlp_layer=mlp, **refused)
        params = {"post_layer_norm": False}
    if post_layer_norm is not None:
        params["post_layer_norm"] = post_layer_norm
    return ModuleSpec(module=base.module if base is not None else HybridStack, params=params, submodules=submodules)

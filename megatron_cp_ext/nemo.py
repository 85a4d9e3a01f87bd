"""NeMo 2 recipe override: turn on megatron_cp_ext context parallelism in one call.

A NeMo 2 recipe is a ``nemo_run`` ``Partial`` whose ``trainer.strategy`` (``MegatronStrategy``)
holds the parallel sizes and whose ``model.config`` (a ``GPTConfig``) holds the layer spec.
:func:`apply_cp` sets exactly the fields listed in :data:`FIELDS` and nothing else:

* ``trainer.strategy.context_parallel_size``
* ``model.config.cp_comm_type`` - a string, or one entry per layer
* ``model.config.hierarchical_context_parallel_sizes`` - NeMo 2 does not create Megatron's
  hierarchical groups from it; our core attention builds them from this field itself
* ``model.config.transformer_layer_spec`` - ``cp_layer_spec`` bound to our options

It validates up front what would otherwise fail late on the cluster: comm type names, the
per-layer list length, a2a+p2p without hierarchical sizes (never silently CP-off), sizes
whose product is not the CP size, and attention dropout (not implemented by our attention).
A Megatron-Bridge ``ConfigContainer`` or GPT model provider given to :func:`apply_cp` is handed
to :func:`megatron_cp_ext.bridge.apply_cp` (same arguments, Bridge's field layout).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from .recipe_checks import (
    check_attention_backend,
    check_comm_type,
    check_cp_size,
    check_hierarchical,
    check_one_layer_kind,
)

__all__ = ["FIELDS", "apply_cp"]

FIELDS = (
    "trainer.strategy.context_parallel_size",
    "model.config.cp_comm_type",
    "model.config.hierarchical_context_parallel_sizes",
    "model.config.transformer_layer_spec",
)
"""Dotted paths of every field :func:`apply_cp` writes."""


def _locate(recipe: Any) -> tuple[Any, Any]:
    """``(strategy, model_config)`` of a NeMo 2 recipe, or a TypeError saying what is expected."""
    try:
        strategy = recipe.trainer.strategy
        config = recipe.model.config
    except AttributeError as e:
        raise TypeError(
            "apply_cp expects a NeMo 2 recipe with .trainer.strategy (MegatronStrategy) and "
            f".model.config (GPTConfig); got {type(recipe).__name__}: {e}"
        ) from None
    if strategy is None or config is None:
        raise TypeError("apply_cp: recipe.trainer.strategy and recipe.model.config must be set")
    return strategy, config


def _layer_spec(recipe: Any, options: Any) -> Any:
    """``cp_layer_spec`` bound to ``options``: a nemo_run Partial inside fiddle recipes (so
    the recipe stays serialisable), a functools.partial for already-built objects."""
    from .megatron.core_attention import CPAttentionOptions
    from .megatron.spec import cp_layer_spec

    try:
        import fiddle as fdl
        import nemo_run as run
    except ImportError:
        fdl = run = None
    if fdl is not None and isinstance(recipe, fdl.Buildable):
        fields = {k: getattr(options, k) for k in ("load_balance", "backend", "chunk_size")}
        return run.Partial(cp_layer_spec, options=run.Config(CPAttentionOptions, **fields))
    return functools.partial(cp_layer_spec, options=options)


def apply_cp(
    recipe: Any,
    *,
    context_parallel_size: int,
    cp_comm_type: str | Sequence[str] = "p2p",
    hierarchical_sizes: Sequence[int] | None = None,
    load_balance: str = "te",
    backend: str = "auto",
    chunk_size: int | None = None,
) -> Any:
    """Configure ``recipe`` (modified in place and returned) for megatron_cp_ext CP.

    A Megatron-Bridge ``ConfigContainer`` / GPT model provider goes to
    :func:`megatron_cp_ext.bridge.apply_cp` instead.

    Args:
        context_parallel_size: CP degree (the strategy's ``context_parallel_size``).
        cp_comm_type: ``p2p`` | ``all_gather`` | ``a2a`` | ``a2a+p2p``, or one per layer.
        hierarchical_sizes: ``[a2a, p2p]`` for ``a2a+p2p`` (product = CP size).
        load_balance, backend, chunk_size: see :class:`~megatron_cp_ext.megatron.CPAttentionOptions`.
    """
    from . import bridge
    from .megatron.core_attention import CPAttentionOptions

    if bridge.is_bridge_config(recipe):
        return bridge.apply_cp(
            recipe,
            context_parallel_size=context_parallel_size,
            cp_comm_type=cp_comm_type,
            hierarchical_sizes=hierarchical_sizes,
            load_balance=load_balance,
            backend=backend,
            chunk_size=chunk_size,
        )
    context_parallel_size = check_cp_size(context_parallel_size)
    strategy, config = _locate(recipe)
    kinds = check_comm_type(cp_comm_type, getattr(config, "num_layers", None))
    sizes = check_hierarchical(hierarchical_sizes, context_parallel_size, kinds)
    check_one_layer_kind(config)
    check_attention_backend(config, "model.config.attention_backend")
    dropout = getattr(config, "attention_dropout", 0.0)
    if dropout:
        raise ValueError(
            f"model.config.attention_dropout is {dropout}; megatron_cp_ext attention does not implement "
            "dropout - set it to 0.0 in the recipe first"
        )
    options = CPAttentionOptions(load_balance=load_balance, backend=backend, chunk_size=chunk_size)
    strategy.context_parallel_size = context_parallel_size
    config.cp_comm_type = kinds
    config.hierarchical_context_parallel_sizes = sizes
    config.transformer_layer_spec = _layer_spec(recipe, options)
    return recipe

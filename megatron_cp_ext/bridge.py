"""Megatron-Bridge override: turn on megatron_cp_ext context parallelism in a Bridge config.

Megatron-Bridge (0.6.x) keeps every model setting on one model object: a ``GPTModelProvider``
(a ``TransformerConfig`` subclass) or a ``GPTModelConfig`` (which forwards unknown attributes to
its ``transformer`` config), found at ``ConfigContainer.model``. :func:`apply_cp` takes the
container or the model object and sets exactly the fields in :data:`FIELDS`:

* ``context_parallel_size``
* ``cp_comm_type`` - a string, or one entry per layer
* ``hierarchical_context_parallel_sizes`` - ``[a2a, p2p]`` for ``a2a+p2p``
* ``transformer_layer_spec`` - :func:`cp_bridge_layer_spec` bound (``functools.partial``) to the
  load balance, backend and chunk size as plain keywords, so that ``to_yaml`` writes them out as
  values and ``from_yaml`` rebuilds the same spec

Two Bridge behaviours need care, and both are handled here:

* Bridge instantiates YAML ``_target_`` entries only under allow-listed module prefixes
  (``megatron.``, ``torch.``, ... - ``megatron_cp_ext.`` is not one). :func:`register_yaml_targets`
  adds ours, through Bridge's ``register_allowed_target_prefix`` and megatron-core's own
  ``target_allowlist``; importing this module calls it, so import it before ``from_yaml``.
* With ``attention_backend`` set to ``local``, Bridge's model construction replaces the layer
  spec's ``core_attention`` with Megatron's ``DotProductAttention``, silently dropping ours.
  :func:`apply_cp` refuses such a config (a ValueError naming the field).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

__all__ = ["FIELDS", "apply_cp", "cp_bridge_layer_spec", "is_bridge_config", "register_yaml_targets"]

FIELDS = (
    "context_parallel_size",
    "cp_comm_type",
    "hierarchical_context_parallel_sizes",
    "transformer_layer_spec",
)
"""Fields of the model object (``ConfigContainer.model``) that :func:`apply_cp` writes."""

YAML_PREFIX = "megatron_cp_ext"
"""Module prefix Bridge's YAML loader must allow for our layer-spec target."""


def _is_model(obj: Any) -> bool:
    return hasattr(obj, "transformer_layer_spec") and hasattr(obj, "context_parallel_size")


def is_bridge_config(obj: Any) -> bool:
    """True for a Bridge ``ConfigContainer`` (a ``.model`` provider, no NeMo ``.trainer``) or a
    GPT model provider / model config itself; never for a fiddle config (a NeMo recipe's part,
    e.g. ``recipe.model.config``, whose CP size the NeMo strategy would overwrite)."""
    if any(c.__module__.startswith("fiddle") for c in type(obj).__mro__):
        return False
    if _is_model(obj):
        return True
    return not hasattr(obj, "trainer") and _is_model(getattr(obj, "model", None))


def cp_bridge_layer_spec(
    config: Any,
    vp_stage: int | None = None,
    *,
    load_balance: str = "te",
    backend: str = "auto",
    chunk_size: int | None = None,
    check: bool = False,
) -> Any:
    """``transformer_layer_spec`` for Bridge model objects: ``spec = fn(config, vp_stage=...)``.

    :func:`megatron_cp_ext.megatron.cp_layer_spec` with the :class:`CPAttentionOptions` fields as
    plain keywords (a YAML-friendly partial; an options object would be written as its class only).
    """
    from .megatron.core_attention import CPAttentionOptions
    from .megatron.spec import cp_layer_spec

    options = CPAttentionOptions(load_balance=load_balance, backend=backend, chunk_size=chunk_size, check=check)
    return cp_layer_spec(config, vp_stage, options=options)


def register_yaml_targets() -> list[str]:
    """Allow ``megatron_cp_ext.*`` YAML targets in Bridge and in megatron-core's loader.

    Returns the registries updated (empty when neither package is importable; then there is no
    YAML loader to configure). Safe to call more than once.
    """
    done = []
    try:
        from megatron.bridge.utils.instantiate_utils import register_allowed_target_prefix
    except Exception:  # Bridge absent, or it cannot import here (it needs TransformerEngine)
        pass
    else:
        register_allowed_target_prefix(YAML_PREFIX)
        done.append("megatron.bridge")
    try:
        from megatron.training.config.instantiate_utils import target_allowlist
    except Exception:  # megatron-core < 0.19 has no megatron.training
        pass
    else:
        target_allowlist.add_prefix(YAML_PREFIX + ".")
        done.append("megatron.training")
    return done


def apply_cp(
    config: Any,
    *,
    context_parallel_size: int,
    cp_comm_type: str | Sequence[str] = "p2p",
    hierarchical_sizes: Sequence[int] | None = None,
    load_balance: str = "te",
    backend: str = "auto",
    chunk_size: int | None = None,
) -> Any:
    """Configure a Bridge ``ConfigContainer`` or GPT model provider (in place; returned).

    Args:
        context_parallel_size: CP degree.
        cp_comm_type: ``p2p`` | ``all_gather`` | ``a2a`` | ``a2a+p2p``, or one per layer.
        hierarchical_sizes: ``[a2a, p2p]`` for ``a2a+p2p`` (product = CP size).
        load_balance, backend, chunk_size: see :class:`~megatron_cp_ext.megatron.CPAttentionOptions`.

    Raises ValueError, before writing anything, for invalid requests, ``attention_dropout`` > 0 and
    an ``attention_backend`` that would make Bridge replace our core attention.
    """
    from .megatron.core_attention import CPAttentionOptions
    from .recipe_checks import (
        check_attention_backend,
        check_comm_type,
        check_cp_size,
        check_hierarchical,
        check_one_layer_kind,
        warn_per_rank_loss,
    )

    context_parallel_size = check_cp_size(context_parallel_size)
    model = config if _is_model(config) else getattr(config, "model", None)
    if not _is_model(model):
        raise TypeError(
            "megatron_cp_ext.bridge.apply_cp expects a Megatron-Bridge ConfigContainer (with .model) or a GPT "
            f"model provider (with transformer_layer_spec and context_parallel_size); got {type(config).__name__}"
        )
    kinds = check_comm_type(cp_comm_type, getattr(model, "num_layers", None))
    sizes = check_hierarchical(hierarchical_sizes, context_parallel_size, kinds)
    check_one_layer_kind(model)
    check_attention_backend(model, "model.attention_backend")
    dropout = getattr(model, "attention_dropout", 0.0)
    if dropout:
        raise ValueError(
            f"model.attention_dropout is {dropout}; megatron_cp_ext attention does not implement dropout - "
            "set it to 0.0 first"
        )
    CPAttentionOptions(load_balance=load_balance, backend=backend, chunk_size=chunk_size)  # validates
    warn_per_rank_loss(model, context_parallel_size)
    register_yaml_targets()
    model.context_parallel_size = context_parallel_size
    model.cp_comm_type = kinds
    model.hierarchical_context_parallel_sizes = sizes
    model.transformer_layer_spec = functools.partial(
        cp_bridge_layer_spec, load_balance=load_balance, backend=backend, chunk_size=chunk_size
    )
    return config


register_yaml_targets()

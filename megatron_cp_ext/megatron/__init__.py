"""Megatron-core integration: core attention, layer specs (GPT, MLA, HybridModel), batch split, RoPE, arguments.

Everything here needs ``megatron-core`` (0.16 to 0.19); the core package does not. Names are
resolved lazily so that ``import megatron_cp_ext.megatron`` is cheap and a missing
megatron-core produces one clear error naming the install line, not an import-time crash
deep inside Megatron. :mod:`.args` is plain ``argparse`` and works without megatron-core.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "CPAttentionOptions",
    "CPCoreAttention",
    "CPLayerFromConfig",
    "CPMLARotaryEmbedding",
    "CPMLASelfAttention",
    "CPRotaryEmbedding",
    "CPSelfAttention",
    "CPTransformerLayer",
    "add_arguments",
    "add_megatron_cp_arguments",
    "cp_attention_options_from_args",
    "cp_layer_spec",
    "get_gpt_layer_cp_spec",
    "get_hybrid_stack_cp_spec",
    "gpt_layer_spec",
    "install_cp_rope",
    "make_packed_seq_params",
    "shard_batch_for_cp",
]

_HOME = {
    "CPAttentionOptions": "core_attention",
    "CPCoreAttention": "core_attention",
    "CPRotaryEmbedding": "rope",
    "install_cp_rope": "rope",
    "CPSelfAttention": "spec",
    "CPTransformerLayer": "spec",
    "cp_layer_spec": "spec",
    "get_gpt_layer_cp_spec": "spec",
    "gpt_layer_spec": "spec",
    "CPLayerFromConfig": "spec",
    "CPMLARotaryEmbedding": "mla",
    "CPMLASelfAttention": "mla",
    "shard_batch_for_cp": "batch",
    "get_hybrid_stack_cp_spec": "hybrid",
    "make_packed_seq_params": "batch",
    "add_arguments": "args",
    "add_megatron_cp_arguments": "args",
    "cp_attention_options_from_args": "args",
}

INSTALL_HINT = 'pip install "megatron-core>=0.16.1,<0.20" einops'


def require_megatron() -> None:
    """Raise one actionable ImportError when megatron-core is not installed."""
    try:
        importlib.import_module("megatron.core")
    except ImportError as e:  # pragma: no cover - exercised only without megatron-core
        raise ImportError(f"megatron_cp_ext.megatron needs megatron-core 0.16.1 to 0.19.x ({INSTALL_HINT}): {e}") from e


_RENAMED = {
    "get_batch_on_this_cp_rank": (
        "shard_batch_for_cp(batch, cu_seqlens=..., cp_group=..., balance=..., causal=..., window_size=..., "
        "chunk_size=...) (renamed so as not to shadow Megatron's get_batch_on_this_cp_rank, whose contract differs)"
    ),
}


def __getattr__(name: str) -> Any:
    if name in _RENAMED:
        # ImportError, not AttributeError: ``from ... import`` would replace an AttributeError's text.
        raise ImportError(f"megatron_cp_ext.megatron.{name} is now {_RENAMED[name]}")
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if home != "args":
        require_megatron()
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)


def __dir__() -> list[str]:
    return sorted(__all__)

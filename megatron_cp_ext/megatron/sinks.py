"""Megatron's ``softmax_type`` for :class:`~.core_attention.CPCoreAttention`: the attention-sink
offset created, initialised and checkpointed as Megatron's own ``DotProductAttention`` does.

``vanilla``: no offset. ``off-by-one``: zeros (each softmax denominator gains 1), not a
parameter. ``learnable``: a parameter ``[heads of this tensor-parallel partition]`` in
``params_dtype``, initialised with ``config.init_method``; its gradient on a CP rank is that
rank's partial, and Megatron's data-parallel reduction (over data-parallel x context-parallel
ranks) sums it — exactly what the engine's ``softmax_offset`` contract expects.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

__all__ = ["SOFTMAX_TYPES", "install_softmax_offset", "offset_sharded_state_dict"]

SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")


def _device(config: TransformerConfig) -> torch.device:
    cpu = getattr(config, "use_cpu_initialization", False) or not torch.cuda.is_available()
    return torch.device("cpu") if cpu else torch.device("cuda", torch.cuda.current_device())


def install_softmax_offset(module: torch.nn.Module, config: TransformerConfig, tp_size: int) -> None:
    """Give ``module`` its ``softmax_offset`` (None, a zeros tensor, or a parameter)."""
    kind = getattr(config, "softmax_type", "vanilla")
    if kind not in SOFTMAX_TYPES:
        raise ValueError(f"config.softmax_type must be one of {SOFTMAX_TYPES}, got {kind!r}")
    if config.num_attention_heads % tp_size:
        raise ValueError(f"num_attention_heads ({config.num_attention_heads}) must divide by the TP size ({tp_size})")
    heads = config.num_attention_heads // tp_size
    if kind == "vanilla":
        module.softmax_offset = None
    elif kind == "off-by-one":
        module.softmax_offset = torch.zeros(heads, device=_device(config), dtype=config.params_dtype)
    else:
        param = torch.nn.Parameter(torch.empty(heads, device=_device(config), dtype=config.params_dtype))
        module.register_parameter("softmax_offset", param)
        if config.perform_initialization:
            config.init_method(module.softmax_offset)


def offset_sharded_state_dict(module, prefix: str, sharded_offsets, metadata, tp_group) -> dict:
    """Megatron's sharded checkpoint entry for a learnable offset (split along TP like heads)."""
    if getattr(module.config, "softmax_type", "vanilla") != "learnable":
        return {}
    state = module.state_dict(prefix="", keep_vars=True)
    dp_cp = (metadata or {}).get("dp_cp_group")
    return make_sharded_tensors_for_checkpoint(
        state, prefix, {"softmax_offset": 0}, sharded_offsets, tp_group=tp_group, dp_cp_group=dp_cp
    )

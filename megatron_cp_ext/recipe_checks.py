"""Checks shared by the NeMo 2 (:mod:`.nemo`) and Megatron-Bridge (:mod:`.bridge`) overrides.

Both validate the same comm-type and hierarchical-size requests before writing a config; the
checks live here so that neither override imports the other for them (:mod:`.nemo` hands Bridge
configs to :mod:`.bridge`, never the reverse). Pure Python: no Megatron, NeMo or torch import.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

__all__ = ["check_cp_size", "check_comm_type", "check_hierarchical", "check_one_layer_kind"]

_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p", "auto")  # auto: the planner picks per micro-batch


def check_cp_size(context_parallel_size: object) -> int:
    """The CP size as a Python int: any integer type (NumPy's too), never a bool, at least 1."""
    from .runtime.validation import as_int  # torch-free at import, as the module promises

    return as_int(context_parallel_size, "context_parallel_size", minimum=1)


def check_comm_type(cp_comm_type: str | Sequence[str], num_layers: int | None) -> str | list[str]:
    """The validated comm type: a string, or a list with one valid entry per layer."""
    kinds = [cp_comm_type] if isinstance(cp_comm_type, str) else list(cp_comm_type)
    bad = [k for k in kinds if k not in _COMM_TYPES]
    if bad or not kinds:
        raise ValueError(
            f"cp_comm_type entries must be in {_COMM_TYPES} (a string or a per-layer list), got {bad or kinds}"
        )
    if isinstance(cp_comm_type, str):
        return cp_comm_type
    if num_layers is not None and len(kinds) != num_layers:
        raise ValueError(f"per-layer cp_comm_type has {len(kinds)} entries; the model has {num_layers} layers")
    return kinds


def check_hierarchical(
    sizes: Sequence[int] | None, context_parallel_size: int, kinds: str | list[str]
) -> list[int] | None:
    """The validated ``[a2a, p2p]`` sizes (None when not given and not needed)."""
    uses_hcp = "a2a+p2p" in ([kinds] if isinstance(kinds, str) else kinds)
    if sizes is None:
        if uses_hcp and context_parallel_size > 1:
            raise ValueError(
                "cp_comm_type 'a2a+p2p' needs hierarchical_sizes=[a2a, p2p] with product "
                f"{context_parallel_size}; refusing to run it without hierarchical groups"
            )
        return None
    if isinstance(sizes, (str, bytes)) or not all(
        isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in sizes
    ):
        raise ValueError(f"hierarchical_sizes must be two ints [a2a, p2p], got {sizes!r}")
    sizes = [int(s) for s in sizes]
    if len(sizes) != 2 or sizes[0] * sizes[1] != context_parallel_size or min(sizes) < 1:
        raise ValueError(f"hierarchical_sizes must be [a2a, p2p] with product {context_parallel_size}, got {sizes}")
    return sizes


def check_one_layer_kind(config: object) -> None:
    """Refuse a ``moe_layer_freq`` that mixes dense and MoE layers: the recipe overrides install
    one layer spec for every layer (``cp_layer_spec``), so they refuse it when applied rather
    than at model build."""
    freq = getattr(config, "moe_layer_freq", 1)
    if isinstance(freq, int):  # every freq-th layer from layer 1: one kind only at 1 layer or freq 1
        mixes = freq != 1 and getattr(config, "num_layers", None) != 1
    else:
        mixes = not isinstance(freq, (list, tuple)) or 0 in freq
    if getattr(config, "num_moe_experts", None) and mixes:
        raise ValueError(
            f"cp_layer_spec builds one layer spec for every layer; moe_layer_freq={freq!r} mixes dense and MoE "
            "layers. Use moe_layer_freq=1, or build per-layer specs with get_gpt_layer_cp_spec(num_experts=...)"
        )

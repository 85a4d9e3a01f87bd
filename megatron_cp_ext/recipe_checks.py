"""Checks shared by the NeMo 2 (:mod:`.nemo`) and Megatron-Bridge (:mod:`.bridge`) overrides.

Both validate the same comm-type and hierarchical-size requests before writing a config; the
checks live here so that neither override imports the other for them (:mod:`.nemo` hands Bridge
configs to :mod:`.bridge`, never the reverse). Pure Python: no Megatron, NeMo or torch import.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

__all__ = ["check_cp_size", "check_comm_type", "check_hierarchical", "check_one_layer_kind"]
__all__ += ["check_attention_backend", "warn_per_rank_loss"]

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


_REPLACING_BACKENDS = ("local",)
"""megatron-core ``AttnBackend`` values (an enum in configs, its name in YAML) with which Bridge's
and NeMo 2's model construction overwrite the layer spec's ``core_attention``."""


def _backend_name(value: object) -> str:
    """``AttnBackend.local`` (an enum) and ``"local"`` (as read back from YAML) alike."""
    return str(getattr(value, "name", value)).rsplit(".", 1)[-1].lower()


def check_attention_backend(config: object, field: str = "attention_backend") -> None:
    """Refuse an ``attention_backend`` that makes Bridge or NeMo 2 replace our core attention with
    Megatron's ``DotProductAttention`` when they build the model: checked when an override is
    applied and again when the layer spec is built (a later CLI or YAML edit)."""
    backend = getattr(config, "attention_backend", None)
    if backend is not None and _backend_name(backend) in _REPLACING_BACKENDS:
        raise ValueError(
            f"{field} is {_backend_name(backend)!r}: Megatron-Bridge and NeMo then replace the layer spec's "
            "core_attention with DotProductAttention, dropping megatron_cp_ext's attention - set it to "
            "AttnBackend.auto"
        )


def warn_per_rank_loss(config: object, context_parallel_size: int) -> None:
    """Warn where Megatron will average per-rank means: without ``calculate_per_token_loss`` its
    schedules divide each rank's loss by that rank's own token count, and DDP then averages over
    data x context parallel ranks, which weighs CP ranks holding different numbers of loss tokens
    unequally (as with TransformerEngine's CP). With it, gradients are divided by the global count."""
    import warnings  # noqa: PLC0415 - only when asked

    if context_parallel_size > 1 and not getattr(config, "calculate_per_token_loss", False):
        warnings.warn(
            "context parallelism with calculate_per_token_loss=False: Megatron averages each CP rank's own "
            "per-token mean, not the global per-token mean; set calculate_per_token_loss=True (with "
            "average_in_collective=False in the DDP config) for the loss CP 1 computes (docs/megatron.md)",
            stacklevel=3,
        )

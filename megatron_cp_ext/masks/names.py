"""Megatron's ``AttnMaskType`` names -> ``cp_attention`` flags.

Megatron layers describe their mask by name; ``cp_attention`` by flags on positions inside
each sequence. For thd the sequence boundaries come from ``cu_seqlens``, so "padding" adds
nothing there: padded tokens simply are not part of any sequence. Windows and chunks are
separate arguments in both worlds and pass through unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["mask_flags", "MASK_NAMES"]

_CAUSAL = {
    "causal": True,
    "no_mask": False,
    "padding": False,
    "padding_causal": True,
    "causal_bottom_right": True,
}
MASK_NAMES: tuple[str, ...] = tuple(_CAUSAL)
"""Accepted ``AttnMaskType`` names."""


def _name(attn_mask_type: Any) -> str:
    """Enum members by ``.name`` (so Megatron need not be importable here), strings as given."""
    name = attn_mask_type if isinstance(attn_mask_type, str) else getattr(attn_mask_type, "name", None)
    if not isinstance(name, str):
        raise ValueError(f"attn_mask_type must be an AttnMaskType or one of {MASK_NAMES}, got {attn_mask_type!r}")
    return name.strip().lower()


def mask_flags(
    attn_mask_type: Any,
    *,
    qkv_format: str = "thd",
    cu_seqlens_q: Sequence[int] | None = None,
    cu_seqlens_kv: Sequence[int] | None = None,
) -> dict[str, bool]:
    """The ``cp_attention`` keyword flags for a Megatron mask type: ``{"causal": bool}``.

    Args:
        attn_mask_type: ``AttnMaskType`` member or its name: ``causal``, ``no_mask``,
            ``padding``, ``padding_causal``, ``causal_bottom_right``.
        qkv_format: padding types need ``thd`` (the only layout where ``cu_seqlens`` can say
            which tokens are padding); bshd/sbhd have no way to pass a padding mask.
        cu_seqlens_q, cu_seqlens_kv: if given, ``causal_bottom_right`` checks that queries and
            keys have equal lengths, where bottom-right and top-left causal coincide.

    Raises:
        ValueError: unknown names (the message lists the valid ones), padding outside thd,
            bottom-right causal with different q/kv lengths (out of scope: self-attention only).
    """
    name = _name(attn_mask_type)
    if name not in _CAUSAL:
        raise ValueError(f"unsupported attn_mask_type {name!r}; valid: {', '.join(MASK_NAMES)}")
    if name.startswith("padding") and qkv_format != "thd":
        raise ValueError(
            f"attn_mask_type {name!r} needs qkv_format='thd' (padding is expressed by cu_seqlens); "
            f"for {qkv_format!r} use 'causal' or 'no_mask'"
        )
    if name == "causal_bottom_right" and cu_seqlens_q is not None and cu_seqlens_kv is not None:
        if [int(x) for x in cu_seqlens_q] != [int(x) for x in cu_seqlens_kv]:
            raise ValueError(
                "attn_mask_type 'causal_bottom_right' with different query and key lengths is not "
                "supported (cp_attention is self-attention: cu_seqlens_q must equal cu_seqlens_kv)"
            )
    return {"causal": _CAUSAL[name]}

"""bshd / sbhd inputs as THD rows: Megatron's fixed-length dual-chunk layout and back.

A bshd/sbhd batch is ``b`` sequences of one length; Megatron gives CP rank r chunks r and
``2cp-1-r`` of each. Viewed as THD rows in the dual-chunk sharding's order, it runs through
the same plans as packed batches (one copy each way).
"""

from __future__ import annotations

import torch

from ..runtime.validation import CPArgumentError, CPArgumentTypeError
from . import CPSharding, shard_sequences, splits

__all__ = ["fixed_length_sharding", "rows_to_thd", "seq_to_thd", "thd_to_seq", "check_data_split"]

_SEQ_SHARDINGS: dict[tuple[int, int, int], CPSharding] = {}


def fixed_length_sharding(b: int, s_local: int, cp: int, qkv_format: str) -> CPSharding:
    """The dual-chunk sharding Megatron uses for bshd/sbhd (cached: it never changes)."""
    s = s_local * cp
    if cp > 1 and s % (2 * cp):
        raise CPArgumentError(
            f"{qkv_format} needs the global sequence length of q ({s_local} local x cp {cp} = {s}) "
            f"divisible by 2*cp = {2 * cp}"
        )
    key = (b, s, cp)
    found = _SEQ_SHARDINGS.get(key)
    if found is None:  # setdefault: ranks run as threads all get the first one made (one agreement state)
        found = _SEQ_SHARDINGS.setdefault(key, shard_sequences([i * s for i in range(b + 1)], cp, "dualchunk"))
    return found


def seq_to_thd(q, k, v, fmt: str):
    """bshd/sbhd: b sequences of equal length, checked and viewed as ``[b, s_local, h, d]``."""
    layout = "[b, s/cp, heads, head_dim]" if fmt == "bshd" else "[s/cp, b, heads, head_dim]"
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise CPArgumentTypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise CPArgumentError(f"{name} must be 4-D {layout} for qkv_format={fmt!r}, got shape {tuple(x.shape)}")
    if fmt == "sbhd":
        q, k, v = (x.transpose(0, 1) for x in (q, k, v))
    if k.shape[:2] != q.shape[:2] or v.shape[:2] != q.shape[:2]:
        dims = ", ".join(f"{n} {tuple(x.shape[:2])}" for n, x in (("q", q), ("k", k), ("v", v)))
        raise CPArgumentError(f"q, k, v batch/sequence dims differ: {dims}")
    return q, k, v, tuple(q.shape[:2])


def rows_to_thd(x: torch.Tensor, cp: int) -> torch.Tensor:
    """``[b, s_local, ...]`` -> thd rows in the dual-chunk sharding's order: Megatron's local
    row is ``[chunk r | chunk 2cp-1-r]``; the sharding holds all first chunks, then all second
    ones (one copy here, and every step's rows are slices)."""
    b, s_local = x.shape[:2]
    halves = 2 if cp > 1 else 1
    return x.unflatten(1, (halves, s_local // halves)).transpose(0, 1).reshape(b * s_local, *x.shape[2:])


def thd_to_seq(out: torch.Tensor, fmt: str, seq_dims: tuple[int, int], cp: int) -> torch.Tensor:
    """Inverse of :func:`rows_to_thd` for the output (bshd/sbhd)."""
    b, s_local = seq_dims
    halves = 2 if cp > 1 else 1
    out = out.view(halves, b, s_local // halves, *out.shape[1:])
    if fmt == "sbhd":
        return out.permute(0, 2, 1, 3, 4).reshape(s_local, b, *out.shape[3:])
    return out.transpose(0, 1).reshape(b, s_local, *out.shape[3:])


THD_FIX = "Pass cp_attention the sharding that split the data (one CPSharding per micro-batch for every layer)"
SEQ_FIX = (
    "bshd/sbhd attention always uses Megatron's dual-chunk split of each row: split such data along its "
    "sequence dimension with shard_sequences([0, s], cp, balance='dualchunk').shard(x, cp_rank, dim=...) (or "
    "Megatron's get_batch_on_this_cp_rank), or pass it as thd with sharding="
)


def check_data_split(sharding: CPSharding, fmt: str, seq_dims: tuple[int, int] | None, rank: int) -> None:
    """The attention's split is one this process split the data with (when it split data of
    these ``cu_seqlens`` at all), taken for this CP ``rank``, else the same ``CPArgumentError``
    on every rank (design rule 5).

    bshd/sbhd data cut along its sequence dimension was split as one sequence ``[0, s]``; that
    split must be the dual-chunk one these formats attend with, for this rank. With ``b > 1``
    rows, data split as the packed sequences ``[0, s, ..., b*s]`` by any split is refused: its
    rank holds every row's first chunk, then the second ones, not Megatron's
    ``[chunk r | chunk 2cp-1-r]`` per row (the dual-chunk split of those rows has that
    sharding's very segments, so only the order tells them apart)."""
    if fmt == "thd":
        msg = splits.disagreement(sharding, "the sharding passed to cp_attention", THD_FIX, rank)
    else:
        layer = f"Megatron's dual-chunk split (qkv_format={fmt!r})"
        b, s_local = seq_dims
        msg = splits.packed_rows(sharding, layer, SEQ_FIX) if b > 1 else None
        one = sharding if b == 1 else fixed_length_sharding(1, s_local, sharding.cp_size, fmt)
        msg = msg or splits.disagreement(one, layer, SEQ_FIX, rank)
    if msg is not None:
        raise CPArgumentError(msg)

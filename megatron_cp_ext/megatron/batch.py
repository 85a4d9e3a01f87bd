"""Split a training batch across CP ranks and carry one sharding per micro-batch.

The split and the attention must agree on which global tokens each rank holds: the
``PackedSeqParams`` returned here carry the sharding (:mod:`.context`), so every layer uses the
split the data got, whatever its own mask.

Two ways in:

* :func:`make_packed_seq_params` from host ``cu_seqlens`` - no device sync at all;
* a plain Megatron ``PackedSeqParams`` (global ``cu_seqlens_q/kv``, as Megatron builds them
  for TransformerEngine, on either device) - the context is derived on first use and cached
  on the object; a device ``cu_seqlens`` costs one copy to the host per micro-batch, never
  one per layer.

Shape legend: ``T`` global tokens, ``t`` this rank's tokens, ``b`` batch, ``s`` sequence.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams

from ..runtime.validation import CPArgumentError, CPArgumentTypeError, as_int
from ..sharding import CPSharding, shard_sequences
from .context import (
    CONTEXT_ATTR,
    LAYOUTS,
    CPBatchContext,
    ShardRecipe,
    check_layout_name,
    check_token_multiple,
    cp_context,
    default_token_multiple,
    host_cu_seqlens,
    stamp_of,
)

__all__ = [
    "CPBatchContext",
    "cp_context",
    "make_packed_seq_params",
    "shard_batch_for_cp",
    "zigzag_positions",
]


def _group_size_rank(cp_group: dist.ProcessGroup | None) -> tuple[int, int]:
    if cp_group is None:
        return 1, 0
    return dist.get_world_size(cp_group), dist.get_rank(cp_group)


def _default_cp_group() -> dist.ProcessGroup | None:
    """Megatron's CP group when parallel_state is set up, else ``None`` (CP size 1)."""
    from megatron.core import parallel_state

    return parallel_state.get_context_parallel_group(check_initialized=False)


def make_packed_seq_params(
    cu_seqlens: torch.Tensor | Sequence[int],
    *,
    cp_group: dist.ProcessGroup | None = None,
    balance: str | None = None,
    device: torch.device | str | None = None,
    causal: bool = True,
    window_size: tuple[int, int] | None = (-1, -1),
    chunk_size: int | None = None,
    token_multiple: int = 1,
    sharding: CPSharding | None = None,
) -> PackedSeqParams:
    """A THD ``PackedSeqParams`` for one micro-batch, with the CP plan cache attached.

    ``cu_seqlens`` are the *global* prefix sums on the host. The returned object carries
    global ``cu_seqlens_q/kv`` (int32 on ``device``) exactly as Megatron expects, plus the
    sharding, so every layer reuses one plan and nothing syncs with the device. ``causal``,
    ``window_size``, ``chunk_size``: the model's attention mask, which the ``workload``
    balance balances under (any sharding is exact under any mask; the sharding travels with
    the params, so every layer uses this one whatever its own mask); ``window_size=None`` is
    Megatron's ``config.window_size`` for no window, as ``(-1, -1)``. ``balance="te"``:
    TransformerEngine's THD split; default ``"workload"``. ``token_multiple``: every rank's
    token count a multiple of it (sequence parallelism needs the TP size).

    ``sharding``: the split the data already got (e.g. ``shard_sequences(...)`` whose ``shard``
    split it, here or in a data-loader worker), instead of a ``balance``; the layers then use
    exactly it. Its ``cu_seqlens`` and CP size must be these. ``cp_group``: the CP group
    (Megatron's ``parallel_state.get_context_parallel_group()``); None is CP size 1.
    """
    cu_cpu = torch.tensor(host_cu_seqlens(cu_seqlens), dtype=torch.int64)
    size, rank = _group_size_rank(cp_group)
    token_multiple = as_int(token_multiple, "token_multiple", minimum=1)
    if sharding is not None:
        _check_given(sharding, cu_cpu.tolist(), size, balance)
        balance = sharding.balance if sharding.balance in LAYOUTS else "custom"
    recipe = ShardRecipe(
        balance=check_layout_name(balance or "workload", "balance") if sharding is None else balance,
        causal=causal,
        window_size=(-1, -1) if window_size is None else window_size,
        chunk_size=chunk_size,
        token_multiple=token_multiple,
        given=sharding is not None,
    )
    sharding = sharding or recipe.build(cu_cpu.tolist(), size)
    check_token_multiple(sharding, token_multiple, f"token_multiple={token_multiple}")
    cu_dev = cu_cpu.to(torch.int32).to(device or "cpu", non_blocking=True)
    lengths = cu_cpu[1:] - cu_cpu[:-1]
    max_len = int(lengths.max()) if lengths.numel() else 0
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_dev,
        cu_seqlens_kv=cu_dev,
        max_seqlen_q=max_len,
        max_seqlen_kv=max_len,
        cp_group=cp_group,
    )
    ctx = CPBatchContext(sharding=sharding, rank=rank, recipe=recipe, source=(cu_dev,), stamps=(stamp_of(cu_dev),),
                         values=(tuple(cu_cpu.tolist()),))  # fmt: skip
    setattr(params, CONTEXT_ATTR, ctx)
    return params


def _check_given(sharding: CPSharding, cu: list[int], cp_size: int, balance: str | None) -> None:
    if not isinstance(sharding, CPSharding):
        raise CPArgumentTypeError(f"sharding must be a megatron_cp_ext.CPSharding, got {type(sharding).__name__}")
    if balance is not None:
        raise CPArgumentError(f"pass either sharding or balance, not both (balance={balance!r})")
    if list(sharding.cu_seqlens) != cu:
        raise CPArgumentError(
            f"sharding was made for other cu_seqlens ({sharding.num_seqs} sequences, {sharding.total_tokens} tokens) "
            f"than these ({len(cu) - 1} sequences, {cu[-1]} tokens)"
        )
    if sharding.cp_size != cp_size:
        hint = " (cp_group=None is CP size 1: pass parallel_state.get_context_parallel_group())"
        raise CPArgumentError(
            f"sharding is for CP size {sharding.cp_size}, cp_group has {cp_size} ranks" + (hint if cp_size == 1 else "")
        )


def zigzag_positions(s_local: int, cp_size: int, rank: int) -> torch.Tensor:
    """Global positions of the ``s_local`` tokens rank ``rank`` holds under Megatron's split.

    The sequence is cut into ``2*cp`` equal chunks; rank r holds chunks r and 2cp-1-r.
    """
    if cp_size == 1:
        return torch.arange(s_local)
    s = s_local * cp_size
    if s % (2 * cp_size):
        raise ValueError(f"sequence length {s} must be divisible by 2*cp = {2 * cp_size} for bshd/sbhd CP")
    c = s // (2 * cp_size)
    first = torch.arange(rank * c, (rank + 1) * c)
    second = torch.arange((2 * cp_size - 1 - rank) * c, (2 * cp_size - rank) * c)
    return torch.cat([first, second])


_TOKEN_KEYS = ("tokens", "labels", "loss_mask", "position_ids")
"""Batch entries that are per token by definition: they must be ``[b, T, ...]``."""


_GLOBAL_PREFIXES = ("cu_seqlens", "max_seqlen")
"""Batch entries describing the packing itself (Megatron's and Bridge's packed datasets carry
``cu_seqlens`` ``[1, n + 1]``, ``cu_seqlens_argmin``, ``max_seqlen``): global values, passed
through uncut (a ``[1, n + 1]`` tensor with ``n + 1 == T`` would else be cut like tokens)."""


def _is_global(key: str) -> bool:
    return key.startswith(_GLOBAL_PREFIXES)


def _check_thd_tensor(key: str, val: torch.Tensor, total: int) -> None:
    """A packed-batch tensor must span the whole batch along dim 1 (Megatron's ``[1, T]``) in
    one row; anything else would pass through unsharded and fail (or be wrong) much later."""
    if val.dim() >= 2 and val.shape[0] != 1 and val.shape[1] == total:
        raise CPArgumentError(
            f"batch[{key!r}] has shape {tuple(val.shape)}: a packed (thd) micro-batch is one row [1, T, ...]; "
            "pack its samples into that row (cu_seqlens mark them), or split bshd data without cu_seqlens"
        )
    if val.dim() >= 2 and val.shape[1] != total:
        raise CPArgumentError(
            f"batch[{key!r}] has {val.shape[1]} tokens along dim 1 (shape {tuple(val.shape)}) but cu_seqlens "
            f"describe {total}; every [1, T, ...] tensor of a packed batch must span all T tokens"
        )
    if val.dim() < 2 and (key in _TOKEN_KEYS or (val.dim() == 1 and val.shape[0] == total)):
        raise CPArgumentError(
            f"batch[{key!r}] has shape {tuple(val.shape)}; per-token tensors of a packed batch are "
            f"[1, T, ...] with T = {total} (cu_seqlens)"
        )


def _shard_thd(batch: dict, cu_seqlens, cp_group, balance: str, split: dict) -> dict:
    size, rank = _group_size_rank(cp_group)
    sample = next((v for v in batch.values() if isinstance(v, torch.Tensor) and v.dim() >= 2), None)
    device = sample.device if sample is not None else None
    params = make_packed_seq_params(cu_seqlens, cp_group=cp_group, balance=balance, device=device, **split)
    ctx: CPBatchContext = getattr(params, CONTEXT_ATTR)
    total = ctx.sharding.total_tokens
    for key, val in batch.items():  # validate everything before returning anything
        if key != "attention_mask" and not _is_global(key) and isinstance(val, torch.Tensor):
            _check_thd_tensor(key, val, total)
    out: dict = {}
    for key, val in batch.items():
        if key == "attention_mask":
            out[key] = None  # THD attention is defined by cu_seqlens, not by a dense mask
        elif isinstance(val, torch.Tensor) and val.dim() >= 2 and not _is_global(key):
            out[key] = ctx.sharding.shard(val, rank, dim=1)
        else:
            out[key] = val
    if out.get("position_ids") is None:
        # True in-sequence positions; the embedding and RoPE need them, not 0..t-1.
        out["position_ids"] = ctx.positions(device or "cpu").unsqueeze(0).clone()  # RoPE reads the cached one
    out["packed_seq_params"] = params
    return out


def _check_seq_lengths(batch: dict) -> None:
    """bshd: every ``[b, s, ...]`` tensor must have the same ``s`` (else each would be cut at
    different places and tokens, labels and masks would silently stop lining up)."""
    lengths = {}
    for key, val in batch.items():
        if isinstance(val, torch.Tensor) and val.dim() >= (3 if key == "attention_mask" else 2):
            lengths[key] = val.shape[2 if key == "attention_mask" else 1]
    if len(set(lengths.values())) > 1:
        ref = "tokens" if "tokens" in lengths else next(iter(lengths))
        bad = next(k for k, n in lengths.items() if n != lengths[ref])
        raise CPArgumentError(
            f"batch[{bad!r}] has sequence length {lengths[bad]} but batch[{ref!r}] has {lengths[ref]}; "
            "every [b, s, ...] tensor of the batch must share s (dim 2 for attention_mask)"
        )


def _shard_zigzag(batch: dict, cp_group) -> dict:
    size, rank = _group_size_rank(cp_group)
    _check_seq_lengths(batch)
    if size == 1:
        return dict(batch)
    seq = {
        v.shape[1] for k, v in batch.items() if isinstance(v, torch.Tensor) and v.dim() >= 2 and k != "attention_mask"
    }
    out: dict = {}
    rows = None  # Megatron's dual-chunk split of one row [0, s]: its shard records the split (layers check it)
    for key, val in batch.items():
        if isinstance(val, torch.Tensor) and (
            val.dim() == 1 and val.shape[0] in seq or key == "attention_mask" and val.dim() < 3
        ):
            raise CPArgumentError(  # passed through uncut, it would no longer line up with the cut tokens
                f"batch[{key!r}] has shape {list(val.shape)}: a per-token tensor of a [b, s] batch must be "
                f"[b, s, ...] ([b, 1, s, s] for attention_mask) to be split like the tokens; add the batch dim"
            )
        if not isinstance(val, torch.Tensor) or val.dim() < 2:
            out[key] = val
            continue
        seq_dim = 2 if key == "attention_mask" else 1
        s = val.shape[seq_dim]
        if s % (2 * size):
            raise ValueError(f"batch[{key!r}] has sequence length {s}, not divisible by 2*cp = {2 * size}")
        if rows is None:
            rows = shard_sequences([0, s], size, balance="dualchunk")
        # For a [b, 1, s, s] mask only the query dim is split; keys stay global (as Megatron).
        out[key] = rows.shard(val, rank, dim=seq_dim)
    return out


def shard_batch_for_cp(
    batch: dict,
    *,
    cu_seqlens: torch.Tensor | Sequence[int] | None = None,
    cp_group: dist.ProcessGroup | None = None,
    balance: str = "workload",
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    chunk_size: int | None = None,
    token_multiple: int | None = None,
) -> dict:
    """This CP rank's part of a batch (a new dict; the input is not modified).

    THD (``cu_seqlens`` given, global host prefix sums): tensors ``[1, T, ...]`` whose dim 1
    spans the packed batch (tokens, labels, loss_mask, position_ids) are sharded with
    :func:`~megatron_cp_ext.shard_sequences`; ``position_ids`` keep their global values (each
    token's true position in its sequence, created when absent) so RoPE stays right;
    ``attention_mask`` becomes ``None``; entries named ``cu_seqlens*`` / ``max_seqlen*`` (the
    packing itself) pass through uncut; ``packed_seq_params`` is added (built by
    :func:`make_packed_seq_params`, carrying the plan cache). bshd (no ``cu_seqlens``):
    Megatron's dual-chunk split of dim 1 (dim 2 for ``attention_mask``), ``s % 2cp == 0``.

    ``cp_group`` defaults to Megatron's CP group (``parallel_state``), or CP size 1. ``balance``
    (or ``"te"``, TransformerEngine's THD split) and the model's mask (``causal``,
    ``window_size``, ``chunk_size``) choose the THD split; the returned ``packed_seq_params``
    carry it, so every layer uses exactly this split whatever its own mask.
    ``token_multiple`` (default: Megatron's TP size, 1 without parallel_state): every rank's
    token count is a multiple of it, as sequence parallelism needs; a batch that cannot be split
    so is refused here, identically on every rank, before any collective. Pass 1 to allow any
    total without sequence parallelism.

    Not named after Megatron's ``get_batch_on_this_cp_rank``: that function's contract differs
    between megatron-core releases (``(batch, cp_group)`` in 0.16, ``(batch, is_hybrid_cp,
    cp_group, ...)`` in 0.19) and neither takes host ``cu_seqlens``; everything here is by keyword.
    """
    if cp_group is None:
        cp_group = _default_cp_group()
    if cu_seqlens is not None:
        multiple = default_token_multiple() if token_multiple is None else token_multiple
        split = {"causal": causal, "window_size": window_size, "chunk_size": chunk_size, "token_multiple": multiple}
        return _shard_thd(batch, cu_seqlens, cp_group, balance, split)
    return _shard_zigzag(batch, cp_group)

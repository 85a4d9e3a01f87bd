"""One micro-batch's CP context: its sharding, how it was made, and when it is stale.

Megatron hands every layer the same :class:`PackedSeqParams` object for a micro-batch. We
hang a :class:`CPBatchContext` on it (the :class:`~megatron_cp_ext.CPSharding`, which also
caches the attention plans, and this rank's token positions per device), so all layers, the
RoPE of every layer and the backward share one plan built once on the host.

The context follows the *values* of ``cu_seqlens``, not only the tensor object: it records
the tensor's version counter (a host-side integer, no device sync) and, for a host tensor,
its values, so a buffer refilled in place for the next micro-batch is re-sharded with the same
:class:`ShardRecipe`. A device buffer written around autograd's counter (``.data``) is not seen.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from ..runtime.stand_in import host_as_device
from ..runtime.validation import CPArgumentError
from ..sharding import BALANCES, CPSharding, check_cu_seqlens, shard_sequences, splits
from ..sharding.te_layout import TE_LAYOUT, separate_padding, te_thd_sharding

__all__ = [
    "LAYOUTS",
    "CPBatchContext",
    "ShardRecipe",
    "check_split",
    "check_token_multiple",
    "count_refusal",
    "cp_context",
    "default_token_multiple",
    "derive_recipe",
    "router_losses",
]

CONTEXT_ATTR = "_mcx_cp_context"

LAYOUTS = (*BALANCES, TE_LAYOUT)
"""What a THD batch split can use: the balances, and TransformerEngine's THD split."""


@dataclass(frozen=True, kw_only=True)
class ShardRecipe:
    """How a micro-batch's sharding is made from its ``cu_seqlens``.

    Kept with the context so that a ``cu_seqlens`` refilled in place (static buffers, CUDA
    graphs) is re-sharded exactly the way the batch split sharded it.
    """

    balance: str = "workload"
    """One of :data:`megatron_cp_ext.BALANCES`, or ``"te"`` (TransformerEngine's THD split)."""
    causal: bool = True
    """Mask the ``workload`` balance balances under (any sharding is exact under any mask)."""
    window_size: tuple[int, int] = (-1, -1)
    """Sliding window of that mask, ``(left, right)``."""
    chunk_size: int | None = None
    """Chunked attention of that mask."""
    token_multiple: int = 1
    """Every rank's token count is a multiple of this (sequence parallelism: the TP size)."""
    given: bool = False
    """The split was given (``make_packed_seq_params(sharding=...)``): the fields above do not
    make it, so other ``cu_seqlens`` cannot be re-sharded the same way."""

    def build(self, cu_host: list[int], cp_size: int, name: str = "cu_seqlens") -> CPSharding:
        if self.balance == TE_LAYOUT:
            return te_thd_sharding(cu_host, cp_size, name=name)
        mask = {"causal": self.causal, "window_size": self.window_size, "chunk_size": self.chunk_size}
        return shard_sequences(cu_host, cp_size, balance=self.balance, **mask, token_multiple=self.token_multiple)


@dataclass(eq=False)
class CPBatchContext:
    """What one micro-batch's attention layers share on one CP rank."""

    sharding: CPSharding
    """Token -> rank assignment; also the engine's plan cache for this micro-batch."""
    rank: int
    """This rank's index in the CP group."""
    recipe: ShardRecipe = field(default_factory=ShardRecipe)
    """How :attr:`sharding` was made (re-applied when ``cu_seqlens`` change in place)."""
    source: tuple = ()
    """The ``cu_seqlens`` tensors the context was derived from (detects a reused params object)."""
    stamps: tuple = ()
    """Their :func:`stamp_of` then: an in-place refill bumps a version counter, without a
    device sync; a host tensor's values are compared too."""
    values: tuple = ()
    """Their values then, on the host: a refill with the same values keeps the sharding."""
    kv: tuple = ()
    """``cu_seqlens_kv`` tensors other than q's, with their stamps, as last checked equal to q's."""
    layout: CPSharding | None = None
    """The split over ``cu_seqlens`` (or the padded ones) before padding became sequences of its
    own: what the data's recorded split is compared with (:mod:`megatron_cp_ext.sharding.splits`);
    ``None``: :attr:`sharding`."""
    made_by: str = "carried by the PackedSeqParams (make_packed_seq_params / shard_batch_for_cp)"
    """Where the split comes from, for messages."""
    _positions: dict = field(default_factory=dict, repr=False)

    def positions(self, device: torch.device | str) -> torch.Tensor:
        """Position inside its sequence of every local token, on ``device`` (uploaded once)."""
        device = torch.device(device)
        pos = self._positions.get(device)
        if pos is None:
            with torch.inference_mode(False):  # cached: an inference tensor would refuse later training
                pos = self._positions[device] = self.sharding.positions(self.rank).to(device, non_blocking=True)
        return pos

    def describes(self, sources: tuple) -> bool:
        """Whether ``sources`` are still the tensors, with the values, this context was made from."""
        return (
            len(sources) == len(self.source)
            and all(a is b for a, b in zip(sources, self.source))
            and all(same_stamp(t, st) for t, st in zip(sources, self.stamps))
        )


def stamp_of(t: torch.Tensor) -> tuple[int, torch.Tensor | None]:
    """What tells a refilled ``cu_seqlens`` from the one a context was made from: its in-place
    version counter and, for a host tensor, a copy of its values. Writes through ``.data`` or a
    NumPy view (a pinned buffer refilled by a loader) leave the counter alone; comparing a host
    tensor's values costs no sync, a device tensor's would."""
    return _version(t), (t.clone() if t.device.type == "cpu" else None)


def same_stamp(t: torch.Tensor, stamp: tuple[int, torch.Tensor | None]) -> bool:
    """Whether ``t`` still matches ``stamp`` (:func:`stamp_of`)."""
    version, host = stamp
    if host is None or host_as_device():  # a device tensor: its counter only (reading it would sync)
        return _version(t) == version
    return _version(t) == version and t.shape == host.shape and torch.equal(t, host)


def _version(t: torch.Tensor) -> int:
    """The in-place version counter (host-side; inference tensors have none: -1)."""
    try:
        return t._version
    except RuntimeError:
        return -1


def default_token_multiple() -> int:
    """Megatron's TP size when parallel_state is set up, else 1: what sequence parallelism
    needs every CP rank's token count to be a multiple of (harmless without it)."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 1
    return parallel_state.get_tensor_model_parallel_world_size()


def check_token_multiple(sharding: CPSharding, multiple: int, why: str) -> None:
    """Every rank's token count a multiple of ``multiple``, else the same error on every rank
    (the counts are host values every rank computes alike), before any collective."""
    if multiple <= 1:
        return
    counts = sharding.counts()
    bad = [r for r, n in enumerate(counts) if n % multiple]
    if bad:
        raise CPArgumentError(
            f"{why} needs every CP rank's token count to be a multiple of {multiple}; the micro-batch's "
            f"{sharding.balance!r} sharding gives CP rank {bad[0]} {counts[bad[0]]} tokens (counts {counts}, "
            f"{sharding.total_tokens} tokens in all): pad the packed batch to a multiple of cp*{multiple} tokens"
            + (" (and every padded sequence to a multiple of 2*cp*TP)" if sharding.balance == TE_LAYOUT else "")
        )


def router_losses(config: Any) -> str | None:
    """The MoE router losses ``config`` enables, which assume every CP rank holds as many tokens:
    Megatron's router divides the z-loss coefficient by the TP x CP size and takes each rank's
    own token mean, and prices the load-balancing losses with ``local tokens x TP x CP`` tokens
    in all. With counts that differ (a packed total not a multiple of CP) both weigh the ranks'
    tokens unequally, unlike CP 1. ``None``: no such loss."""
    if not getattr(config, "num_moe_experts", None):
        return None
    types, coeffs = config.moe_router_load_balancing_type, config.moe_aux_loss_coeff
    types, coeffs = ([types], [coeffs]) if isinstance(types, str) else (types, coeffs)
    if not isinstance(coeffs, (list, tuple)):
        coeffs = [coeffs] * len(types)
    on = [f"{t} (moe_aux_loss_coeff)" for t, c in zip(types, coeffs) if t.endswith("aux_loss") and c]
    if getattr(config, "moe_z_loss_coeff", None):
        on.append("moe_z_loss_coeff")
    return ", ".join(on) or None


def count_refusal(sharding: CPSharding, cp_size: int, equal_for: str | None) -> CPArgumentError | None:
    """What a Megatron layer cannot run with this split's token counts (host values, the same on
    every rank): a CP rank without tokens (Megatron's q/k/v reshapes fail on it), or, when
    ``equal_for`` names router losses (:func:`router_losses`), counts that differ."""
    counts = sharding.counts()  # cached on the sharding: every layer asks
    empty, unequal = cp_size > 1 and min(counts) == 0, bool(equal_for) and len(set(counts)) > 1
    if not (empty or unequal):
        return None
    counts = list(counts)
    what = f"the micro-batch's {sharding.balance!r} split gives counts {counts} ({sharding.total_tokens} tokens"
    if empty:
        return CPArgumentError(
            f"{what} over CP {cp_size}): CP rank {counts.index(0)} gets no tokens, and Megatron's attention layers "
            "cannot run a CP rank without tokens. Pack at least one token per CP rank into every micro-batch (pad "
            "it), or run CPCoreAttention alone"
        )
    return CPArgumentError(
        f"{what} over CP {cp_size}), but the MoE router losses {equal_for} assume every CP rank holds as many "
        f"tokens (they would weigh the ranks' tokens unequally, unlike CP 1). Pad every packed micro-batch to a "
        f"multiple of {cp_size} x token_multiple tokens (a padding document with loss_mask 0)"
    )


def check_layout_name(balance: Any, name: str) -> str:
    if not isinstance(balance, str) or balance not in LAYOUTS:
        raise CPArgumentError(f"{name} must be one of {LAYOUTS}, got {balance!r}")
    return balance


def host_cu_seqlens(cu_seqlens: torch.Tensor | Sequence[int]) -> list[int]:
    """Validated host ints (float or bool ``cu_seqlens`` are refused, as by the core). A device
    tensor costs one copy to the host per micro-batch."""
    if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.device.type != "cpu":
        cu_seqlens = cu_seqlens.detach().cpu()
    return check_cu_seqlens(cu_seqlens)


def _layout_cu_seqlens(params: PackedSeqParams) -> torch.Tensor:
    """The ``cu_seqlens`` describing where tokens sit (the padded ones when Megatron padded)."""
    if params.cu_seqlens_q_padded is not None:
        return params.cu_seqlens_q_padded
    if params.cu_seqlens_q is None:
        raise CPArgumentError("PackedSeqParams for qkv_format='thd' needs cu_seqlens_q")
    return params.cu_seqlens_q


def _checked_kv(params: PackedSeqParams, seen: tuple = ()) -> tuple:
    """kv must describe the same packed batch as q. Returns kv's own tensors (where not q's) with
    their stamps, checked again only when they change: a copy to host once per micro-batch."""
    own = [
        (getattr(params, a), getattr(params, a.replace("_q", "_kv")), a)
        for a in ("cu_seqlens_q", "cu_seqlens_q_padded")
    ]
    own = [(q, kv, a) for q, kv, a in own if q is not None and kv is not None and kv is not q]
    if len(own) == len(seen) and all(kv is t and same_stamp(kv, st) for (_, kv, _), (t, st) in zip(own, seen)):
        return seen
    for q, kv, a in own:
        if not torch.equal(kv.detach().cpu().long(), q.detach().cpu().long()):
            raise CPArgumentError(f"CP self-attention needs {a.replace('_q', '_kv')} == {a} (the same packed batch)")
    return tuple((kv, stamp_of(kv)) for _, kv, _ in own)


def check_split(ctx: CPBatchContext) -> None:
    """The layer's split is the one this process split the micro-batch's data with, or the same
    :class:`CPArgumentError` on every rank (each rank split its own data the same way), naming
    both splits and the fix. A generation compare when nothing new was split (every layer)."""
    msg = splits.disagreement(ctx.layout or ctx.sharding, ctx.made_by, MEGATRON_FIX, ctx.rank)
    if msg is not None:
        raise CPArgumentError(msg)


MEGATRON_FIX = (
    "Give the layer the data's split: PackedSeqParams from megatron_cp_ext.megatron.make_packed_seq_params(cu_seqlens, "
    "cp_group=<the CP group>, sharding=<the data's sharding>), or split and build both with shard_batch_for_cp"
)
"""What a Megatron layer's split-mismatch message tells the user to do."""


def _not_carried(balance: str, cu: list[int], cp_size: int) -> str:
    """Why plain params under a non-``te`` ``load_balance`` are refused: only TransformerEngine's
    split is assumed (what Megatron's, Bridge's and NeMo's data steps produce); any other split
    must reach the layer as the object the data was split with."""
    return (
        f"PackedSeqParams carry no megatron_cp_ext split ({len(cu) - 1} sequences, {cu[-1]} tokens, CP {cp_size}) "
        f"and load_balance={balance!r}: a layer assumes only TransformerEngine's THD split (what Megatron's, "
        "Megatron-Bridge's and NeMo's own data steps produce): cu_seqlens alone cannot say how this micro-batch's "
        f"data was split. {MEGATRON_FIX} (a "
        "data-loader worker can send the CPSharding with the batch: it pickles); for batches split by Megatron's "
        "own data step, use load_balance='te' (--cp-load-balance te)"
    )


def derive_recipe(params: PackedSeqParams, balance: str) -> ShardRecipe:
    """The recipe for a plain ``PackedSeqParams`` (no sharding attached).

    ``cu_seqlens_q_padded`` means the batch was split by TransformerEngine's THD split
    (Megatron's ``get_thd_batch_on_this_cp_rank``, Megatron-Bridge's and NeMo's data steps), so
    that is the layout, whatever ``balance`` says. Otherwise ``balance``: ``"te"`` for
    Megatron's own split, or a balance under the default (causal) mask, as
    ``shard_sequences(cu, cp, balance)`` gives it. The layout never depends on a layer's own
    mask, so every layer of a model (windowed, chunked or full) agrees with the batch split.
    """
    if params.cu_seqlens_q_padded is not None:
        return ShardRecipe(balance=TE_LAYOUT)
    return ShardRecipe(balance=balance)


def _sources(params: PackedSeqParams) -> tuple:
    """The tensors a context depends on: where tokens sit and, with padding, the real lengths."""
    cu = _layout_cu_seqlens(params)
    real = params.cu_seqlens_q
    return (cu,) if params.cu_seqlens_q_padded is None or real is None or real is cu else (cu, real)


def _name(params: PackedSeqParams) -> str:
    return "PackedSeqParams.cu_seqlens_q" + ("_padded" if params.cu_seqlens_q_padded is not None else "")


def _total_off(cu_host: list[int], tokens: int | None, cp_size: int, name: str) -> str | None:
    """Why a plain ``PackedSeqParams`` cannot describe the tokens the ranks hold, if it cannot:
    every split the layer derives deals ``cu_seqlens[-1]`` tokens evenly (``total // cp`` or one
    more per rank), and this rank holds another count. Reported before any layout rule."""
    total = cu_host[-1]
    if tokens is None or tokens in (total // cp_size, -(-total // cp_size)):
        return None
    return (
        f"{name}[-1] = {total} tokens, but this CP rank holds {tokens} ({tokens} x CP {cp_size} = "
        f"{tokens * cp_size} tokens in all; a split of {total} tokens gives every rank {total // cp_size}"
        f"{'' if total % cp_size == 0 else f' or {total // cp_size + 1}'}): cu_seqlens must describe the whole "
        "packed micro-batch the ranks hold (its padding included)"
    )


def cp_context(
    params: PackedSeqParams, cp_size: int, cp_rank: int, balance: str = "te", tokens: int | None = None
) -> CPBatchContext:
    """The micro-batch's :class:`CPBatchContext`, cached on ``params``.

    Made once per micro-batch: by :func:`make_packed_seq_params` / :func:`shard_batch_for_cp`,
    or on first use from a plain ``PackedSeqParams`` (:func:`derive_recipe`). Reused while its
    ``cu_seqlens`` tensor is the same object with the same version counter (and values, on the
    host); an in-place refill (or a new tensor) re-shards with the same recipe. ``tokens``: this rank's token
    count, checked against a plain ``PackedSeqParams``' total first. Every use checks the split
    against the one this process split the data with (:func:`check_split`).
    """
    sources = _sources(params)
    ctx = getattr(params, CONTEXT_ATTR, None)
    if ctx is not None and ctx.describes(sources):
        if ctx.sharding.cp_size != cp_size or ctx.rank != cp_rank:
            raise CPArgumentError(
                f"PackedSeqParams was built for CP size {ctx.sharding.cp_size} rank {ctx.rank}, "
                f"used by a layer at CP size {cp_size} rank {cp_rank}"
            )
        check_split(ctx)
        ctx.kv = _checked_kv(params, ctx.kv)
        return ctx
    recipe = ctx.recipe if ctx is not None else derive_recipe(params, balance)
    kv = _checked_kv(params)
    # One host copy per micro-batch (a sync if cu lives on the GPU); never per layer.
    stamps = tuple(stamp_of(t) for t in sources)
    cu_host = [host_cu_seqlens(t) for t in sources]
    if ctx is not None and ctx.values == tuple(map(tuple, cu_host)):  # refilled with the same values
        ctx.source, ctx.stamps, ctx.kv = sources, stamps, kv
        return cp_context(params, cp_size, cp_rank, balance, tokens)
    if ctx is not None and ctx.recipe.given:
        raise CPArgumentError(
            f"{_name(params)} was refilled in place with other values, but these PackedSeqParams carry the split "
            "they were made with (make_packed_seq_params(sharding=...)), which cannot be rebuilt for them: make "
            "new params for each micro-batch, with the sharding its data was split with"
        )
    name = _name(params)
    derived = ctx is None
    total_off = _total_off(cu_host[0], tokens, cp_size, name) if derived else None
    if derived:
        te = " (TransformerEngine's THD split)" if recipe.balance == TE_LAYOUT else ""
        made_by = "assumed for a PackedSeqParams that carries no megatron_cp_ext split: " + (
            "cu_seqlens_q_padded means TransformerEngine's THD split"
            if params.cu_seqlens_q_padded is not None
            else f"load_balance={recipe.balance!r}{te}"
        )
    else:
        made_by = ctx.made_by
    if derived and recipe.balance != TE_LAYOUT and cp_size > 1:  # only TE's split is assumed; others are carried
        raise CPArgumentError(total_off or _not_carried(recipe.balance, cu_host[0], cp_size))
    try:
        sharding = recipe.build(cu_host[0], cp_size, name)
    except CPArgumentError as err:
        if total_off:  # the wrong total is the cause, not the layout rule it trips
            raise CPArgumentError(total_off) from err
        data = splits.recorded(cu_host[0], cp_size) if derived else ()
        if data:  # the data got a split this layer cannot even build: say so, not the layout rule
            layer = f"a {recipe.balance!r} split, {made_by}, which refuses this batch ({err})"
            raise CPArgumentError(splits.mismatch(data, layer, cu_host[0], cp_size, None, MEGATRON_FIX)) from err
        if ctx is not None or isinstance(err, TypeError):
            raise
        raise CPArgumentError(
            f"{err}. PackedSeqParams without a megatron_cp_ext sharding are taken to be split by "
            f"load_balance={recipe.balance!r} (te: Megatron's own THD split); split the batch with "
            "megatron_cp_ext.megatron.shard_batch_for_cp (its packed_seq_params carry the split), or set "
            "load_balance (--cp-load-balance) to the balance this process split the batch with"
        ) from err
    if total_off and sharding.num_tokens(cp_rank) != tokens:
        raise CPArgumentError(total_off)
    layout = sharding
    if len(cu_host) == 2:
        sharding = separate_padding(sharding, cu_host[1], name="PackedSeqParams.cu_seqlens_q")
    ctx = CPBatchContext(sharding=sharding, rank=cp_rank, recipe=recipe, source=sources, stamps=stamps,
                         values=tuple(map(tuple, cu_host)), layout=layout, made_by=made_by, kv=kv)  # fmt: skip
    check_split(ctx)
    setattr(params, CONTEXT_ATTR, ctx)
    return ctx

"""``CPCoreAttention``: Megatron's core-attention slot, filled by :func:`megatron_cp_ext.cp_attention`.

Megatron's ``Attention`` builds its ``core_attention`` submodule as
``core_attention(config=, layer_number=, attn_mask_type=, attention_type=, cp_comm_type=,
softmax_scale=, pg_collection=)`` and calls it as ``(query, key, value, attention_mask, *,
attn_mask_type, attention_bias, packed_seq_params)`` with sbhd ``[s, b, h, d]`` or, for
packed sequences, thd ``[t, h, d]``. Everything decidable at construction (comm type of this
layer, groups, window, chunking, unsupported options) is decided there, so forward is only
"find the micro-batch's sharding, call the engine".
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention

from .. import COMM_TYPES, cp_attention
from ..backends import BACKENDS
from ..runtime import agreement
from ..runtime.validation import CPArgumentError, as_bool, as_choice, as_chunk, as_window
from .context import LAYOUTS, CPBatchContext, check_token_multiple, count_refusal, cp_context, router_losses
from .hierarchical import hierarchical_groups, hierarchical_groups_from_sizes
from .qk_clip import record_max_logit, wants_max_logits
from .sinks import install_softmax_offset, offset_sharded_state_dict
from .subgroups import call_group, peer_groups

__all__ = ["CPAttentionOptions", "CPCoreAttention", "hierarchical_groups_from_sizes", "resolve_cp_comm_type"]

_MASK_CAUSAL = {AttnMaskType.causal: True, AttnMaskType.no_mask: False}
_MASK_PADDED = {AttnMaskType.padding_causal: True, AttnMaskType.padding: False}

REFUSAL_WAIT_S = 15.0
"""How long a layer that refuses its micro-batch waits for the other CP ranks in the consistency
exchange (they reach it in their first attention call; most often they refuse too, at once)."""

_REFUSED_CONFIG_FLAGS: dict[str, str] = {
    "fp8_dot_product_attention": "attention computes in the inputs' dtype (fp8 would silently not apply)",
    "fp8_multi_head_attention": "attention computes in the inputs' dtype (fp8 would silently not apply)",
}
"""Config flags whose feature needs something this core attention lacks: refused at build,
instead of a size mismatch or a missing attribute deep inside a training step."""


@dataclass(frozen=True, kw_only=True)
class CPAttentionOptions:
    """Options Megatron's config has no field for (see :mod:`.args` for the CLI flags)."""

    load_balance: str = "te"
    """How a THD batch whose ``PackedSeqParams`` carry no megatron_cp_ext sharding was split
    across CP ranks. ``"te"`` (default): Megatron's own THD split (TransformerEngine's
    ``thd_get_partitioned_indices``, per document, as ``get_thd_batch_on_this_cp_rank`` /
    ``get_batch_on_this_cp_rank`` and the Bridge and NeMo data steps do); documents whose
    lengths are not multiples of ``2*cp`` cannot come from it and are refused. One of
    :data:`megatron_cp_ext.BALANCES`: plain params are refused (``cu_seqlens`` cannot say which
    split the data got; any split but TE's must come with the params).
    ``cu_seqlens_q_padded`` always means ``"te"``, and params made by ``shard_batch_for_cp`` /
    ``make_packed_seq_params`` carry their own split."""
    backend: str = "auto"
    """Local attention kernels: ``auto`` (flash on CUDA, exact reference on CPU) | ``reference`` | ``flash``."""
    chunk_size: int | None = None
    """Chunked attention (attend only within ``[n*c, (n+1)*c)``); ``None`` falls back to
    ``config.attention_chunk_size`` when the config has one."""
    check: bool = False
    """Compare every attention call's arguments across CP ranks (``cp_attention(check=True)``):
    one small all-gather and a host sync per layer call, so that rank-local drift raises on
    every rank instead of hanging. Off by default; see ``docs/reliability.md`` for its cost."""

    def __post_init__(self) -> None:
        if not isinstance(self.load_balance, str) or self.load_balance not in LAYOUTS:
            raise CPArgumentError(f"load_balance must be one of {LAYOUTS}, got {self.load_balance!r}")
        as_choice(self.backend, "backend", BACKENDS)
        as_chunk(self.chunk_size)
        as_bool(self.check, "check")


def resolve_cp_comm_type(cp_comm_type: str | None, config: TransformerConfig, layer_number: int) -> str:
    """This layer's comm type: the explicit argument, else ``config.cp_comm_type`` (a string,
    or a per-layer list indexed by the 1-based global ``layer_number``), else ``p2p``."""
    choice: Any = cp_comm_type if cp_comm_type is not None else config.cp_comm_type
    if isinstance(choice, (list, tuple)):
        if not 1 <= layer_number <= len(choice):
            raise ValueError(f"cp_comm_type lists {len(choice)} layers; layer {layer_number} has no entry")
        choice = choice[layer_number - 1]
    choice = "p2p" if choice is None else choice
    if choice not in (*COMM_TYPES, "auto"):
        raise ValueError(
            f"cp_comm_type must be one of {COMM_TYPES} or 'auto' (or a per-layer list of them), got {choice!r}"
        )
    return choice


class CPCoreAttention(MegatronModule):
    """Megatron core attention running :func:`megatron_cp_ext.cp_attention`.

    Works at CP size 1 (plain local attention through the same backends) and for every comm
    type at CP > 1, for thd (with ``packed_seq_params``) and sbhd inputs, GQA included; with
    Megatron's hybrid CP, sbhd sub-samples run on the CP group their ``packed_seq_params``
    carry (:mod:`.subgroups`).
    Raises at construction for what it cannot honour: attention dropout > 0, non-vanilla
    softmax, cross attention, arbitrary masks, a2a+p2p without hierarchical groups.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str = "self",
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        *,
        options: CPAttentionOptions | None = None,
        **unused: Any,
    ) -> None:
        super().__init__(config=config)
        self.options = options or CPAttentionOptions()
        self.layer_number = max(1, layer_number)
        self._check_supported(config, attn_mask_type, attention_type, attention_dropout)
        self.attn_mask_type = attn_mask_type
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        cp_group = getattr(pg_collection, "cp", None)
        tp = getattr(pg_collection, "tp", None)
        self.tp_group = tp
        tp_size = tp.size() if tp is not None else 1
        install_softmax_offset(self, config, tp_size)
        self.cp_group = cp_group
        self.cp_size = dist.get_world_size(cp_group) if cp_group is not None else 1
        self.cp_rank = dist.get_rank(cp_group) if cp_group is not None else 0
        self.sp_multiple = tp_size if config.sequence_parallel else 1
        """Sequence parallelism scatters every rank's tokens over TP: counts must divide."""
        if config.context_parallel_size > 1 and self.cp_size != config.context_parallel_size:
            raise ValueError(
                f"config.context_parallel_size={config.context_parallel_size} but the CP group has {self.cp_size} ranks"
            )
        self.cp_comm_type = resolve_cp_comm_type(cp_comm_type, config, self.layer_number)
        self.comm_group: Any = None
        if self.cp_size > 1:
            # auto considers a2a+p2p only when hierarchical groups are configured
            hcp = getattr(pg_collection, "hcp", None) or getattr(config, "hierarchical_context_parallel_sizes", None)
            use_hcp = self.cp_comm_type == "a2a+p2p" or (self.cp_comm_type == "auto" and bool(hcp))
            # every layer builds them when configured: groups from sizes are a collective that ranks
            # whose layers differ (pipeline stages) must all join, at their first layer
            pair = hierarchical_groups(config, pg_collection, cp_group) if hcp or use_hcp else None
            self.comm_group = pair if use_hcp else cp_group
        window = config.window_size
        use_window = is_layer_window_attention(window, config.window_attn_skip_freq, self.layer_number)
        self.window_size = as_window(window, "config.window_size") if use_window else (-1, -1)
        self.chunk_size = self.options.chunk_size or getattr(config, "attention_chunk_size", None)
        self.softmax_scale = softmax_scale
        # QK-clip / max-logit logging: Megatron reads and resets this (see .qk_clip)
        self.current_max_attn_logits: torch.Tensor | None = None
        self._max_logits = wants_max_logits(config)
        self._engine_kwargs = {"backend": self.options.backend} if self.options.backend != "auto" else {}
        if self.options.check:
            self._engine_kwargs["check"] = True
        self._sp_checked: Any = None
        self._equal_counts_for = router_losses(config)
        missing = set(self._engine_kwargs) - set(inspect.signature(cp_attention).parameters)
        if missing:
            raise ValueError(f"this megatron_cp_ext engine has no {sorted(missing)} option; leave it at its default")

    @staticmethod
    def _check_supported(config, attn_mask_type, attention_type, attention_dropout) -> None:
        for flag in _REFUSED_CONFIG_FLAGS:
            if getattr(config, flag, False):
                raise CPArgumentError(f"CPCoreAttention does not support config.{flag}: {_REFUSED_CONFIG_FLAGS[flag]}")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(
                f"CPCoreAttention does not implement attention dropout (got {dropout}); set attention_dropout=0.0"
            )
        if attention_type != "self":
            raise ValueError(f"CPCoreAttention supports self attention only, got attention_type={attention_type!r}")
        if attn_mask_type not in _MASK_CAUSAL and attn_mask_type not in _MASK_PADDED:
            raise ValueError(
                f"CPCoreAttention supports attn_mask_type causal/no_mask (and padding[_causal] for thd), "
                f"got {attn_mask_type}"
            )

    def batch_context(self, packed_seq_params: PackedSeqParams, tokens: int | None = None) -> CPBatchContext:
        """The micro-batch's sharding and positions (THD), shared by every layer and its RoPE.

        Host-only after the first layer of a micro-batch. Refuses, identically on every CP rank
        and before any collective, what would otherwise hang or be silently wrong: Megatron's
        per-call CP groups, a split other than the one this process split the data with, a
        ``cu_seqlens`` total other than the tokens the ranks hold (``tokens``: this rank's), and
        token counts sequence parallelism cannot scatter.
        """
        try:
            call_group(packed_seq_params, self.cp_group, self.comm_group, self.cp_comm_type, thd=True)
            ctx = cp_context(packed_seq_params, self.cp_size, self.cp_rank, self.options.load_balance, tokens)
            if self.sp_multiple > 1 and ctx.sharding is not self._sp_checked:
                check_token_multiple(ctx.sharding, self.sp_multiple, f"sequence parallelism (TP {self.sp_multiple})")
                self._sp_checked = ctx.sharding
        except CPArgumentError as err:
            self._refuse_everywhere(err, packed_seq_params)
        return ctx

    def _refuse_everywhere(self, err: ValueError, params: PackedSeqParams | None = None) -> NoReturn:
        """Raise ``err`` (as a ``CPArgumentError``) on every CP rank: a rank whose data was split
        otherwise (it recorded another split, or none) would else attend alone and wait in its
        first exchange. This rank joins ``cp_attention``'s consistency exchange with the error
        flag (never returns), on the layer's CP group, then on the hybrid CP sub-groups
        ``params`` name (:func:`~.subgroups.peer_groups`)."""
        err = err if isinstance(err, CPArgumentError) else CPArgumentError(str(err))
        group = self.comm_group if self.cp_size > 1 else None
        also = peer_groups(params) if params is not None else ()
        agreement.raise_everywhere(err, None, self.cp_size, self.cp_rank, REFUSAL_WAIT_S, group, also)

    @torch.compiler.disable(reason="host side: the micro-batch's sharding and its checks")
    def local_positions(
        self, packed_seq_params: PackedSeqParams, s_local: int, device, rope_rows: int | None = None
    ) -> torch.Tensor:
        """Position in its sequence of each of this rank's ``s_local`` THD tokens (for RoPE),
        after :meth:`layer_context`'s checks and, given the RoPE table's ``rope_rows``, that
        it covers the longest sequence. Not traced by dynamo (one graph break): the token dim
        of the result is dynamic."""
        ctx = self.layer_context(packed_seq_params, s_local)
        if rope_rows is not None:
            self._check_rope_rows(ctx, rope_rows)
        positions = ctx.positions(device)
        torch._dynamo.maybe_mark_dynamic(positions, 0)  # no recompile for the next micro-batch's count
        return positions

    @torch.compiler.disable(reason="host side: the micro-batch's sharding and its checks")
    def layer_context(self, packed_seq_params: PackedSeqParams, s_local: int) -> CPBatchContext:
        """:meth:`batch_context` for a Megatron attention layer holding ``s_local`` THD tokens,
        checking that count, and refusing on every rank (host counts, before Megatron's code
        runs) a split that leaves a CP rank no tokens (``CPCoreAttention`` alone runs such a
        rank, Megatron's q/k/v reshapes fail on it while the other ranks wait) or, with MoE
        router losses, one whose counts differ (:func:`~.context.count_refusal`)."""
        ctx = self.batch_context(packed_seq_params, s_local)
        counts = ctx.sharding.counts()
        if counts[ctx.rank] != s_local:  # a rank whose count agrees waits in its exchange: refuse there too
            self._refuse_everywhere(
                CPArgumentError(
                    f"CP rank {ctx.rank} holds {s_local} tokens, but the micro-batch's {ctx.sharding.balance!r} "
                    f"sharding gives it {counts[ctx.rank]} (counts {counts}): the batch was split differently "
                    "from the layout the attention uses. Split it with shard_batch_for_cp (its packed_seq_params carry "
                    "the split), or set cu_seqlens_q_padded when it was split by TransformerEngine's THD split"
                )
            )
        refusal = count_refusal(ctx.sharding, self.cp_size, self._equal_counts_for)
        if refusal is not None:
            self._refuse_everywhere(refusal)
        return ctx

    def _check_rope_rows(self, ctx: CPBatchContext, rows: int) -> None:
        """The RoPE table (sized by Megatron from ``max_seqlen_q``) covers the longest sequence,
        or the same error on every rank: a short one fails only on the ranks holding far
        positions (a device assert on a GPU) while the others wait. Host values only."""
        cu = ctx.sharding.cu_seqlens
        longest = ctx.sharding._cache.get("longest")
        if longest is None:
            longest = ctx.sharding._cache["longest"] = max((b - a for a, b in zip(cu[:-1], cu[1:])), default=0)
        if rows < longest:
            self._refuse_everywhere(
                CPArgumentError(
                    f"rotary_pos_emb has {rows} positions, but the micro-batch's longest sequence has {longest} "
                    "tokens: PackedSeqParams.max_seqlen_q (which Megatron sizes the RoPE table from) must be at least "
                    "the longest sequence"
                )
            )

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        """The learnable softmax offset, sharded like Megatron's own attention's."""
        return offset_sharded_state_dict(self, prefix, sharded_offsets, metadata, self.tp_group)

    def _causal(self, attn_mask_type: AttnMaskType | None, thd: bool, attention_mask) -> bool:
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if mask_type in _MASK_CAUSAL:
            return _MASK_CAUSAL[mask_type]
        if mask_type in _MASK_PADDED and (thd or attention_mask is None):
            return _MASK_PADDED[mask_type]  # in THD, padding is expressed by cu_seqlens
        raise ValueError(f"attn_mask_type {mask_type} with a dense attention_mask is not supported (use thd)")

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        """thd ``[t, h, d] -> [t, h*dv]``; sbhd ``[s, b, h, d] -> [s, b, h*dv]``.

        For causal/no-mask types a dense ``attention_mask`` is ignored: the mask is defined by
        positions (and ``cu_seqlens`` for thd), which is what such a tensor encodes.
        """
        if attention_bias is not None:
            raise ValueError("CPCoreAttention does not support attention_bias")
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        # At CP size 1 nothing moves; any comm type is plain local attention.
        group, comm = self.comm_group, self.cp_comm_type if self.cp_size > 1 else "p2p"
        if packed_seq_params is not None and not thd:  # Megatron's hybrid CP: a group per sub-sample
            try:
                sub = call_group(packed_seq_params, self.cp_group, self.comm_group, self.cp_comm_type, thd=False)
            except CPArgumentError as err:
                self._refuse_everywhere(err, packed_seq_params)
            group, comm = sub if sub is not None else (group, comm)
        kwargs = dict(
            cp_group=group,
            comm_type=comm,
            causal=self._causal(attn_mask_type, thd, attention_mask),
            window_size=self.window_size,
            chunk_size=self.chunk_size,
            softmax_scale=self.softmax_scale,
            softmax_offset=self.softmax_offset,
            **self._engine_kwargs,
        )
        if thd:
            out = self._attend(query, key, value, packed_seq_params, qkv_format="thd", **kwargs)
            return out.flatten(-2)  # [t, h * d]; also for a rank that holds no tokens
        out = self._attend(query, key, value, None, qkv_format="sbhd", **kwargs)
        return out.flatten(-2)

    @torch.compiler.disable(reason="host side: the micro-batch's sharding, cp_attention, the max-logit record")
    def _attend(self, query, key, value, packed_seq_params: PackedSeqParams | None, **kwargs: Any) -> torch.Tensor:
        """``cp_attention`` (on the micro-batch's sharding for thd), recording the max logits when
        Megatron asks. One unit outside dynamo: one graph break here (and in :meth:`local_positions`),
        and no per-micro-batch Python object reaches a guard (``docs/compile.md``)."""
        if packed_seq_params is not None:
            kwargs["sharding"] = self.batch_context(packed_seq_params, query.shape[0]).sharding
        if not self._max_logits:
            return cp_attention(query, key, value, **kwargs)
        out, max_logit = cp_attention(query, key, value, return_max_logit=True, **kwargs)
        record_max_logit(self, max_logit)
        return out

"""Multi-latent attention (MLA) with CP core attention and RoPE/YaRN at true positions.

Megatron's ``MLASelfAttention`` owns its rotary table (``RotaryEmbedding`` or
``YarnRotaryEmbedding`` on the ``qk_pos_emb_head_dim`` part of q and k) and applies it inside
``get_query_key_value_tensors``. Under CP that table is wrong for us twice over: in sbhd it is
cut by Megatron's dual-chunk split (right only for that split), and in THD Megatron rotates with
``cu_seqlens`` assuming TransformerEngine's padded per-rank layout (``seqlens // cp`` tokens of
every sequence per rank), which crashes or rotates at wrong positions for any other sharding.
On CPU it cannot even be built (both tables insist on CUDA).

:class:`CPMLASelfAttention` keeps all of Megatron's MLA code (projections, norms, the MLA
rotation layout, value padding, output) and changes only where the angles come from: its
rotary module is a :class:`CPMLARotaryEmbedding` that returns one row per *local token*, at
that token's true position in its sequence (the micro-batch plan's positions in THD, the
dual-chunk positions in sbhd), computed on the device from positions uploaded once per
micro-batch. Megatron then rotates in its plain per-token (sbhd) mode: no ``cu_seqlens``, no
host sync. YaRN's inverse frequencies and concentration factor (mscale) come from Megatron's
own YaRN helpers, so both ``rope_type`` values match Megatron's tables row for row.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch
from megatron.core.models.common.embeddings import yarn_rotary_pos_embedding as _yarn
from megatron.core.transformer import multi_latent_attention as _mla_module
from megatron.core.transformer.multi_latent_attention import MLASelfAttention

from .rope import CPRotaryEmbedding, Fp32Frequencies, _zigzag_positions_on
from .subgroups import split_group

__all__ = ["CPMLARotaryEmbedding", "CPMLASelfAttention", "local_token_positions"]


class CPMLARotaryEmbedding(Fp32Frequencies):
    """MLA's rotary table, evaluated only at the positions of this rank's tokens.

    ``positions`` (``[t]`` int, on the model's device) is set by :class:`CPMLASelfAttention`
    around each projection; ``forward`` returns ``[t, 1, 1, dim]`` angles (and, for YaRN,
    Megatron's concentration factor as ``(emb, mscale)``, the pair ``YarnRotaryEmbedding``
    returns). Angles are ``position * inv_freq`` in fp32, as Megatron's ``torch.outer`` table.
    """

    def __init__(self, inv_freq: torch.Tensor, mscale: float | None) -> None:
        super().__init__()
        # Non-persistent: follows .to()/.cuda(), stays out of checkpoints (as Megatron's); fp32
        # through dtype casts (Fp32Frequencies).
        self.register_buffer("inv_freq", inv_freq.to(torch.float32), persistent=False)
        self.mscale = mscale
        """``None`` for ``rope_type='rope'`` (forward returns the table only)."""
        self.positions: torch.Tensor | None = None

    @classmethod
    def rope(
        cls, kv_channels: int, rotary_percent: float = 1.0, rotary_base: float = 10000, **unused: Any
    ) -> CPMLARotaryEmbedding:
        """Built with ``RotaryEmbedding``'s arguments as MLA passes them."""
        table = CPRotaryEmbedding(kv_channels, rotary_percent, rotary_base=rotary_base)
        return cls(table.inv_freq, None)

    @classmethod
    def yarn(
        cls,
        kv_channels: int,
        rotary_base: float = 10000.0,
        scaling_factor: float = 1.0,
        original_max_position_embeddings: int = 4096,
        beta_fast: float = 32.0,
        beta_slow: float = 1.0,
        mscale: float = 1.0,
        mscale_all_dim: float = 0.0,
        correction_range_round_to_int: bool = True,
        **unused: Any,
    ) -> CPMLARotaryEmbedding:
        """Built with ``YarnRotaryEmbedding``'s arguments as MLA passes them. YaRN's frequency
        blend does not depend on the position, so one ``inv_freq`` vector describes the table."""
        dim = kv_channels
        exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
        extra = 1.0 / (rotary_base**exponents)
        inter = 1.0 / (scaling_factor * rotary_base**exponents)
        low, high = _yarn._yarn_find_correction_range(
            beta_fast, beta_slow, dim, rotary_base, original_max_position_embeddings, correction_range_round_to_int
        )
        keep = 1.0 - _yarn._yarn_linear_ramp_mask(low, high, dim // 2, device="cpu").to(torch.float32)
        inv_freq = inter * (1 - keep) + extra * keep
        concentration = _yarn._yarn_get_concentration_factor(scaling_factor, mscale, mscale_all_dim)
        return cls(inv_freq, float(concentration))

    def get_rotary_seq_len(self, *args: Any, **kwargs: Any) -> int:
        """Unused (the positions decide the rows); kept for Megatron's call."""
        return 0

    def get_cached_cos_sin(self, *args: Any, **kwargs: Any):
        raise ValueError("CPMLASelfAttention does not support apply_rope_fusion; set apply_rope_fusion=False")

    def forward(self, max_seq_len: int = 0, offset: int = 0, packed_seq: bool = False, cp_group=None):
        """``[t, 1, 1, dim]`` angles at :attr:`positions` (``(angles, mscale)`` for YaRN)."""
        if self.positions is None:
            raise RuntimeError("CPMLARotaryEmbedding is driven by CPMLASelfAttention, which sets token positions")
        if offset:
            raise ValueError("CPMLARotaryEmbedding has no position offset (training/prefill only)")
        pos = self.positions.to(self.inv_freq.dtype)
        freqs = pos[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]
        return emb if self.mscale is None else (emb, self.mscale)


_BUILD_LOCK = threading.Lock()


@contextlib.contextmanager
def _cp_rotary_tables():
    """While ``MultiLatentAttention.__init__`` runs, have it build our rotary modules.

    It looks up ``RotaryEmbedding``/``YarnRotaryEmbedding`` in its own module and gives them
    no ``use_cpu_initialization`` (they would land on CUDA, and fail on CPU), so those two
    names are pointed at our builders for the duration of the constructor, under a lock.
    """
    names = ("RotaryEmbedding", "YarnRotaryEmbedding")
    missing = [n for n in names if not hasattr(_mla_module, n)]
    if missing:
        raise ImportError(f"this megatron-core's multi_latent_attention has no {missing}; MLA CP is untested here")
    # megatron-core 0.16 sets HAVE_TE when its TE extension module imports, even with TE
    # absent (TELinear a placeholder), then calls isinstance(x, TELinear): without TE, say so.
    no_te = getattr(_mla_module, "HAVE_TE", False) and not isinstance(getattr(_mla_module, "TELinear", None), type)
    names += ("HAVE_TE",) if no_te else ()
    with _BUILD_LOCK:
        saved = [getattr(_mla_module, n) for n in names]
        _mla_module.RotaryEmbedding = CPMLARotaryEmbedding.rope
        _mla_module.YarnRotaryEmbedding = CPMLARotaryEmbedding.yarn
        if no_te:
            _mla_module.HAVE_TE = False
        try:
            yield
        finally:
            for name, obj in zip(names, saved):
                setattr(_mla_module, name, obj)


def local_token_positions(attention: torch.nn.Module, s_local: int, packed_seq_params, device) -> torch.Tensor:
    """Position in its sequence of each of this rank's ``s_local`` tokens (``[s_local]`` on
    ``device``): from the micro-batch plan in THD, Megatron's dual-chunk split in sbhd. Both
    are built on the host once per micro-batch (or shape) and cached; nothing syncs."""
    if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
        return attention.core_attention.local_positions(packed_seq_params, s_local, device)
    cp = split_group(attention, packed_seq_params)  # Megatron's hybrid CP: the params' own sub-group
    cp_size, cp_rank = (cp.size(), cp.rank()) if cp is not None else (1, 0)
    try:
        return _zigzag_positions_on(s_local, cp_size, cp_rank, torch.device(device))
    except ValueError as err:  # this rank's length alone: its CP peers (layer or sub-group) wait in an exchange
        if cp_size > 1:
            attention.core_attention._refuse_everywhere(err, packed_seq_params)
        raise


def _local_seq_len(attention: torch.nn.Module, hidden_states: torch.Tensor) -> int:
    """This CP rank's sequence length as q and k see it: with sequence parallelism the
    projections gather the TP ranks' ``s / tp`` rows before RoPE is applied."""
    s_local = hidden_states.shape[0]
    tp = getattr(attention.pg_collection, "tp", None)
    if attention.config.sequence_parallel and tp is not None:
        s_local *= tp.size()
    return s_local


class CPMLASelfAttention(MLASelfAttention):
    """Megatron ``MLASelfAttention`` whose RoPE/YaRN rotates each token at its true position.

    Build it through :func:`~.spec.get_gpt_layer_cp_spec` (``multi_latent_attention=True``) so
    that its core attention is :class:`~.core_attention.CPCoreAttention`. Training/prefill only.
    """

    def __init__(self, config, *args: Any, **kwargs: Any) -> None:
        if config.apply_rope_fusion:
            raise ValueError("CPMLASelfAttention does not support apply_rope_fusion; set apply_rope_fusion=False")
        if getattr(config, "cache_mla_latents", False):
            raise ValueError("CPMLASelfAttention is for training; cache_mla_latents is an inference option")
        with _cp_rotary_tables():
            super().__init__(config, *args, **kwargs)

    def forward(self, hidden_states, attention_mask, *args: Any, **kwargs: Any):
        """Megatron's MLA forward (training/prefill only)."""
        if kwargs.get("inference_context") is not None or kwargs.get("inference_params") is not None:
            raise ValueError("CPMLASelfAttention is for training; run inference with Megatron's own attention")
        if len(args) > 1 and args[1] is not None:  # (key_value_states, inference_context, ...)
            raise ValueError("CPMLASelfAttention is for training; run inference with Megatron's own attention")
        return super().forward(hidden_states, attention_mask, *args, **kwargs)

    def get_query_key_value_tensors(
        self, hidden_states, key_value_states=None, position_ids=None, packed_seq_params=None, *args, **kwargs
    ):
        """Megatron's MLA projections and rotation, with per-token angles at true positions.

        THD is run through Megatron's per-token path as ``[t, 1, ...]`` and squeezed to
        ``[t, ...]`` afterwards, exactly what Megatron's packed path does before the up
        projections (row-wise ops, so the numbers are the same); this keeps Megatron's
        ``cu_seqlens`` rotation (padded-layout, host-syncing) out of the way.
        """
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        rope = self.rotary_pos_emb
        s_local = _local_seq_len(self, hidden_states)
        rope.positions = local_token_positions(self, s_local, packed_seq_params, hidden_states.device)
        try:
            out = super().get_query_key_value_tensors(
                hidden_states, key_value_states, position_ids, None if thd else packed_seq_params, *args, **kwargs
            )
        finally:
            rope.positions = None
        if thd:
            out = tuple(x.squeeze(1) if isinstance(x, torch.Tensor) else x for x in out)
        return out

"""RoPE at each token's true position, without host syncs, and a CPU-safe RoPE table.

Why not Megatron's own path: under CP its THD RoPE (``_apply_rotary_pos_emb_thd``) assumes
TransformerEngine's padded layout (``seqlens // cp`` tokens of every sequence per rank) and
calls ``.tolist()``/``.item()`` in every layer. With any-length sharding that rotates tokens
at wrong positions. Here a rank's tokens are rotated by indexing the full (unsliced) table
with the positions the plan already knows (uploaded once per micro-batch), and the rotation
itself is Megatron's public ``apply_rotary_pos_emb`` on a per-token table, so interleaved,
fused and mscale variants behave as in Megatron.

``RotaryEmbedding.get_emb`` in megatron-core 0.16 moves ``inv_freq`` to CUDA
unconditionally; :class:`CPRotaryEmbedding` computes the same table on whatever device the
model lives on (its ``inv_freq`` is a buffer that follows ``.to()``), and never CP-slices it:
our attention picks rows by true position instead.
"""

from __future__ import annotations

import torch
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.transformer_config import TransformerConfig

__all__ = ["CPRotaryEmbedding", "install_cp_rope", "apply_rope_at_positions", "local_rope_freqs"]


class Fp32Frequencies(torch.nn.Module):
    """Keeps the ``inv_freq`` buffer fp32 through the module's dtype casts.

    As a buffer it follows ``model.to(device)``; but ``Float16Module`` (Megatron's ``--bf16`` /
    ``--fp16``) casts every buffer too, and Megatron's table builds positions in
    ``inv_freq``'s dtype: in bf16 the positions past 256 round (257 -> 256, 1001 -> 1000) and
    the angles lose their precision. Megatron's own ``RotaryEmbedding`` keeps a plain fp32
    attribute, which casts never reach; here device moves apply and dtype casts do not."""

    def _apply(self, fn, recurse: bool = True):
        kept = self.inv_freq
        super()._apply(fn, recurse)
        if self.inv_freq.dtype != kept.dtype:
            self.inv_freq = kept.to(self.inv_freq.device)
        return self


class CPRotaryEmbedding(Fp32Frequencies, RotaryEmbedding):
    """Megatron's ``RotaryEmbedding`` table, on the model's device and never CP-sliced.

    ``forward(max_seq_len)`` returns ``[max_seq_len, 1, 1, dim]`` for positions
    ``0..max_seq_len-1`` whatever the CP size; :class:`~.spec.CPSelfAttention` gathers the
    rows of its local tokens. Same formula as Megatron (``rotary_base``, ``rotary_percent``,
    interleaving, linear interpolation; llama-3 scaling via :meth:`from_megatron`).
    """

    def __init__(
        self,
        kv_channels: int,
        rotary_percent: float = 1.0,
        rotary_interleaved: bool = False,
        seq_len_interpolation_factor: float | None = None,
        rotary_base: int = 10000,
        rope_scaling: bool = False,
        rope_scaling_factor: float = 8.0,
    ) -> None:
        super().__init__(
            kv_channels,
            rotary_percent,
            rotary_interleaved=rotary_interleaved,
            seq_len_interpolation_factor=seq_len_interpolation_factor,
            rotary_base=rotary_base,
            rope_scaling=rope_scaling,
            rope_scaling_factor=rope_scaling_factor,
            use_cpu_initialization=True,
        )
        inv_freq = self.inv_freq
        del self.inv_freq
        # A non-persistent buffer follows model.to()/cuda() and stays out of checkpoints.
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._table_cache: tuple | None = None

    @classmethod
    def from_megatron(cls, rope: RotaryEmbedding) -> CPRotaryEmbedding:
        """Same frequencies as an existing Megatron ``RotaryEmbedding`` (scaling included)."""
        dim = 2 * rope.inv_freq.numel()
        new = cls(dim, 1.0, rope.rotary_interleaved, rope.seq_len_interpolation_factor)
        new.inv_freq = rope.inv_freq.detach().to("cpu", torch.float32).clone()
        return new

    def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        """``[max_seq_len, 1, 1, dim]`` RoPE angles on ``inv_freq``'s device (no CUDA move)."""
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)
        if self.rotary_interleaved:
            emb = torch.stack((freqs, freqs), dim=-1).reshape(freqs.shape[0], -1)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb[:, None, None, :]

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None) -> torch.Tensor:
        """The full table; ``packed_seq`` and ``cp_group`` are accepted for API parity only."""
        key = (max_seq_len, offset, self.inv_freq.device)
        if self._table_cache is None or self._table_cache[0] != key:
            self._table_cache = (key, self.get_emb(max_seq_len, offset))
        return self._table_cache[1]


def install_cp_rope(model: torch.nn.Module) -> torch.nn.Module:
    """Swap every Megatron ``RotaryEmbedding`` in ``model`` for a :class:`CPRotaryEmbedding`.

    Needed on CPU (Megatron's table insists on CUDA) and harmless on GPU. Returns ``model``.
    """
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is RotaryEmbedding:
                setattr(module, name, CPRotaryEmbedding.from_megatron(child))
    return model


_ZIGZAG_CACHE: dict[tuple, torch.Tensor] = {}


def _zigzag_positions_on(s_local: int, cp_size: int, rank: int, device: torch.device) -> torch.Tensor:
    from .batch import zigzag_positions

    key = (s_local, cp_size, rank, device)
    pos = _ZIGZAG_CACHE.get(key)
    if pos is None:
        pos = _ZIGZAG_CACHE[key] = zigzag_positions(s_local, cp_size, rank).to(device)
    return pos


def local_rope_freqs(
    table: torch.Tensor,
    *,
    positions: torch.Tensor | None,
    s_local: int,
    cp_size: int,
    cp_rank: int,
) -> torch.Tensor:
    """Per-local-token RoPE angles ``[t, 1, 1, dim]``.

    ``positions`` (THD): each local token's position in its sequence, on the table's device.
    ``None`` (sbhd/bshd): Megatron's dual-chunk split; a table already sliced by Megatron's
    own ``RotaryEmbedding`` (``s_local`` rows under CP) is right as it is.
    """
    if positions is not None:
        return table.index_select(0, positions)
    if cp_size > 1 and table.shape[0] == s_local:
        return table
    if table.shape[0] < s_local * cp_size:
        raise ValueError(
            f"RoPE table has {table.shape[0]} rows; {s_local * cp_size} positions are needed "
            f"(local sequence {s_local} x cp {cp_size})"
        )
    return table.index_select(0, _zigzag_positions_on(s_local, cp_size, cp_rank, table.device))


def apply_rope_at_positions(
    x: torch.Tensor,
    freqs: torch.Tensor,
    config: TransformerConfig,
    *,
    mscale: float = 1.0,
    cp_group=None,
) -> torch.Tensor:
    """Rotate ``x`` ``[t, b, h, d]`` by per-token angles ``freqs`` ``[t, 1, 1, dim]``."""
    return apply_rotary_pos_emb(x, freqs, config=config, cu_seqlens=None, mscale=mscale, cp_group=cp_group)

"""TransformerEngine's THD split as a :class:`~megatron_cp_ext.CPSharding`.

Megatron's ``get_thd_batch_on_this_cp_rank`` and Megatron-Bridge's GPT step split packed
batches with TransformerEngine's ``thd_get_partitioned_indices``: every sequence (of its
*padded* length, a multiple of ``2*cp``) is cut into ``2*cp`` equal chunks, and CP rank r
holds chunk r and chunk ``2*cp-1-r`` of each sequence, sequence after sequence. A batch split
that way can only be trained by an attention that assigns tokens the same way, so this layout
is recognised from ``cu_seqlens_q_padded`` (or chosen by name, ``"te"``) instead of balanced.

It differs from the ``dualchunk`` balance only in the local order (``dualchunk`` lists all
first chunks, then all second ones) and in refusing lengths that are not multiples of
``2*cp`` (TransformerEngine pads them; an uneven cut would not be its split).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

from ..runtime.validation import CPArgumentError, as_int
from . import CPSharding, check_cu_seqlens

__all__ = ["TE_LAYOUT", "separate_padding", "te_thd_sharding"]

TE_LAYOUT = "te"
"""Name of this layout (``CPSharding.balance``, ``load_balance=``, ``shard_batch_for_cp(balance=)``)."""


def te_thd_sharding(
    cu_seqlens: torch.Tensor | Sequence[int], cp_size: int, *, name: str = "cu_seqlens_padded"
) -> CPSharding:
    """The sharding TransformerEngine's ``thd_get_partitioned_indices`` produces.

    ``cu_seqlens``: global host prefix sums of the (padded) sequence lengths, each a multiple
    of ``2*cp_size`` (any lengths at CP size 1, where nothing is split); ``name`` is what an
    error calls them. Every rank holds the same number of tokens, ``total / cp_size``.
    """
    cu = check_cu_seqlens(cu_seqlens, name)
    cp_size = as_int(cp_size, "cp_size", minimum=1)
    lens = np.diff(np.asarray(cu, dtype=np.int64))
    if cp_size == 1:
        seq = np.nonzero(lens)[0]
        return CPSharding._of(cu, [np.stack([seq, seq * 0, lens[seq]], axis=1)], TE_LAYOUT)
    bad = np.nonzero(lens % (2 * cp_size))[0]
    if len(bad):
        i = int(bad[0])
        raise CPArgumentError(
            f"{name} describe sequence {i} of length {int(lens[i])}, not a multiple of 2*cp = {2 * cp_size}: "
            "TransformerEngine's THD split (cu_seqlens_q_padded) pads every sequence to a multiple of 2*cp"
        )
    seq = np.nonzero(lens)[0]
    chunk = lens[seq] // (2 * cp_size)
    per_rank = []
    for r in range(cp_size):
        first, second = r * chunk, (2 * cp_size - 1 - r) * chunk
        rows = np.stack([seq, first, first + chunk, seq, second, second + chunk], axis=1)
        per_rank.append(rows.reshape(-1, 3))  # sequence after sequence: chunk r, then 2cp-1-r
    return CPSharding._of(cu, per_rank, TE_LAYOUT)


def separate_padding(sharding: CPSharding, cu_seqlens_real: Sequence[int], *, name: str = "cu_seqlens") -> CPSharding:
    """The same token placement, with every sequence's padding as a sequence of its own.

    ``sharding`` is over the padded batch (``cu_seqlens_padded``); ``cu_seqlens_real`` gives the
    real length of each sequence, whose padding sits at its end. Sequence i becomes sequences
    ``2i`` (its real tokens) and ``2i+1`` (its padding), and each segment is cut at the border,
    so every rank keeps its tokens in the same local order. Real tokens then never see padding
    under any mask, and padding sequences are :attr:`~.CPSharding.muted`: their tokens attend
    nothing (output 0, no gradient, no max logit, no transfer), as TransformerEngine computes
    real tokens only with ``cu_seqlens`` beside ``cu_seqlens_padded``.
    """
    cu = np.asarray(sharding.cu_seqlens, dtype=np.int64)
    real = np.diff(np.asarray(check_cu_seqlens(cu_seqlens_real, name), dtype=np.int64))
    padded = np.diff(cu)
    if len(real) != len(padded) or (real > padded).any():
        raise CPArgumentError(
            f"{name} must describe the same sequences as the padded cu_seqlens, each no longer than its padded "
            f"slot: real lengths {real.tolist()[:8]}, padded {padded.tolist()[:8]}"
        )
    lens = np.stack([real, padded - real], axis=1).reshape(-1)
    per_rank = []
    for r in range(sharding.cp_size):
        seg = sharding.rank_segments(r)
        seq, start, end, border = seg[:, 0], seg[:, 1], seg[:, 2], real[seg[:, 0]]
        head = np.stack([2 * seq, start, np.minimum(end, border)], axis=1)
        tail = np.stack([2 * seq + 1, np.maximum(start, border) - border, end - border], axis=1)
        rows = np.stack([head, tail], axis=1).reshape(-1, 3)  # head before tail: local order kept
        per_rank.append(rows[rows[:, 2] > rows[:, 1]])
    muted = [2 * i + 1 for i in np.nonzero(padded > real)[0].tolist()]  # padding: its tokens attend nothing
    return dataclasses.replace(CPSharding._of([0, *np.cumsum(lens).tolist()], per_rank, sharding.balance), muted=muted)

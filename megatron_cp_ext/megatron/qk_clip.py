"""Max attention logits for Megatron's QK-clip (MuonClip) and max-logit logging.

Megatron-core reads them from ``core_attention.current_max_attn_logits`` (the attribute
TransformerEngine's ``DotProductAttention`` keeps when ``config.qk_clip`` or
``config.log_max_attention_logit`` is set): a ``[heads of this TP partition]`` fp32 tensor,
``None`` until the first forward, the running max over the micro-batches since the last reset.
``SelfAttention.clip_qk`` / ``MLASelfAttention.clip_qk`` read it, rescale the q/k projection
weights per head and reset it to ``None``; ``megatron.core.optimizer.qk_clip.clip_qk`` first
all-reduces it (MAX) over the data × context parallel group.

:class:`~.core_attention.CPCoreAttention` keeps the same attribute from
``cp_attention(..., return_max_logit=True)``, which is already the max over the whole global
batch and identical on every CP rank, so a CP > 1 run clips exactly like CP 1. The attention
sink does not count (see :mod:`megatron_cp_ext.schedules.max_logit`).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["wants_max_logits", "record_max_logit"]


def wants_max_logits(config: Any) -> bool:
    """Whether Megatron will read max logits for this config (the flags TE's attention checks)."""
    return bool(getattr(config, "qk_clip", False) or getattr(config, "log_max_attention_logit", False))


def record_max_logit(module: torch.nn.Module, batch_max: torch.Tensor) -> None:
    """Fold one forward's ``[heads]`` max into ``module.current_max_attn_logits`` (running max
    over micro-batches until Megatron resets it to ``None``), as TE's attention does."""
    batch_max = batch_max.detach()
    current = getattr(module, "current_max_attn_logits", None)
    module.current_max_attn_logits = batch_max if current is None else torch.maximum(current, batch_max)

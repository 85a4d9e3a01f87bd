"""Megatron's hybrid context parallelism: a CP group per sub-sample, carried by ``PackedSeqParams``.

With ``hybrid_context_parallel`` Megatron's ``BalancedCPScheduler`` gives each sub-sample of a
packed micro-batch its own CP group, a power-of-2 slice of the DP×CP ranks
(``parallel_state.get_hybrid_data_context_parallel_groups``), and
``get_batch_on_this_hybrid_cp_rank`` builds ``PackedSeqParams(qkv_format="sbhd",
local_cp_size=n, cp_group=<that group>)`` and splits the sub-sample with Megatron's dual-chunk
split over that group. :func:`call_group` turns such params into the group and comm type one
attention call runs on; the engine then plans for that group's size (plans are cached per
sharding, i.e. per sub-sample shape and group size).

What TransformerEngine's attention does with the same params, this does too: ``cp_group`` set
means CP over that group; ``local_cp_size`` 1 without a group means no CP for the call. What
stays refused, with the same error on every rank of the sub-group, before any collective: a
``cp_group`` whose size differs from ``local_cp_size`` or that does not hold the rank, a size
that is not a power of 2, THD input with a per-call group, and ``a2a+p2p`` over a sub-group
other than the layer's own CP group (its hierarchical groups are built for that one). A rank
whose params alone are malformed refuses on the groups they name (:func:`peer_groups`), where
its partners wait.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch.distributed as dist

from ..runtime.validation import CPArgumentError
from .context import CONTEXT_ATTR

__all__ = ["call_group", "check_not_packed", "peer_groups", "split_group"]


@lru_cache(maxsize=64)
def _ranks_of(group: Any) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group))


def _ranks(group: Any) -> list[int]:
    """A group's global ranks (looked up once per group: every layer call asks)."""
    return list(_ranks_of(group))


def _megatron_group(size: int) -> Any:
    """Megatron's hybrid DP×CP group of ``size`` holding this rank (as its batch helper looks it up)."""
    try:
        from megatron.core import parallel_state

        return parallel_state.get_hybrid_data_context_parallel_groups(group_size=size)
    except Exception as exc:  # not initialised with hybrid_context_parallel, or no group of that size
        raise CPArgumentError(
            f"PackedSeqParams.local_cp_size={size} without cp_group, and Megatron's hybrid DP×CP group of that size "
            f"is not available ({type(exc).__name__}: {exc}); pass cp_group as get_batch_on_this_hybrid_cp_rank does"
        ) from None


def _hybrid_group(size: int) -> Any:
    """Megatron's hybrid DP×CP group of ``size`` holding this rank, or None."""
    try:
        return _megatron_group(size)
    except CPArgumentError:  # no hybrid groups (or none of that size)
        return None


def _hybrid_sizes() -> list[int]:
    """The sizes of Megatron's hybrid groups: the powers of 2 up to the DP×CP size."""
    try:
        from megatron.core import parallel_state

        dp_cp = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
    except Exception:  # parallel state not initialised
        return []
    return [1 << i for i in range(1, dp_cp.bit_length()) if 1 << i <= dp_cp]


def peer_groups(params: Any) -> list:
    """The groups whose ranks may be waiting for this rank's hybrid call: the params' own
    ``cp_group``, Megatron's hybrid group of their ``local_cp_size``, or, when they name neither
    validly (or no group has that size), every hybrid group holding this rank (smallest first).
    A rank that refuses its call joins their exchange with its error, so a partner whose own
    params were valid raises the same error instead of waiting for it
    (``agreement.raise_everywhere``'s ``also``)."""
    local, group = getattr(params, "local_cp_size", None), getattr(params, "cp_group", None)
    if (local is None and group is None) or not dist.is_initialized():
        return []
    found = [group] if isinstance(group, dist.ProcessGroup) and dist.get_rank(group) >= 0 else []
    pow2 = isinstance(local, int) and not isinstance(local, bool) and local > 1 and not local & (local - 1)
    named = [g for g in [_hybrid_group(local)] if g is not None] if pow2 else []
    for sub in named or ([] if found else [_hybrid_group(n) for n in _hybrid_sizes()]):
        if sub is not None and all(sub is not g for g in found):
            found.append(sub)
    return found


def check_not_packed(params: Any) -> None:
    """Non-THD params must not carry the package's packed split: the sbhd path splits by
    Megatron's dual-chunk rule and would attend with another split than the data's."""
    if getattr(params, CONTEXT_ATTR, None) is not None:
        raise CPArgumentError(
            f"PackedSeqParams carry a packed (THD) split (made by make_packed_seq_params / shard_batch_for_cp, or "
            f"by an earlier qkv_format='thd' call), but qkv_format is {params.qkv_format!r}: sbhd/bshd layers split "
            "by Megatron's dual-chunk rule and would attend with another split than the data's; keep "
            "qkv_format='thd' for packed batches"
        )


def call_group(params: Any, layer_group: Any, layer_comm_group: Any, comm_type: str, thd: bool) -> tuple | None:
    """``(cp_group, comm_type)`` for one call whose ``params`` carry their own CP group or size
    (``cp_group`` None: no CP for the call), or None when they carry none other than the
    layer's (``layer_group``; ``layer_comm_group``: what the layer itself would pass)."""
    if not thd:
        check_not_packed(params)
    local = getattr(params, "local_cp_size", None)
    group = getattr(params, "cp_group", None)
    if local is None and group is None:
        return None
    if layer_group is not None:
        layer_ranks = _ranks(layer_group)
    else:
        layer_ranks = [dist.get_rank() if dist.is_initialized() else 0]
    bad = isinstance(local, bool) or not isinstance(local, int) or local < 1 or local & (local - 1)
    if local is not None and bad:
        raise CPArgumentError(f"PackedSeqParams.local_cp_size must be a power of 2 (>= 1), got {local!r}")
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise CPArgumentError(f"PackedSeqParams.cp_group does not hold rank {dist.get_rank()}: each rank must get "
                              "the sub-group it belongs to (get_batch_on_this_hybrid_cp_rank)")  # fmt: skip
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise CPArgumentError(f"PackedSeqParams.cp_group must be a torch.distributed ProcessGroup, got {group!r}")
    if group is None and local is not None and local > 1:
        group = _megatron_group(local)
    if group is not None:
        size = dist.get_world_size(group)
        if local is not None and size != local:
            raise CPArgumentError(
                f"PackedSeqParams.cp_group has {size} ranks {_ranks(group)} but local_cp_size is {local}: "
                "they describe different sub-groups"
            )
        if _ranks(group) == layer_ranks:
            return None  # the layer's own CP group: its fixed path (hierarchical groups included)
    else:
        size = 1
        if len(layer_ranks) == 1:
            return None
    if thd:
        ranks = f" {_ranks(group)}" if group is not None else ""
        raise CPArgumentError(
            f"PackedSeqParams.cp_group / local_cp_size (local_cp_size={local}) ask for a CP group of {size} "
            f"ranks{ranks}, not this layer's CP group {layer_ranks}, with qkv_format='thd': THD batches run on the "
            "layer's own CP group. Give shard_batch_for_cp / make_packed_seq_params the model's CP group (their "
            "default); per-call groups are Megatron's hybrid CP, whose sub-samples come as sbhd "
            "(get_batch_on_this_hybrid_cp_rank)"
        )
    if size == 1:
        return None if len(layer_ranks) == 1 else (None, "p2p")
    if comm_type == "a2a+p2p":
        raise CPArgumentError(
            f"cp_comm_type 'a2a+p2p' over a hybrid CP sub-group of {size} ranks {_ranks(group)}: its hierarchical "
            f"groups exist only for the layer's CP group {layer_ranks}; use p2p, all_gather or a2a with "
            "hybrid_context_parallel"
        )
    return group, comm_type


def split_group(attention: Any, params: Any) -> Any:
    """The CP group a self-attention's tokens were split over for this call: the params' own
    sub-group (Megatron's hybrid CP: sbhd sub-samples, dual-chunk over that group), else the
    layer's CP group. What RoPE takes its ranks' positions from (GPT and MLA alike)."""
    cp = attention.pg_collection.cp
    if params is not None and params.qkv_format != "thd":
        core = attention.core_attention
        try:
            sub = call_group(params, core.cp_group, core.comm_group, core.cp_comm_type, thd=False)
        except CPArgumentError as err:  # a partner with valid params waits in its sub-group's exchange
            core._refuse_everywhere(err, params)
        cp = sub[0] if sub is not None else cp
    return cp

"""Megatron's hybrid CP grouping against ``workload`` sharding at the full CP size, predicted.

Hybrid CP (``hybrid_context_parallel``) runs a packed batch as a sequence of groups formed by
Megatron's own ``BalancedCPScheduler`` (called here as it is, on the host): in each group every
DP×CP rank holds some sub-samples, each sub-sample on a power-of-2 set of ranks (its CP group,
``max_seqlen_per_dp_cp_rank`` tokens per rank at most), split with Megatron's dual-chunk split.
The alternative keeps one CP group of all the ranks and shards the whole batch with
``workload``. Both are priced by the same cost model (:func:`.cost.predict`) on the same
profile: a sub-sample at CP ``n`` costs its plan's layer time on every rank of its group, a rank
runs its sub-samples of a group one after another, a group lasts as long as its slowest rank,
and the step is the groups in sequence. Attention only, per layer, forward plus backward:
predictions from the profile, not measurements.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from functools import cache

from ..inspect import inspect_plan
from ..runtime.validation import CPArgumentError, as_int
from ..sharding import batches, shard_sequences
from .cost import predict
from .profiles import HardwareProfile

__all__ = ["HybridComparison", "megatron_groups", "compare"]


@dataclass(frozen=True, kw_only=True)
class HybridComparison:
    """One comm type's predicted step (ms per layer, forward + backward attention)."""

    comm_type: str
    gpus: int
    hybrid_ms: float
    """Megatron's hybrid CP grouping."""
    workload_ms: float
    """One CP group of all ``gpus`` ranks, ``workload`` balance."""
    groups: int
    """Groups the scheduler formed (run one after another)."""
    cp_sizes: dict[int, int]
    """Sub-samples per CP size under hybrid CP."""

    @property
    def ratio(self) -> float:
        """hybrid ÷ workload (below 1: hybrid CP predicted faster)."""
        return self.hybrid_ms / self.workload_ms if self.workload_ms else float("inf")


def megatron_groups(lengths: list[int], gpus: int, max_seqlen_per_rank: int) -> list[list[list[int]]]:
    """Megatron's ``BalancedCPScheduler`` groups for ``lengths``: per group, per rank, the ids
    (indices into ``lengths``) of the sub-samples it holds. Needs megatron-core."""
    try:
        from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler
    except ImportError as exc:
        raise ImportError(f"hybrid CP grouping is Megatron's own scheduler: install megatron-core ({exc})") from None
    max_seqlen_per_rank = as_int(max_seqlen_per_rank, "max_seqlen_per_rank", minimum=1)
    sched = BalancedCPScheduler(max_seqlen_per_rank, types.SimpleNamespace(size=lambda: gpus))
    for n in lengths:  # the scheduler asserts (with no word on which document) where one cannot fit
        if n > 0 and sched.gpus_needed(n) > gpus:
            raise CPArgumentError(
                f"max_seqlen_per_rank {max_seqlen_per_rank}: a document of {n} tokens needs {sched.gpus_needed(n)} "
                f"ranks (a power of 2) at that many tokens per rank, more than the {gpus} there are"
            )
    _, ids = sched.get_groups_and_subsamples([(i, n) for i, n in enumerate(lengths) if n > 0], None)
    return [[list(map(int, per_rank)) for per_rank in group] for group in ids]


def compare(
    lengths: list[int],
    *,
    gpus: int,
    max_seqlen_per_rank: int,
    comm_types: tuple[str, ...],
    mask: dict,
    shapes: dict,
    profile: HardwareProfile,
) -> list[HybridComparison]:
    """Predicted step time of ``lengths`` under hybrid CP and under ``workload`` at ``gpus``."""
    groups = megatron_groups(lengths, gpus, max_seqlen_per_rank)

    @cache
    def sub_sample_s(n_tokens: int, cp: int, comm: str) -> float:
        sh = shard_sequences([0, n_tokens], cp, "dualchunk", **mask)
        rep = inspect_plan(sh, comm if cp > 1 else "p2p", **mask, **shapes)
        return predict(rep, profile).total_s

    sizes: dict[int, int] = {}
    holders = []
    for group in groups:
        count: dict[int, int] = {}
        for per_rank in group:
            for sid in per_rank:
                count[sid] = count.get(sid, 0) + 1
        holders.append(count)
        for c in count.values():
            sizes[c] = sizes.get(c, 0) + 1
    cu = batches.cu_seqlens(lengths)
    full = shard_sequences(cu, gpus, "workload", **mask)
    out = []
    for comm in comm_types:
        step = 0.0
        for group, count in zip(groups, holders, strict=True):
            step += max(sum(sub_sample_s(lengths[s], count[s], comm) for s in per_rank) for per_rank in group)
        wl = predict(inspect_plan(full, comm, **mask, **shapes), profile).total_s
        out.append(HybridComparison(comm_type=comm, gpus=gpus, hybrid_ms=step * 1e3, workload_ms=wl * 1e3,
                                    groups=len(groups), cp_sizes=dict(sorted(sizes.items()))))  # fmt: skip
    return out

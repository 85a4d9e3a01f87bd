"""Context parallelism for attention on packed variable-length sequences.

Public API (design §1): :func:`shard_sequences` -> :class:`CPSharding` (shard/unshard, plan
cache), :func:`cp_attention` for the ``p2p``, ``all_gather``, ``a2a`` and ``a2a+p2p`` comm
types over thd, bshd and sbhd layouts, :func:`plan_cp_attention` (its host side done ahead,
for ``torch.compile(fullgraph=True)``), and :func:`inspect_plan`, the exact account of a plan.
Bad input raises :class:`CPArgumentError` (a ``ValueError``), the same on every CP rank
(``docs/reliability.md``).
"""

from . import planner  # planner: installs comm_type="auto"'s chooser
from .attention import COMM_TYPES, QKV_FORMATS, cp_attention
from .inspect import CallReport, PlanReport, RankReport, inspect_plan
from .masks import MaskSpec
from .masks.names import mask_flags as mask_flags
from .prepared import PreparedCPAttention, plan_cp_attention
from .runtime.groups import HierarchicalCPGroups, hierarchical_cp_groups
from .runtime.validation import CPArgumentError, CPArgumentTypeError, CPRankMismatchError
from .sharding import BALANCES, CPSharding, Segment, batches, rank_counts, shard_sequences
from .sharding.te_layout import te_thd_sharding

__all__ = [
    "cp_attention",
    "plan_cp_attention",
    "PreparedCPAttention",
    "inspect_plan",
    "PlanReport",
    "RankReport",
    "CallReport",
    "hierarchical_cp_groups",
    "HierarchicalCPGroups",
    "CPArgumentError",
    "CPArgumentTypeError",
    "CPRankMismatchError",
    "shard_sequences",
    "te_thd_sharding",
    "rank_counts",
    "CPSharding",
    "Segment",
    "MaskSpec",
    "COMM_TYPES",
    "QKV_FORMATS",
    "BALANCES",
    "batches",
    "planner",
]
__version__ = "0.1.0"

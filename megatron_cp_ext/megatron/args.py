"""Command-line options for Megatron training scripts (plain ``argparse``; no megatron-core needed).

:func:`add_arguments` adds only what Megatron lacks and fits Megatron-LM's
``parse_args(extra_args_provider=add_arguments)``; the CP size, comm type(s), hierarchical
sizes and window come from Megatron's own ``--context-parallel-size``, ``--cp-comm-type``,
``--hierarchical-context-parallel-sizes`` and ``--window-size``. Scripts built on
megatron-core alone (no Megatron-LM ``megatron.training``) get those four from
:func:`add_megatron_cp_arguments`, with Megatron-LM's names and meanings.
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = [
    "add_arguments",
    "add_megatron_cp_arguments",
    "check_cp_args",
    "cp_attention_options_from_args",
    "cp_comm_type_from_args",
    "parse_window",
]

_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")
_BALANCES = ("workload", "dualchunk", "contiguous", "te")  # megatron.batch.LAYOUTS (no torch import here)
_BACKENDS = ("auto", "reference", "flash")


def _positive_int(text: str) -> int:
    """argparse type: an int >= 1 (argparse names the flag in its error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {value}")
    return value


def check_cp_args(args: argparse.Namespace) -> str | None:
    """What is wrong across CP flags (None if nothing): argparse checks each flag alone.
    Scripts pass the result to ``parser.error`` before initialising anything."""
    sizes = getattr(args, "hierarchical_context_parallel_sizes", None)
    cp = getattr(args, "context_parallel_size", 1)
    if sizes and (len(sizes) != 2 or sizes[0] * sizes[1] != cp):
        return (
            f"--hierarchical-context-parallel-sizes must be two sizes [a2a, p2p] with product {cp} "
            f"(--context-parallel-size), got {sizes}"
        )
    kinds = list(getattr(args, "cp_comm_type", None) or [])
    if "a2a+p2p" in kinds and cp > 1 and not sizes:
        return "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes A2A P2P"
    return None


def _has_option(parser: argparse.ArgumentParser, flag: str) -> bool:
    return flag in parser._option_string_actions  # noqa: SLF001 - argparse has no public query


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add megatron_cp_ext's own options; returns ``parser`` (Megatron's extra-args convention)."""
    group = parser.add_argument_group("context parallelism (megatron_cp_ext)")
    group.add_argument(
        "--cp-load-balance",
        choices=_BALANCES,
        default="te",
        help="how packed (THD) batches were split across CP ranks when their packed_seq_params carry no "
        "megatron_cp_ext sharding: te (default; Megatron's own THD split, TransformerEngine's "
        "thd_get_partitioned_indices per document; always used with cu_seqlens_q_padded), or the balance a "
        "pipeline passed to megatron_cp_ext.shard_sequences (workload, dualchunk, contiguous): then packed_seq_params "
        "without a sharding are refused, since cu_seqlens cannot say how the data was split; batches split by "
        "shard_batch_for_cp, or params from make_packed_seq_params(cu, cp_group=..., sharding=...), carry their split",
    )
    group.add_argument(
        "--cp-attention-backend",
        choices=_BACKENDS,
        default="auto",
        help="local attention kernels: auto (flash on CUDA, exact reference on CPU), reference, flash",
    )
    group.add_argument(
        "--cp-attention-chunk-size",
        type=_positive_int,
        default=None,
        help="chunked attention: tokens attend only within aligned chunks of this many positions",
    )
    group.add_argument(
        "--cp-attention-check",
        action="store_true",
        help="compare every attention call's arguments across CP ranks (one small all-gather and a host "
        "sync per layer call): rank-local drift raises on every rank instead of hanging; off by default, "
        "see docs/reliability.md",
    )
    return parser


def parse_window(text: str) -> tuple[int, int]:
    """``"LEFT,RIGHT"`` -> ``(left, right)``; -1 means unbounded (Megatron's convention)."""
    parts = text.replace("(", "").replace(")", "").split(",")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"window size must be LEFT,RIGHT (e.g. 128,0), got {text!r}")
    return int(parts[0]), int(parts[1])


def add_megatron_cp_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM's CP flags for scripts without ``megatron.training`` (skips ones already present)."""
    group = parser.add_argument_group("context parallelism (Megatron-LM flags)")
    if not _has_option(parser, "--context-parallel-size"):
        group.add_argument(
            "--context-parallel-size", type=_positive_int, default=1, help="degree of context parallelism"
        )
    if not _has_option(parser, "--cp-comm-type"):
        group.add_argument(
            "--cp-comm-type",
            nargs="+",
            choices=(*_COMM_TYPES, "auto"),
            default=["p2p"],
            help="one comm type for all layers, or one per layer (auto: predicted fastest per micro-batch)",
        )
    if not _has_option(parser, "--hierarchical-context-parallel-sizes"):
        group.add_argument(
            "--hierarchical-context-parallel-sizes",
            nargs="+",
            type=_positive_int,
            default=None,
            help="[a2a, p2p] group sizes for cp_comm_type a2a+p2p (product = CP size)",
        )
    if not _has_option(parser, "--window-size"):
        group.add_argument(
            "--window-size", type=parse_window, default=None, help="sliding window LEFT,RIGHT (-1 = unbounded)"
        )
    return parser


def cp_comm_type_from_args(args: argparse.Namespace) -> str | list[str]:
    """Megatron-LM's rule: one value applies to all layers, several are per layer."""
    values = list(args.cp_comm_type)
    return values[0] if len(values) == 1 else values


def cp_attention_options_from_args(args: argparse.Namespace) -> Any:
    """A :class:`~.core_attention.CPAttentionOptions` from parsed arguments (needs megatron-core)."""
    from .core_attention import CPAttentionOptions

    return CPAttentionOptions(
        load_balance=getattr(args, "cp_load_balance", "te"),
        backend=getattr(args, "cp_attention_backend", "auto"),
        chunk_size=getattr(args, "cp_attention_chunk_size", None),
        check=getattr(args, "cp_attention_check", False),
    )

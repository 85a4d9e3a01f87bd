"""One row of ``mcx-plan``: a planned configuration's counts and predicted times.

Its own module so that the sweep (:mod:`.cli`) and the plots (:mod:`.plot`) both read it
without importing each other."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Row"]


@dataclass(frozen=True, kw_only=True)
class Row:
    """One planned configuration (what the table and ``--json`` show)."""

    cp: int
    """CP size."""
    comm_type: str
    """Comm type."""
    balance: str
    """Sharding balance."""
    a2a_size: int
    """Ranks per a2a group (a2a+p2p; cp for a2a; 1 otherwise)."""
    max_work: int
    """Largest per-rank work (visible pairs per head)."""
    mean_work: float
    """Mean per-rank work."""
    tile_efficiency: float
    """Useful score entries over visited 128x128 tile area."""
    padding: int
    """Largest per-rank pad rows."""
    fwd_bytes: int
    """Largest per-rank forward bytes (max of sent and received)."""
    bwd_bytes: int
    """Largest per-rank backward bytes (max of sent and received)."""
    calls: int
    """Largest per-rank varlen calls per layer (forward; backward runs as many)."""
    fwd_ms: float
    """Predicted forward time per layer (slowest rank)."""
    bwd_ms: float
    """Predicted backward time per layer (slowest rank)."""
    fwd_hidden: bool
    """Comm hides behind compute in forward."""
    bwd_hidden: bool
    """Comm hides behind compute in backward."""
    work: list[int]
    """Per-rank work (for plots)."""
    sent: list[int]
    """Per-rank forward bytes sent (for plots)."""
    tokens: list[int]
    """Per-rank tokens (a layer's linear work follows them)."""
    token_imbalance: float
    """Largest per-rank token count over the mean."""
    layer_ms: float | None = None
    """Predicted whole-layer forward + backward time (slowest rank: attention plus linear work
    on its tokens); None without the model's widths."""

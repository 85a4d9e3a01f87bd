"""``mcx-plan --plot``: per-rank work and forward traffic of every planned strategy.

matplotlib is an optional extra (``pip install megatron_cp_ext[plot]``); the rest of the
planner does not need it.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .rows import Row

__all__ = ["check_matplotlib", "plot_rows"]


def check_matplotlib() -> str | None:
    """None when matplotlib can be imported, else what to install."""
    if importlib.util.find_spec("matplotlib") is None:
        return "needs matplotlib (pip install matplotlib, or the package's [plot] extra)"
    return None


SPREAD = 0.1
"""The work panel shows at least max/mean 1 ± this: a spread of a fraction of a percent stays flat."""


def plot_rows(rows: list[Row], path: str, title: str = "") -> list[tuple[tuple[float, float], tuple[float, float]]]:
    """Two panels per CP size: work per rank as a multiple of the mean (top; the axis spans at
    least 1 ± :data:`SPREAD`, so the drawn spread is the real one) and forward bytes sent per
    rank (bottom, from 0), one line per comm type x balance, labelled with the predicted time.
    Returns each CP size's (top, bottom) y limits."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cps = sorted({r.cp for r in rows})
    fig, axes = plt.subplots(2, len(cps), figsize=(6.5 * len(cps), 7), squeeze=False)
    limits = []
    for j, cp in enumerate(cps):
        top, bottom = axes[0][j], axes[1][j]
        lo, hi = 1 - SPREAD, 1 + SPREAD
        for r in (x for x in rows if x.cp == cp):
            name = r.comm_type + (f"({r.a2a_size})" if r.comm_type == "a2a+p2p" else "")
            label = f"{name} {r.balance}: {r.fwd_ms + r.bwd_ms:.2f} ms"
            ranks = range(len(r.work))
            rel = [w / max(r.mean_work, 1e-30) for w in r.work]
            lo, hi = min(lo, *rel), max(hi, *rel)
            top.plot(ranks, rel, marker=".", label=label)
            bottom.plot(ranks, [b / 2**20 for b in r.sent], marker=".", label=label)
        pad = 0.05 * (hi - lo)
        top.set_ylim(lo - pad, hi + pad)
        top.axhline(1.0, color="grey", linewidth=0.8)
        bottom.set_ylim(bottom=0)
        limits.append((top.get_ylim(), bottom.get_ylim()))
        top.set_title(f"cp {cp}: work per rank (predicted fwd+bwd per layer)")
        top.set_ylabel("visible pairs ÷ the mean")
        bottom.set_title(f"cp {cp}: forward bytes sent per rank")
        bottom.set_ylabel("MiB per layer")
        bottom.set_xlabel("CP rank")
        top.legend(fontsize=7)
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return limits

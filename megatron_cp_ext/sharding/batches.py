"""Named synthetic document-length mixes (benchmarks, planning): seeded and deterministic.

* ``lognormal`` — long-tail lengths, median ``median`` tokens, log-std ``sigma``, drawn until
  the batch holds ``total`` tokens (the last document is cut to fit);
* ``uniform`` — lengths uniform in ``[1, 2 * median]``, same filling rule;
* ``long_short`` — one document of ``long`` tokens plus ``count`` short ones whose lengths
  (lognormal around ``short_median``) are rescaled to fill ``total`` exactly.
"""

from __future__ import annotations

import numpy as np

__all__ = ["lognormal", "uniform", "long_short", "cu_seqlens", "DISTRIBUTIONS"]


def _fill(draw, total: int) -> list[int]:
    out, left = [], total
    while left > 0:
        n = max(1, min(int(draw()), left))
        out.append(n)
        left -= n
    return out


def lognormal(total: int, *, median: int = 2048, sigma: float = 1.0, seed: int = 0) -> list[int]:
    """Long-tail lengths filling ``total`` tokens."""
    rng = np.random.default_rng(seed)
    return _fill(lambda: round(rng.lognormal(np.log(median), sigma)), total)


def uniform(total: int, *, median: int = 2048, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return _fill(lambda: rng.integers(1, 2 * median + 1), total)


def long_short(total: int, *, long: int = 65536, count: int = 157, short_median: int = 400, seed: int = 0) -> list[int]:
    """One ``long`` document and ``count`` short ones, ``total`` tokens in all."""
    if total < long + count:
        raise ValueError(f"total ({total}) must hold the long document ({long}) and {count} short ones")
    rng = np.random.default_rng(seed)
    raw = rng.lognormal(np.log(short_median), 0.6, size=count)
    short = np.maximum(1, np.floor(raw * (total - long) / raw.sum())).astype(int)
    over = int(short.sum()) - (total - long)  # documents raised to one token overshoot: the longest pay
    if over > 0:
        short[np.argsort(-short, kind="stable")[:over]] -= 1
    short[: (total - long) - int(short.sum())] += 1  # distribute the rounding remainder
    lens = [long, *short.tolist()]
    order = rng.permutation(len(lens))
    return [lens[i] for i in order]


DISTRIBUTIONS = {"lognormal": lognormal, "uniform": uniform, "long_short": long_short}


def cu_seqlens(lens: list[int]) -> list[int]:
    """Prefix sums (the ``cu_seqlens`` a data loader hands over)."""
    return [0, *np.cumsum(lens).tolist()]

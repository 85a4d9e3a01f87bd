"""Which (comm type, format, feature) combinations the multi-rank tests actually verified.

Every check against the dense reference records what it covered; the L1 test session turns
the record into ``docs/support_matrix.md`` (``MCX_WRITE_SUPPORT_MATRIX=1``) or, after a full
passing L1 run, fails if the committed page claims anything the tests did not verify.
"""

from __future__ import annotations

COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")
FORMATS = ("thd", "bshd", "sbhd")
FEATURES = ("causal", "no mask", "sliding window", "chunked", "GQA/MQA", "MLA")

_SEEN: set[tuple[str, str, str]] = set()


def features_of(
    *, causal: bool, window_size=(-1, -1), chunk_size=None, hq: int, hkv: int, d: int, dv: int
) -> list[str]:
    """The matrix columns one verified case covers."""
    out = ["causal" if causal else "no mask"]
    if tuple(window_size) != (-1, -1):
        out.append("sliding window")
    if chunk_size is not None:
        out.append("chunked")
    if hkv < hq:
        out.append("GQA/MQA")
    if dv != d:
        out.append("MLA")
    return out


def record(comm_type: str, qkv_format: str, features: list[str]) -> None:
    for f in features:
        _SEEN.add((comm_type, qkv_format, f))


def seen() -> set[tuple[str, str, str]]:
    return set(_SEEN)


REFUSED: tuple[tuple[str, str, str], ...] = ()
"""``(comm type, format, mask)`` refused by design (none): written under "Refused by design"."""


def render(cells: set[tuple[str, str, str]]) -> str:
    """The support-matrix page for ``cells``."""
    lines = [
        "# Support matrix",
        "",
        "Generated from the multi-rank tests (`tests/L1`): a ✓ means a test compared output and",
        "dq/dk/dv with the dense fp64 reference for that comm type, format and feature, on 2 and/or",
        "4 gloo ranks. Regenerate with `MCX_WRITE_SUPPORT_MATRIX=1 python -m pytest tests/L1`; a full",
        "L1 run fails if this page claims a cell the tests did not verify. The CPU runs use the exact",
        "reference backend; the GPU backend (flash-attn / PyTorch varlen flash) runs the same plans",
        "and is compared call by call with the reference in `tests/gpu` (needs CUDA).",
        "",
        "| comm type | format | " + " | ".join(FEATURES) + " |",
        "|---|---|" + "---|" * len(FEATURES),
    ]
    for comm in COMM_TYPES:
        for fmt in FORMATS:
            marks = ["✓" if (comm, fmt, f) in cells else "—" for f in FEATURES]
            lines.append(f"| {comm} | {fmt} | " + " | ".join(marks) + " |")
    lines += ["", "## Refused by design", "",
              "Combinations a test may see refused (`tests/L1/test_masks.py` reads this table: any other",
              "refusal fails the test, and a listed one must refuse):", "",
              "| comm type | format | mask |", "|---|---|---|",
              *(f"| {c} | {f} | {m} |" for c, f, m in REFUSED), "",
              "None today: every comm type runs every format and mask above." if not REFUSED else ""]  # fmt: skip
    return "\n".join(lines).rstrip("\n") + "\n"


def parse(page: str) -> set[tuple[str, str, str]]:
    """The ✓ cells a rendered page claims."""
    cells = set()
    for line in page.splitlines():
        parts = [p.strip() for p in line.strip().strip("|").split("|")]
        if len(parts) == 2 + len(FEATURES) and parts[0] in COMM_TYPES:
            cells |= {(parts[0], parts[1], f) for f, m in zip(FEATURES, parts[2:]) if m == "✓"}
    return cells

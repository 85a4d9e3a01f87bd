"""Hardware profiles for the cost model: kernel throughput, launch overhead and link speeds.

The named GPU profiles are derived from datasheets: dense bf16 tensor-core peak times a
flash-attention efficiency (about half of peak forward, less backward) and a large-GEMM
efficiency (about two thirds of peak) for a layer's linear work, NVLink bandwidth per
direction inside a node and one InfiniBand NIC per GPU across nodes. When
``planner/calibration.json`` (written by ``benchmarks/kernel_throughput.py`` on a GPU) holds an
entry for a profile, its kernel constants are the measured ones. ``cpu-gloo`` is the profile
the gloo validation benchmark calibrates with a microbenchmark in the same run. A user file
(JSON or TOML) with the same keys overrides a named profile (``base``) or defines one from
scratch.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

import tomllib

__all__ = ["HardwareProfile", "PROFILES", "KERNELS", "load_profile"]

KERNELS = ("flash", "reference")


@dataclass(frozen=True, kw_only=True)
class HardwareProfile:
    """What one rank's attention kernels and links sustain."""

    name: str
    """Profile name (shown in tables)."""
    fwd_tflops: float
    """Sustained forward attention throughput, TFLOP/s per rank, over visited tile area."""
    bwd_tflops: float
    """Sustained backward attention throughput, TFLOP/s per rank."""
    launch_us: float
    """Fixed cost of one varlen kernel call (launch, host work), microseconds."""
    intra_gbps: float
    """Per-direction bandwidth between two ranks of one node, GB/s (NVLink)."""
    inter_gbps: float
    """Per-direction bandwidth of one rank to another node, GB/s (its share of the NICs)."""
    latency_us: float
    """Fixed cost of one message or collective, microseconds."""
    ranks_per_node: int
    """CP ranks per node: consecutive CP ranks share a node (divide GPUs per node by TP)."""
    description: str = ""
    """Where the numbers come from."""
    gemm_tflops: float | None = None
    """Sustained dense matmul throughput, TFLOP/s per rank, for a layer's linear work (QKV and
    output projections, MLP); None: the attention forward throughput."""
    kernel: str = "flash"
    """What a call's compute is priced by: ``"flash"``, the 128x128 tiles it visits;
    ``"reference"``, the padded rectangles the CPU reference backend materialises (masked
    entries included; ``backends.reference.visited_area``)."""

    def __post_init__(self) -> None:
        for f in ("fwd_tflops", "bwd_tflops", "intra_gbps", "inter_gbps"):
            if not getattr(self, f) > 0:
                raise ValueError(f"profile {self.name!r}: {f} must be > 0, got {getattr(self, f)!r}")
        if self.gemm_tflops is not None and not self.gemm_tflops > 0:
            raise ValueError(f"profile {self.name!r}: gemm_tflops must be > 0, got {self.gemm_tflops!r}")
        for f in ("launch_us", "latency_us"):
            if not getattr(self, f) >= 0:
                raise ValueError(f"profile {self.name!r}: {f} must be >= 0, got {getattr(self, f)!r}")
        if self.kernel not in KERNELS:
            raise ValueError(f"profile {self.name!r}: kernel must be one of {KERNELS}, got {self.kernel!r}")
        rpn = self.ranks_per_node
        if isinstance(rpn, bool) or not isinstance(rpn, int) or rpn < 1:
            raise ValueError(f"profile {self.name!r}: ranks_per_node must be a positive int, got {rpn!r}")


_DATASHEET = "datasheet-derived, not calibrated on a GPU"
PROFILES: dict[str, HardwareProfile] = {
    p.name: p
    for p in (
        HardwareProfile(
            name="h100-nvlink-ib400", fwd_tflops=500.0, bwd_tflops=400.0, gemm_tflops=660.0, launch_us=8.0,
            intra_gbps=450.0,
            inter_gbps=50.0, latency_us=10.0, ranks_per_node=8,
            description=f"H100 SXM (989 TFLOP/s dense bf16), NVLink4 450 GB/s, 400 Gb/s IB per GPU; {_DATASHEET}",
        ),
        HardwareProfile(
            name="h200-nvlink-ib400", fwd_tflops=540.0, bwd_tflops=430.0, gemm_tflops=700.0, launch_us=8.0,
            intra_gbps=450.0,
            inter_gbps=50.0, latency_us=10.0, ranks_per_node=8,
            description=f"H200 SXM (H100 compute, faster HBM), NVLink4, 400 Gb/s IB per GPU; {_DATASHEET}",
        ),
        HardwareProfile(
            name="a100-nvlink-ib200", fwd_tflops=190.0, bwd_tflops=150.0, gemm_tflops=210.0, launch_us=8.0,
            intra_gbps=300.0,
            inter_gbps=25.0, latency_us=10.0, ranks_per_node=8,
            description=f"A100 SXM (312 TFLOP/s dense bf16), NVLink3 300 GB/s, 200 Gb/s IB per GPU; {_DATASHEET}",
        ),
        HardwareProfile(
            name="cpu-gloo", fwd_tflops=0.01, bwd_tflops=0.006, launch_us=150.0, intra_gbps=1.0,
            inter_gbps=1.0, latency_us=100.0, ranks_per_node=1 << 20, kernel="reference",
            description="one CPU thread per rank over gloo on one host; rough defaults, calibrate per machine",
        ),
    )
}  # fmt: skip
CALIBRATION = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calibration.json")
"""Measured kernel constants per named profile, written by ``benchmarks/kernel_throughput.py``
on a GPU (``{"h100-nvlink-ib400": {"fwd_tflops": ..., "bwd_tflops": ..., "launch_us": ...,
"source": "..."}}``). When it holds an entry for a named profile, that profile's kernel
constants are the measured ones; its links stay datasheet values."""


def _calibrated(profiles: dict[str, HardwareProfile], path: str = CALIBRATION) -> dict[str, HardwareProfile]:
    if not os.path.isfile(path):
        return profiles
    data = _read(path)
    out = dict(profiles)
    for name, entry in data.items():
        if name not in profiles:
            raise ValueError(f"calibration file {path}: unknown profile {name!r} (known: {', '.join(profiles)})")
        fields = {k: float(entry[k]) for k in ("fwd_tflops", "bwd_tflops", "launch_us") if k in entry}
        source = entry.get("source", "measured")
        desc = profiles[name].description.replace(_DATASHEET, f"links {_DATASHEET}; kernels measured: {source}")
        out[name] = dataclasses.replace(profiles[name], **fields, description=desc)
    return out


def _read(path: str) -> dict:
    with open(path, "rb") as f:
        data = f.read()
    if path.endswith(".toml"):
        return tomllib.loads(data.decode())
    return json.loads(data)


def load_profile(spec: str | HardwareProfile, **overrides) -> HardwareProfile:
    """A named profile, a JSON/TOML file path, or a profile; ``overrides`` replace fields.

    A file holds the fields of :class:`HardwareProfile`; ``"base": NAME`` starts from a named
    profile so a file can change only what differs (e.g. ``ranks_per_node`` under TP 2).
    """
    if isinstance(spec, HardwareProfile):
        prof = spec
    elif spec in PROFILES:
        prof = PROFILES[spec]
    elif isinstance(spec, str) and os.path.isfile(spec):
        data = _read(spec)
        if not isinstance(data, dict):
            raise ValueError(f"profile file {spec}: expected a table of fields, got {type(data).__name__}")
        base = data.pop("base", None)
        if base is not None and base not in PROFILES:
            raise ValueError(f"profile file {spec}: unknown base {base!r} (known: {', '.join(PROFILES)})")
        known = {f.name for f in dataclasses.fields(HardwareProfile)}
        bad = sorted(set(data) - known)
        if bad:
            raise ValueError(f"profile file {spec}: unknown fields {bad} (known: {sorted(known)})")
        data.setdefault("name", os.path.basename(spec))
        try:
            prof = dataclasses.replace(PROFILES[base], **data) if base else HardwareProfile(**data)
        except TypeError as err:
            raise ValueError(f"profile file {spec}: {err}") from None
    else:
        raise ValueError(f"unknown profile {spec!r}: a name ({', '.join(PROFILES)}) or a JSON/TOML file")
    return dataclasses.replace(prof, **overrides) if overrides else prof


PROFILES.update(_calibrated(PROFILES))
PROFILES["h100"], PROFILES["h200"], PROFILES["a100"] = (
    PROFILES["h100-nvlink-ib400"],
    PROFILES["h200-nvlink-ib400"],
    PROFILES["a100-nvlink-ib200"],
)

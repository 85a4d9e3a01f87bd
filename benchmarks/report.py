"""``DIR/<device>.md``: the device report ``gpu_suite.py`` writes from its steps' ``RESULT``
lines, in the shape of ``benchmarks/results/TEMPLATE.md`` (copy a GPU run's report next to it
as ``benchmarks/results/<device>.md``)."""

from __future__ import annotations

import json
import re
from pathlib import Path

GOALS = {"copy_ratio": 0.8, "cp_causal": 1.10, "cp1": 1.03, "alloc_gap": 1.10}
PEAK_GOALS = {"p2p": (2.0, 2.5), "a2a": (2.0, 2.5), "all_gather": (2.5, 3.0)}
"""Per-rank peak ÷ ideal, forward and backward, by comm type (the CP-overhead issue's goals)."""
"""Targets the report marks: kernels ≥ 0.8 of a copy, one-GPU CP ≤ 1.10 × one call (causal),
CP 1 through ``cp_attention`` ≤ 1.03 × the direct call."""


def device_file(name: str) -> str:
    """A file name from a device name: letters, digits, '.', '_' and '-' only."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") + ".md"


def _mark(ok: bool) -> str:
    return "yes" if ok else "**no**"


def _table(head: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return out + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]


def render(statuses: list[dict], rows: list[dict], dry: bool, total_s: float) -> tuple[str, str]:
    env = next((r for r in rows if r["step"] == "env"), {"device": "unknown", "kernels": {}})
    by = {s: [r for r in rows if r["step"] == s] for s in ("kernels", "attention", "cp", "calibration")}
    lines = [f"# {env['device']}", ""]
    if dry:
        lines += ["Dry run on the CPU with tiny sizes: the figures check the plumbing, not a GPU.", ""]
    lines += [f"torch {env.get('torch')}, CUDA {env.get('cuda')}; suite took {total_s:.0f} s.", "", "## Steps", ""]
    lines += _table(["step", "status", "seconds", "log"],
                    [[s["step"], s["status"], f"{s['seconds']:.1f}", s["log"]] for s in statuses])  # fmt: skip
    lines += ["", "Local kernels: " + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in env["kernels"].items())]
    lines += ["", "## Row kernels (GB/s, ratio to a device-to-device copy of the same bytes; goal ≥ 0.8)", ""]
    lines += _table(["op", "csrc GB/s", "fallback GB/s", "copy GB/s", "csrc / copy", "fallback / copy", "goal met"], [
        [r["op"], f"{r['csrc_gbs']:.3g}", f"{r['fallback_gbs']:.3g}", f"{r['copy_gbs']:.3g}", f"{r['csrc_ratio']:.2f}",
         f"{r['fallback_ratio']:.2f}", _mark(r["csrc"] and r["csrc_ratio"] >= GOALS["copy_ratio"])]
        for r in by["kernels"]
    ])  # fmt: skip
    lines += ["", "## Local attention (THD, useful FLOPs over time: fwd 4·pairs·H·D, bwd 2.5× that)", ""]
    lines += _table(["kernel", "mask", "tokens", "fwd ms", "bwd ms", "fwd TFLOP/s", "bwd TFLOP/s"], [
        [r["kernel"], r["mask"], r.get("tokens", "-"), f"{r['fwd_ms']:.2f}", f"{r['bwd_ms']:.2f}",
         f"{r['fwd_tflops']:.4g}", f"{r['bwd_tflops']:.4g}"] for r in by["attention"]
    ])  # fmt: skip
    for r in (r for r in rows if r["step"] == "pick"):
        picks = sorted({(x["mask"], x["measured_tokens"], x["kernel"]) for x in r["entry"]["rules"]})
        lines += ["", "Fastest candidate (fwd+bwd) per mask and size: "
                  + (", ".join(f"{m} @ {t}: {k}" for m, t, k in picks) or "-")]  # fmt: skip
        lines += ["", "Kernel pick table entry (commit into `megatron_cp_ext/backends/kernel_table.json`, "
                  "under `devices`; `docs/kernels.md`):", "", "```json",
                  json.dumps({r["device_class"]: r["entry"]}, indent=2, sort_keys=True), "```"]  # fmt: skip
    lines += ["", "## One-GPU CP (fwd+bwd of all ranks ÷ one call over the whole batch) and memory", ""]
    cp_rows = []
    for r in by["cp"]:
        goal = GOALS["cp1"] if r["cp"] == 1 else GOALS["cp_causal"] if r["mask"] == "causal" else None
        mib = r.get("peak_mib", float("nan"))
        peak = "-" if mib != mib else f"{mib:.0f} ({r['peak_ratio']:.2f}× ideal)"  # nan: not measured (CPU)
        cp_rows.append([r["comm"], r["mask"], r["cp"], f"{r['ms']:.2f}", f"{r['ratio']:.3f}",
                        "-" if goal is None else _mark(r["ratio"] <= goal), peak])  # fmt: skip
    lines += _table(["comm", "mask", "CP", "ms", "÷ one call", "goal met", "peak MiB per rank"], cp_rows)
    lines += ["", "## Memory per rank (worst rank; allocator trace of the rank's stream vs the accounting)", ""]
    mem_rows = []
    for r in (r for r in rows if r["step"] == "memory"):
        goal = PEAK_GOALS.get(r["comm"])
        met = (
            "-"
            if goal is None or r["fwd_alloc"] != r["fwd_alloc"]
            else _mark(r["fwd_alloc"] <= goal[0] and r["bwd_alloc"] <= goal[1])
        )
        gap = "-" if r["gap"] != r["gap"] else f"{r['gap']:.3f} {_mark(r['gap'] <= GOALS['alloc_gap'])}"
        mem_rows.append([r["comm"], r["cp"], f"{r['fwd_alloc']:.2f}", f"{r['fwd_acc']:.2f}", f"{r['bwd_alloc']:.2f}",
                         f"{r['bwd_acc']:.2f}", met, gap])  # fmt: skip
    lines += _table(["comm", "CP", "fwd ÷ ideal", "fwd accounting", "bwd ÷ ideal", "bwd accounting", "goal met",
                     "allocator ÷ accounting"], mem_rows)  # fmt: skip
    lines += ["", "## Overlap of one p2p layer (CP 4 on one GPU, `tests/gpu/test_p2p_trace.py`)", ""]
    lines += _table(["compute kernels", "transfers", "compute µs", "transfer µs", "overlap µs", "overlap ÷ transfer"], [
        [r["compute_kernels"], r["transfers"], f"{r['compute_us']:.0f}", f"{r['transfer_us']:.0f}",
         f"{r['overlap_us']:.0f}", f"{r['overlap_us'] / r['transfer_us']:.2f}" if r["transfer_us"] else "-"]
        for r in rows if r["step"] == "overlap"
    ])  # fmt: skip
    lines += ["", "## Cost-model calibration (`megatron_cp_ext/planner/calibration.json`)", ""]
    lines += _table(["profile", "fwd TFLOP/s", "bwd TFLOP/s", "launch µs", "source"], [
        [r["profile"], r["fwd_tflops"], r["bwd_tflops"], r["launch_us"], r["source"]] for r in by["calibration"]
    ])  # fmt: skip
    return device_file(env["device"]), "\n".join(lines) + "\n"


def write(out: Path, statuses: list[dict], rows: list[dict], dry: bool, total_s: float) -> Path:
    name, text = render(statuses, rows, dry, total_s)
    path = out / name
    path.write_text(text)
    return path

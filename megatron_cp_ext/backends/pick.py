"""Which local kernel runs each varlen call: a table measured per device class, read on the host.

Every local call of a plan has a shape the host knows before anything runs (dtype, head dims,
GQA ratio, mask alignment, query rows, longest entry). :func:`pick` maps that shape, bucketed
(:class:`CallShape`), and the device class (``"H100"``, ``"A100"``, ``"cpu"``, ...:
:func:`device_class`) to one candidate kernel through ``kernel_table.json``: a pure function
of host values, so every rank of a homogeneous job picks the same kernel for the same call,
and a call's forward and backward run on the same kernel. Nothing is measured at run time.

The table holds, per device class, rules written by ``benchmarks/gpu_suite.py`` from its
measurements (``docs/gpu.md``); the first rule whose fields all match the call names the
preferred kernel. The preferred kernel, then the device's default order
(:data:`DEFAULT_ORDER`), are tried in turn; the first candidate that is available here and
can express the call runs it. With no rule for the device the default order is today's
choice: flash-attn when installed, else PyTorch's varlen flash on CUDA; the reference on CPU.

Overrides: ``backend="reference"``/``"flash"`` of ``cp_attention`` bypass the table;
``MCX_KERNEL=<candidate>`` tries that candidate first (still only where it can express the
call); ``MCX_KERNEL_TABLE=<path>`` reads another table.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import cudnn, fa4, flash, reference

__all__ = ["CallShape", "Kernel", "KERNELS", "DEFAULT_ORDER", "TABLE", "device_class", "device_class_of"]
__all__ += ["call_shape", "pick", "pick_why", "available_kernels", "Picker", "load_table", "ARCH"]

log = logging.getLogger("megatron_cp_ext.kernels")

TABLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernel_table.json")
"""Measured picks per device class (``{"devices": {"H100": {"source": ..., "rules": [...]}}}``)."""

_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64"}


@dataclass(frozen=True, kw_only=True)
class CallShape:
    """The host-known shape of one local call, bucketed: what a pick may depend on."""

    dtype: str
    """``fp16`` | ``bf16`` | ``fp32`` | ``fp64``."""
    d: int
    """Query/key head dim."""
    dv: int
    """Value head dim (``!= d`` for MLA)."""
    mask: str
    """``causal`` | ``none`` | ``window`` (any finite side). Chunked masks reach the kernels as
    causal or unmasked entries, so a call never carries a chunk."""
    gqa: int
    """Query heads per KV head (1: MHA)."""
    tokens: int
    """Query rows of the call, rounded down to a power of two."""
    max_seqlen: int
    """Longest key entry of the call, rounded down to a power of two."""


def _pow2(n: int) -> int:
    return 1 << (max(int(n), 1).bit_length() - 1)


def call_shape(q, k, v, max_seqlen_k: int, causal: bool, window: tuple[int, int]) -> CallShape:
    """The bucketed shape of a call (reads shapes and host ints only: no device sync)."""
    left, right = window
    mask = "window" if left >= 0 or right > 0 else "causal" if causal or right == 0 else "none"
    return CallShape(
        dtype=_DTYPES.get(q.dtype, str(q.dtype)), d=q.shape[-1], dv=v.shape[-1], mask=mask,
        gqa=q.shape[1] // max(k.shape[1], 1), tokens=_pow2(q.shape[0]), max_seqlen=_pow2(max_seqlen_k),
    )  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class Kernel:
    """One candidate under the backend contract (:mod:`.reference`)."""

    name: str
    """Table name of the candidate."""
    fwd: Callable
    bwd: Callable
    available: Callable[[torch.device], bool]
    """Whether it runs here (importable, right device)."""
    supports: Callable[[CallShape], bool]
    """Whether it expresses a call of this shape exactly (host values only)."""


def _half(s: CallShape) -> bool:
    return s.dtype in ("fp16", "bf16")


def _flash_ok(s: CallShape) -> bool:
    return _half(s) and s.dv <= s.d <= flash.MAX_HEAD_DIM and s.d % 8 == 0


def _cudnn_ok(s: CallShape) -> bool:
    """cuDNN through cudnn-frontend: fp16/bf16, head dims multiples of 8 up to 256, every mask."""
    return s.dtype in ("fp16", "bf16") and s.d % 8 == 0 and s.dv % 8 == 0 and max(s.d, s.dv) <= cudnn.MAX_HEAD_DIM


def _fa4_ok(s: CallShape) -> bool:
    """FlashAttention-4: fp16/bf16, head dims multiples of 8 up to 256, every mask; on Hopper
    GQA/MQA only with ``d == dv`` (:func:`.fa4.supports`)."""
    return s.dtype in ("fp16", "bf16") and fa4.supports(torch.bfloat16, s.d, s.dv, s.gqa)


def _cuda(device: torch.device) -> bool:
    return device.type == "cuda"


KERNELS: dict[str, Kernel] = {
    k.name: k
    for k in (
        Kernel(name="flash_attn", fwd=flash.fa_fwd, bwd=flash.fa_bwd, supports=_flash_ok,
               available=lambda dev: _cuda(dev) and flash.HAS_FLASH_ATTN),
        Kernel(name="aten_flash", fwd=flash.aten_fwd, bwd=flash.aten_bwd, supports=_flash_ok,
               available=lambda dev: _cuda(dev) and hasattr(torch.ops.aten, "_flash_attention_forward")),
        Kernel(name="cudnn", fwd=cudnn.attn_fwd, bwd=cudnn.attn_bwd, supports=_cudnn_ok,
               available=lambda dev: _cuda(dev) and cudnn.available()),
        Kernel(name="fa4", fwd=fa4.attn_fwd, bwd=fa4.attn_bwd, supports=_fa4_ok,
               available=lambda dev: _cuda(dev) and fa4.available()),
        Kernel(name="reference", fwd=reference.attn_fwd, bwd=reference.attn_bwd, supports=lambda s: True,
               available=lambda dev: True),
    )
}  # fmt: skip
"""Every candidate, by table name."""

DEFAULT_ORDER = {"cpu": ("reference",), "cuda": ("flash_attn", "aten_flash")}
"""Per device type, the candidates tried after the table's choice (today's behaviour)."""

_NAMED = ("GB200", "B200", "GH200", "H200", "H100", "H800", "H20", "A100", "A800", "L40S", "L40", "L4", "A10")


def device_class_of(name: str, capability: tuple[int, int]) -> str:
    """A device class from a CUDA device name and capability: a known product tag among the
    name's words (``"NVIDIA H100 80GB HBM3"``, ``"NVIDIA A100-SXM4-80GB"``), else
    ``"sm<major><minor>"``."""
    words = set(re.split(r"[^A-Z0-9]+", name.upper()))
    return next((tag for tag in _NAMED if tag in words), f"sm{capability[0]}{capability[1]}")


@functools.cache
def _cuda_class(index: int) -> str:
    return device_class_of(torch.cuda.get_device_name(index), torch.cuda.get_device_capability(index))


def device_class(device: torch.device) -> str:
    """``"cpu"`` for every non-CUDA device, else :func:`device_class_of` (cached per device)."""
    if device.type != "cuda":
        return "cpu"
    return _cuda_class(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=8)
def _load(path: str, stamp: tuple[int, int]) -> dict:
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data.get("devices"), dict):
        raise ValueError(f"kernel table {path}: expected an object with 'devices'")
    for cls, entry in data["devices"].items():
        for rule in entry.get("rules", []):
            if rule.get("kernel") not in KERNELS:
                raise ValueError(f"kernel table {path}, device {cls}: unknown kernel {rule.get('kernel')!r}")
    return data


def load_table(path: str | None = None) -> dict:
    """The table at ``path`` (default ``$MCX_KERNEL_TABLE``, else :data:`TABLE`); empty if absent."""
    path = path or os.environ.get("MCX_KERNEL_TABLE") or TABLE
    if not os.path.isfile(path):
        return {"devices": {}}
    st = os.stat(path)
    return _load(path, (st.st_mtime_ns, st.st_size))


_RANGES = {"tokens": ("min_tokens", "max_tokens"), "max_seqlen": ("min_seqlen", "max_seqlen_below")}


def rule_matches(rule: dict, s: CallShape) -> bool:
    """Every field the rule names equals the call's (``dtype``, ``d``, ``dv``, ``mask``, ``gqa``);
    ``min_tokens <= tokens < max_tokens`` and ``min_seqlen <= max_seqlen < max_seqlen_below``."""
    for f in ("dtype", "d", "dv", "mask", "gqa"):
        if f in rule and rule[f] != getattr(s, f):
            return False
    for f, (lo, hi) in _RANGES.items():
        if getattr(s, f) < rule.get(lo, 0) or (hi in rule and getattr(s, f) >= rule[hi]):
            return False
    return True


ARCH = {"H100": "sm90", "H200": "sm90", "H800": "sm90", "GH200": "sm90", "H20": "sm90", "A100": "sm80",
        "A800": "sm80", "B200": "sm100", "GB200": "sm100", "L40S": "sm89", "L40": "sm89", "L4": "sm89",
        "A10": "sm86"}  # fmt: skip
"""Device classes of one GPU architecture (one SM design; an ``sm<xy>`` class is its own):
the kernels' ranking measured on one stands in where the other's table did not compare them."""


def _rule(entry: dict, s: CallShape) -> dict | None:
    return next((r for r in entry.get("rules", []) if rule_matches(r, s)), None)


def _compared(rule: dict) -> set[str]:
    """The candidates a rule's measurement timed (``compared``; a rule without it timed only
    its own kernel, as far as anyone can tell)."""
    return set(rule.get("compared", [rule["kernel"]]))


def _sibling(cls: str, s: CallShape, own: dict | None, table: dict) -> tuple[str, str] | None:
    """``(kernel, class)`` from a device class of the same architecture whose rule for this call
    timed the own rule's kernel and beat it with a candidate the own rule did not time (any
    pick where ``cls`` has no rule); the widest comparison first, then by class name."""
    arch = ARCH.get(cls, cls)
    found = []
    for other, entry in table.get("devices", {}).items():
        r = _rule(entry, s) if other != cls and ARCH.get(other, other) == arch else None
        if r is not None and (own is None or (r["kernel"] not in _compared(own) and own["kernel"] in _compared(r))):
            found.append((-len(_compared(r)), other, r["kernel"]))
    return (min(found)[2], min(found)[1]) if found else None


def pick(cls: str, s: CallShape, available: frozenset[str] | set[str], table: dict, first: str | None = None) -> str:
    """The candidate for a call of shape ``s`` on a device of class ``cls``: ``first`` (an
    override), the table's rule, then the default order — the first that is ``available`` and
    supports the call. When none qualifies, the first available of the default order (its own
    error then says why, as without a table)."""
    return pick_why(cls, s, available, table, first)[0]


def pick_why(cls: str, s: CallShape, available, table: dict, first: str | None = None) -> tuple[str, str]:
    """:func:`pick` and the reason, in words (what was preferred and why it was passed over)."""
    own = _rule(table.get("devices", {}).get(cls, {}), s)
    ruled = own["kernel"] if own is not None else None
    sib, sib_cls = _sibling(cls, s, own, table) or (None, None)
    default = DEFAULT_ORDER["cpu" if cls == "cpu" else "cuda"]
    skipped = []
    tries = ((first, "MCX_KERNEL"), (sib, f"table rule for {sib_cls}, same architecture as {cls}"),
             (ruled, f"table rule for {cls}"), *((n, "default order") for n in default))  # fmt: skip
    for name, why in tries:
        if name is None:
            continue
        if name in available and KERNELS[name].supports(s):
            return name, why + "".join(f"; {x}" for x in skipped)
        skipped.append(f"{name} ({why}) {'cannot express the call' if name in available else 'not available'}")
    name = next((n for n in default if n in available), default[-1])
    return name, "no candidate expresses the call; " + "; ".join(skipped)


def available_kernels(device: torch.device) -> frozenset[str]:
    return frozenset(n for n, k in KERNELS.items() if k.available(device))


class Picker:
    """``backend="auto"``: the backend contract, dispatching every call to :func:`pick`'s
    kernel (memoised per bucketed shape: a dict lookup per call)."""

    name = "flash"
    """What the call resolves to for argument checks and rank agreement (the GPU kernels)."""
    max_logit = staticmethod(reference.max_logit)

    def __init__(self, device: torch.device, table: dict | None = None, first: str | None = None) -> None:
        self.device_class = device_class(device)
        self.available = available_kernels(device)
        self.table = load_table() if table is None else table
        self.first = first if first is not None else (os.environ.get("MCX_KERNEL") or None)
        if self.first is not None and self.first not in KERNELS:
            raise ValueError(f"MCX_KERNEL={self.first!r}: not a kernel (known: {', '.join(KERNELS)})")
        self._memo: dict[CallShape, Kernel] = {}
        self._fast: dict[tuple, Kernel] = {}

    def kernel(self, s: CallShape) -> Kernel:
        k = self._memo.get(s)
        if k is None:
            name, why = pick_why(self.device_class, s, self.available, self.table, self.first)
            k = self._memo[s] = KERNELS[name]
            log.info("local attention kernel on %s for %s: %s (%s)", self.device_class, s, name, why)
        return k

    def _for(self, q, k, v, max_k: int, causal: bool, window: tuple[int, int]) -> Kernel:
        """The call's kernel; memoised on the raw host values that decide its bucket (a tuple
        lookup per call on the hot path)."""
        raw = (q.dtype, q.shape[0].bit_length(), q.shape[1], k.shape[1], q.shape[-1], v.shape[-1],
               int(max_k).bit_length(), causal, tuple(window))  # fmt: skip
        kern = self._fast.get(raw)
        if kern is None:
            kern = self._fast[raw] = self.kernel(call_shape(q, k, v, max_k, causal, window))
        return kern

    def attn_fwd(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, window, scale):
        kern = self._for(q, k, v, max_k, causal, window)
        return kern.fwd(q, k, v, cu_q, cu_k, max_q, max_k, causal, window, scale)

    def attn_bwd(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, window, scale):
        kern = self._for(q, k, v, max_k, causal, window)
        return kern.bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, window, scale)


# ---- writing a measured entry (benchmarks/gpu_suite.py) ------------------------------------------
def entry_from_measurements(rows: list[dict], source: str) -> dict:
    """A table entry from timings: ``rows`` of ``{kernel, dtype, d, dv, gqa, mask, tokens,
    seconds}`` (fwd+bwd of one call over a whole batch). Per (dtype, d, dv, gqa, mask) and
    measured size, the fastest kernel (ties: by name) becomes a rule; a size covers the calls
    nearer to it than to the next measured size (bounds at the geometric mean, in the call's
    power-of-two token bucket), the smallest down to 0 and the largest upwards; ``compared``
    lists the candidates timed there."""
    best: dict[tuple, tuple[float, str]] = {}
    timed: dict[tuple, set[str]] = {}
    for r in rows:
        key = (r["dtype"], r["d"], r["dv"], r["gqa"], r["mask"], r["tokens"])
        best[key] = min(best.get(key, (float("inf"), "~")), (float(r["seconds"]), r["kernel"]))
        timed.setdefault(key, set()).add(r["kernel"])
    rules = []
    for shape in sorted({k[:5] for k in best}):
        sizes = sorted(k[5] for k in best if k[:5] == shape)
        bounds = [0] + [_pow2(int((a * b) ** 0.5)) for a, b in zip(sizes, sizes[1:])]
        for i, t in enumerate(sizes):
            rule = dict(zip(("dtype", "d", "dv", "gqa", "mask"), shape), min_tokens=bounds[i])
            if i + 1 < len(sizes):
                rule["max_tokens"] = bounds[i + 1]
            rules.append({**rule, "kernel": best[(*shape, t)][1], "measured_tokens": t,
                          "compared": sorted(timed[(*shape, t)])})  # fmt: skip
    return {"source": source, "rules": rules}


def write_entry(cls: str, entry: dict, path: str = TABLE) -> None:
    """Record ``entry`` for device class ``cls`` in the table at ``path`` (others kept)."""
    data = {"devices": {}}
    if os.path.isfile(path):
        with open(path) as f:
            data = json.load(f)
    data.setdefault("devices", {})[cls] = entry
    with open(path, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")

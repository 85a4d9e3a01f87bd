"""Row-movement and merge primitives used by every schedule.

These are the only places the hot path touches packed rows: gathering THD rows by a plan
index (reorder), scatter-adding gradient rows, and the fp32 online-softmax merge of a partial
attention result into an accumulator. Each has a pure-torch implementation here; when the
optional CUDA extension (``csrc/``, built as ``megatron_cp_ext._C``) is present, CUDA tensors
go through its kernels instead, with identical results (see ``docs/kernels.md``).

The kernels are ``torch.library`` ops (``torch.ops.megatron_cp_ext.*``) defined in C++; this
module registers their fake impls so they trace under ``torch.compile``. The public functions
below pick the kernel only when it applies exactly (extension built, contiguous tensors on one
CUDA device, supported dtypes, no autograd graph to record) and otherwise use the fallback, so
callers never see a difference beyond speed. Without the extension everything still works.

Shapes: ``T`` tokens, ``H`` heads, ``D`` head dim, ``N`` rows of a partial result.
"""

from __future__ import annotations

import importlib

import torch

__all__ = [
    "HAS_CUDA_EXT", "LSE_FLOOR", "lse_floor", "floor_lse_", "gather_rows", "index_add_rows", "merge_partial",
    "row_dot16", "stand_in16",
]  # fmt: skip


def _load_extension() -> str | None:
    """Import the compiled kernels (importing runs their registration); say why not if absent.

    The reason is kept (``_EXT_IMPORT_ERROR``) because a broken build and no build both end in
    the fallback, and only the message tells them apart.
    """
    try:
        importlib.import_module("megatron_cp_ext._C")
    except (ImportError, OSError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


_EXT_IMPORT_ERROR = _load_extension()
HAS_CUDA_EXT: bool = _EXT_IMPORT_ERROR is None
"""Whether the CUDA kernels are built and registered as ``torch.ops.megatron_cp_ext.*``."""

_HALVES = (torch.float16, torch.bfloat16)
_FLOATS = (torch.float32, *_HALVES, torch.float64)

if HAS_CUDA_EXT:
    # Fake impls: shapes only, for torch.compile / meta tracing. The in-place ops return
    # nothing; their mutations are declared in the C++ schemas (Tensor(a!)).

    @torch.library.register_fake("megatron_cp_ext::gather_rows")
    def _gather_rows_fake(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        torch._check(idx.dim() == 1, lambda: "idx must be 1-D")
        return x.new_empty((idx.shape[0], *x.shape[1:]))

    @torch.library.register_fake("megatron_cp_ext::index_add_rows_")
    def _index_add_rows_fake(acc: torch.Tensor, idx: torch.Tensor, src: torch.Tensor) -> None:
        torch._check(src.shape[1:] == acc.shape[1:], lambda: "src rows must match acc rows")

    @torch.library.register_fake("megatron_cp_ext::merge_partial_")
    def _merge_partial_fake(
        out: torch.Tensor,
        lse: torch.Tensor,
        part_out: torch.Tensor,
        part_lse: torch.Tensor,
        idx: torch.Tensor | None,
    ) -> None:
        torch._check(part_out.shape[1:] == out.shape[1:], lambda: "part_out must be [N, H, D]")

    @torch.library.register_fake("megatron_cp_ext::row_dot")
    def _row_dot_fake(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a.new_empty(a.shape[:-1], dtype=torch.float32)

    @torch.library.register_fake("megatron_cp_ext::stand_in")
    def _stand_in_fake(dout: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return dout.new_empty(dout.shape)


def _use_kernel(*tensors: torch.Tensor) -> bool:
    """Whether the CUDA kernels can stand in for the fallback on these tensors.

    They need contiguous tensors on one CUDA device, and they record no autograd graph: if
    anything requires grad, the (differentiable) fallback keeps the semantics.
    """
    if not HAS_CUDA_EXT or tensors[0].device.type != "cuda":
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    device = tensors[0].device
    return _capable(device) and all(t.device == device and t.is_contiguous() for t in tensors)


_CAPABLE: dict[int, bool] = {}


def _capable(device: torch.device) -> bool:
    """The kernels' floor, sm_80 (bf16 atomics; the build's archs are 8.0, 9.0 and its PTX):
    an older GPU keeps the fallback instead of failing at launch. Asked once per device."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    ok = _CAPABLE.get(index)
    if ok is None:
        ok = _CAPABLE[index] = torch.cuda.get_device_capability(index) >= (8, 0)
    return ok


def _is_index(idx_N: torch.Tensor) -> bool:
    return idx_N.dtype == torch.int64 and idx_N.dim() == 1


# --- pure-torch implementations (the contract; also what the kernels are tested against) ---


def gather_rows_torch(x_T: torch.Tensor, idx_N: torch.Tensor) -> torch.Tensor:
    """Fallback of :func:`gather_rows`; always the pure-torch path."""
    return x_T.index_select(0, idx_N)


def index_add_rows_torch(acc_T: torch.Tensor, idx_N: torch.Tensor, src_N: torch.Tensor) -> None:
    """Fallback of :func:`index_add_rows`; always the pure-torch path (one op when the dtypes
    match: ``.to`` returns ``src_N`` itself)."""
    acc_T.index_add_(0, idx_N, src_N.to(acc_T.dtype))


def merge_partial_torch(
    out_THD: torch.Tensor,
    lse_TH: torch.Tensor,
    part_out_NHD: torch.Tensor,
    part_lse_NH: torch.Tensor,
    idx_N: torch.Tensor | None,
    *,
    acc_finite: bool = False,
) -> None:
    """Fallback of :func:`merge_partial`; always the pure-torch path.

    In place and in four ops for a row slice (the common call): the partial's weight is
    ``sigmoid(part_lse - lse)`` (= ``exp(part_lse - new_lse)``), ``out`` moves towards the partial
    by it (``lerp_``) and ``lse`` becomes ``logaddexp``. No ``[N, H, D]`` temporary is made
    (one more op and one temporary when the partial's dtype differs, for 16-bit partials).
    Unless ``acc_finite`` (the accumulator's lse holds no -inf, e.g. starts at
    :data:`LSE_FLOOR`), four more ops pin the weight of rows empty on both sides to 0. A NaN
    lse on either side leaves the row NaN (as the CUDA kernel does): bad input is never hidden.
    """
    if idx_N is None:
        acc_out, acc_lse = out_THD, lse_TH
    else:
        acc_out, acc_lse = out_THD.index_select(0, idx_N), lse_TH.index_select(0, idx_N)
    w = torch.sub(part_lse_NH, acc_lse).sigmoid_()
    if not acc_finite:  # -inf - -inf: nothing on either side, keep the accumulator (a NaN stays)
        w.masked_fill_(torch.isneginf(acc_lse).logical_and_(torch.isneginf(part_lse_NH)), 0.0)
    part = part_out_NHD if part_out_NHD.dtype == acc_out.dtype else part_out_NHD.to(acc_out.dtype)
    acc_out.lerp_(part, w.unsqueeze(-1))
    torch.logaddexp(acc_lse, part_lse_NH, out=acc_lse)
    if idx_N is not None:
        out_THD.index_copy_(0, idx_N, acc_out)
        lse_TH.index_copy_(0, idx_N, acc_lse)


LSE_FLOOR = -torch.finfo(torch.float32).max
"""Start value of lse accumulators: finite, so merges need no NaN guard; the lowest fp32 value,
so below any fp32 log-sum-exp and it merges exactly like -inf (weight 0, ``logaddexp``
unchanged). A floor of -1e30 dropped real partials under it: a row whose logits all lay below
-1e30 (``softmax_scale=1e31``) came out 0 wherever its keys arrived in more than one call."""


def lse_floor(dtype: torch.dtype) -> float:
    """:data:`LSE_FLOOR` for an accumulator of ``dtype``: its lowest finite value (fp64
    accumulators hold fp64 log-sum-exps far below the fp32 floor)."""
    return torch.finfo(dtype).min


def floor_lse_(lse: torch.Tensor) -> torch.Tensor:
    """A kernel's lse with its rows that saw no key (``-inf``, or flash's ``+inf``) at
    :func:`lse_floor`, in place; a NaN stays NaN (bad input is never hidden)."""
    floor = lse_floor(lse.dtype)
    return lse.nan_to_num_(nan=float("nan"), posinf=floor, neginf=floor)


# --- public API ---


def gather_rows(x_T: torch.Tensor, idx_N: torch.Tensor) -> torch.Tensor:
    """``x_T[idx_N]`` along dim 0 (THD reorder by a plan index)."""
    if x_T.dim() >= 1 and _is_index(idx_N) and _use_kernel(x_T, idx_N):
        return torch.ops.megatron_cp_ext.gather_rows(x_T, idx_N)
    return gather_rows_torch(x_T, idx_N)


def _add_kernel(acc_T: torch.Tensor, idx_N: torch.Tensor, src_N: torch.Tensor) -> bool:
    """Whether :func:`index_add_rows` takes the CUDA kernel. Not under
    ``torch.use_deterministic_algorithms``: the kernel adds with atomics, so repeated indices
    sum in no fixed order, while torch's ``index_add_`` has a deterministic CUDA path."""
    if not HAS_CUDA_EXT or acc_T.device.type != "cuda" or torch.are_deterministic_algorithms_enabled():
        return False
    dtypes_ok = (acc_T.dtype == src_N.dtype and acc_T.dtype in _FLOATS) or (
        acc_T.dtype == torch.float32 and src_N.dtype in _HALVES
    )
    return dtypes_ok and acc_T.dim() >= 1 and _is_index(idx_N) and _use_kernel(acc_T, idx_N, src_N)


def index_add_rows(acc_T: torch.Tensor, idx_N: torch.Tensor, src_N: torch.Tensor) -> None:
    """``acc_T[idx_N] += src_N`` in place; repeated indices accumulate."""
    if _add_kernel(acc_T, idx_N, src_N):
        torch.ops.megatron_cp_ext.index_add_rows_(acc_T, idx_N, src_N)
    else:
        index_add_rows_torch(acc_T, idx_N, src_N)


def merge_partial(
    out_THD: torch.Tensor,
    lse_TH: torch.Tensor,
    part_out_NHD: torch.Tensor,
    part_lse_NH: torch.Tensor,
    idx_N: torch.Tensor | None,
    *,
    acc_finite: bool = False,
) -> None:
    """Merge a partial attention result into fp32 (or fp64) accumulators, in place.

    ``out_THD`` and ``lse_TH`` (fp32, or both fp64 for fp64 inputs; ``-inf`` where nothing
    was seen yet) hold the
    softmax-normalised output and log-sum-exp over the keys merged so far. The partial result
    covers rows ``idx_N`` (all rows in order when ``None``; rows must be distinct). Rows where
    both sides are ``-inf`` stay zero and ``-inf``; a NaN lse on either side leaves the row NaN.
    ``acc_finite=True`` promises that ``lse_TH`` holds no ``-inf`` (accumulators started at
    :data:`LSE_FLOOR`), which saves the fallback its four-op both-empty fill.
    """
    if not HAS_CUDA_EXT or out_THD.device.type != "cuda":
        merge_partial_torch(out_THD, lse_TH, part_out_NHD, part_lse_NH, idx_N, acc_finite=acc_finite)
        return
    fp32 = (out_THD, lse_TH, part_lse_NH)
    dtypes_ok = all(t.dtype == torch.float32 for t in fp32) and part_out_NHD.dtype in (
        torch.float32,
        *_HALVES,
    )
    extra = () if idx_N is None else (idx_N,)
    if dtypes_ok and (idx_N is None or _is_index(idx_N)) and _use_kernel(*fp32, part_out_NHD, *extra):
        torch.ops.megatron_cp_ext.merge_partial_(out_THD, lse_TH, part_out_NHD, part_lse_NH, idx_N)
    else:
        merge_partial_torch(out_THD, lse_TH, part_out_NHD, part_lse_NH, idx_N, acc_finite=acc_finite)


def row_dot16(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """``sum_d a[..., d] * b[..., d]`` in fp32 for 16-bit ``a`` and ``b`` of one shape and
    dtype, by the CUDA kernel (one read of each operand); None where the kernel does not apply
    (the caller's torch form runs instead)."""
    if a.dtype in _HALVES and a.dtype == b.dtype and a.shape == b.shape and _use_kernel(a, b):
        return torch.ops.megatron_cp_ext.row_dot(a, b)
    return None


def stand_in16(dout: torch.Tensor, delta: torch.Tensor) -> torch.Tensor | None:
    """The flash backward's stand-in output (:func:`.schedules.delta.stand_in`) for 16-bit
    ``dout`` ``[..., D]`` (``D >= 2``) and fp32 ``delta`` ``[...]`` by the CUDA kernel: one
    read of ``dout``, one write of the result, the torch form's values to the bit; None where
    the kernel does not apply (the caller's torch form runs instead)."""
    fits = dout.dim() >= 1 and dout.shape[-1] >= 2 and delta.shape == dout.shape[:-1]
    if fits and dout.dtype in _HALVES and delta.dtype == torch.float32 and _use_kernel(dout, delta):
        return torch.ops.megatron_cp_ext.stand_in(dout, delta)
    return None

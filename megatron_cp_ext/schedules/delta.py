"""The output a flash backward reads, made from ``dout`` instead of moved: ``a2a``'s backward
sends no output to heads.

A flash-style backward (FA2, FA3, cuDNN, PyTorch's flash, the reference) reads the output
``out`` once, for the softmax's row term ``delta_i = sum_d dout_id * out_id`` (each query
head's dot product); nothing else of it enters the gradients. So any tensor ``x`` with
``sum_d dout_id * x_id = delta_i`` gives the same gradients. ``a2a`` and ``a2a+p2p`` hold the
output in token layout and used to move it to head layout for the kernel — an all-to-all as
large as ``dout``'s. Instead, ``delta`` is computed in token layout (one ``[t, H]`` fp32
value per query row and head), moved to heads (``1 / (Dv * itemsize / 4)`` of the bytes), and
:func:`stand_in` builds ``x`` there from ``dout`` itself: zeros except at the row's two largest
``|dout|`` entries, ``x_k = delta / dout_k`` rounded, and ``x_l`` carrying the rounding
remainder. Written in the input dtype, ``sum_d dout_d * x_d`` then equals ``delta`` to about
twice the input's precision of the row's magnitude ``sum_d |dout_d * out_d|``, the scale of any
kernel's own rounding of ``delta`` (bf16: ~2^-17; a single entry would give 2^-9, enough to
show in the gradients where ``dout . v`` hardly varies over the keys), so the gradients match
those from the moved output to the kernel's own rounding (``tests/L1/test_a2a_stand_in.py``).
A row whose ``dout`` is zero gets ``x = 0`` (``delta`` is 0 there too); a NaN or inf in a row's
``dout`` or output stays in that row, as with the moved output.
"""

from __future__ import annotations

import torch

from ..runtime.ops import row_dot16, stand_in16
from ..runtime.stand_in import host_as_device

__all__ = ["row_dot", "row_dot_torch", "stand_in", "stand_in_torch"]

CHUNK_BYTES = 128 << 20
"""fp32 bytes of one row chunk of :func:`row_dot`'s widened 16-bit operands on CUDA."""


def row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``sum_d a[..., d] * b[..., d]`` over the last dim in the accumulator dtype (fp32, fp64
    for fp64): ``[t, H, D] x [t, H, D] -> [t, H]``, the products never rounded to 16 bits.

    16-bit inputs on CUDA run the csrc kernel where it is built (one read of each operand);
    without it they are widened a row chunk at a time (:data:`CHUNK_BYTES`) and reduced
    elementwise: a product of two 16-bit values is exact in fp32 (a batched ``bmm`` of
    ``[1, D] x [D, 1]`` rows runs as cuBLAS matrix-vector kernels, slow at this shape)."""
    if a.dtype != b.dtype:  # mixed inputs: both widened (not a2a's path: dout has the output's dtype)
        common = torch.float64 if torch.float64 in (a.dtype, b.dtype) else torch.float32
        a, b = a.to(common), b.to(common)
    lead, d = a.shape[:-1], a.shape[-1]
    wide = a.dtype in (torch.float32, torch.float64)
    if not wide:
        got = _row_dot16(a, b)
        if got is not None:
            return got
    if a.is_cuda:  # no TF32 matmul for wide inputs; 16-bit ones widened by chunks
        if wide:
            return (a * b).sum(-1)
        a2, b2 = a.reshape(-1, d), b.reshape(-1, d)
        out = a2.new_empty(a2.shape[0], dtype=torch.float32)
        step = max(1, CHUNK_BYTES // max(1, 4 * d))
        for i in range(0, a2.shape[0], step):
            x = a2[i : i + step].float()
            x.mul_(b2[i : i + step])
            torch.sum(x, -1, out=out[i : i + step])
            del x
        return out.view(lead)
    return row_dot_torch(a, b)


def row_dot_torch(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """:func:`row_dot`'s CPU form (one dtype): a batched ``[1, D] x [D, 1]`` product, 16-bit
    operands widened first (tests; the traffic proxy counts it as the csrc kernel instead)."""
    a3, b3 = a.reshape(-1, 1, a.shape[-1]), b.reshape(-1, b.shape[-1], 1)
    if a.dtype in (torch.float32, torch.float64):
        return torch.bmm(a3, b3).view(a.shape[:-1])
    return torch.bmm(a3.float(), b3.float()).view(a.shape[:-1])


def _row_dot16(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """The CUDA kernel's 16-bit row dot (:func:`..ops.row_dot16`: one read of each operand,
    where the torch forms below widen), or None where it does not apply. A module attribute,
    so the traffic proxy can count it as the one kernel it is on a GPU."""
    return row_dot16(a, b)


def _stand_in16(dout: torch.Tensor, delta: torch.Tensor) -> torch.Tensor | None:
    """The CUDA kernel's 16-bit stand-in (:func:`..ops.stand_in16`: one read of ``dout``, one
    write, where the torch form below makes six passes), or None where it does not apply. A
    module attribute, so the traffic proxy can count it as the one kernel it is on a GPU."""
    return stand_in16(dout, delta)


def stand_in(dout: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """A ``dout``-shaped tensor ``x`` (its dtype) with ``sum_d dout_d * x_d = delta`` per row
    and head, to take the output's place in a flash backward (see the module docstring).

    ``dout``: ``[T, h, Dv]``; ``delta``: ``[T, h]`` in the accumulator dtype. One entry per row
    where the input is fp32 or fp64 (its rounding is the input's own), two for 16-bit inputs.
    A zero ``dout_k`` divides by 1 instead (``delta`` is 0 there, or the entry adds nothing).
    16-bit rows on CUDA run the csrc kernel where it is built, to the bit the same (rows whose
    term overflows the dtype, spread over every entry, to a rounding of their share)."""
    if dout.element_size() < 4 and dout.shape[-1] > 1:
        got = _stand_in16(dout, delta)
        if got is not None:
            return got
    return stand_in_torch(dout, delta)


def stand_in_torch(dout: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """:func:`stand_in`'s torch form (CPU, and CUDA without the kernel)."""
    width = dout.shape[-1]
    if width == 0:
        return torch.empty_like(dout)
    two = dout.element_size() < 4 and width > 1
    mag = dout.abs()
    top = mag.argmax(-1, keepdim=True)
    if two:  # the second largest: the largest with the first masked, so two distinct entries
        # (two reductions: a topk over every row was the backward's costliest op on a GPU)
        second = mag.scatter_(-1, top, -1).argmax(-1, keepdim=True)
        top = torch.cat([top, second], dim=-1)
    del mag
    at = dout.gather(-1, top).to(delta.dtype)
    at += at == 0
    hi = (delta / at[..., 0]).to(dout.dtype)
    if not two:
        return torch.zeros_like(dout).scatter_(-1, top, hi.unsqueeze(-1))
    rest = delta - at[..., 0] * hi  # what the rounded first entry misses
    x = torch.zeros_like(dout).scatter_(-1, top, torch.stack([hi, (rest / at[..., 1]).to(dout.dtype)], dim=-1))
    over = hi.isinf() & delta.isfinite()
    device = dout.device.type != "cpu" or host_as_device()  # no host read off the CPU (meta included)
    if device and dout.dtype == torch.bfloat16:  # bf16 has fp32's range: no read-back to look
        return x
    if not device and not bool(over.any()):  # a host read is free on CPU
        return x
    return torch.where(over.unsqueeze(-1), _spread(dout, delta, at, top), x)


def _spread(dout: torch.Tensor, delta: torch.Tensor, at: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """The stand-in of rows whose ``delta / dout_k`` overflows the 16-bit dtype (fp16 rows whose
    output magnitudes sum past 65504): every entry ``d`` carries ``sign(dout_d) * share``, the
    rounded ``share = delta / sum_d |dout_d|`` (at most the row's largest ``|out_d|``, so it
    fits), and the two largest entries add what that misses, the second what the first's
    rounding misses. The row term is then within a rounding of the second entry's value,
    ``2^-11 * share * |dout_l|`` (``l`` the second largest entry): about 5e-6 of the row's
    magnitude where ``dout`` is spread, a rounding of it where two entries hold it all. Within
    a rounding of the dtype's largest value the two entries saturate there instead of
    overflowing: the term then misses by up to a rounding of the share, ``2^-11`` of the row's
    magnitude."""
    wide = delta.dtype
    s_all = dout.abs().to(wide).sum(-1)
    share = (delta / s_all).to(dout.dtype)
    x = (torch.sign(dout) * share.unsqueeze(-1)).to(dout.dtype)
    base = x.gather(-1, top).to(wide)
    r = delta - share.to(wide) * s_all
    big = torch.finfo(dout.dtype).max  # near it, a share rounded down leaves more than one entry can take
    first = (base[..., 0] + r / at[..., 0]).clamp_(-big, big).to(dout.dtype)
    r = r - at[..., 0] * (first.to(wide) - base[..., 0])
    second = (base[..., 1] + r / at[..., 1]).clamp_(-big, big).to(dout.dtype)
    return x.scatter_(-1, top, torch.stack([first, second], dim=-1))

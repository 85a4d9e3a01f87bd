"""A CPU stand-in for CUDA's sync debug mode: every host read of tensor data raises.

On a GPU, a forward or backward that reads a device value on the host (``item``, ``int(t)``,
``bool(t)``, ``tolist``, ``numpy``, a data-dependent shape such as ``nonzero`` or a boolean
index) stalls the host until the device catches up. CPU tensors read for free, so a CPU test
must look for the reads themselves:

- :class:`no_host_reads` refuses, while active, the dispatcher ops that turn tensor data into
  host values or shapes (``_local_scalar_dense`` behind ``item``/``int``/``float``/``bool``,
  ``nonzero``, ``masked_select``, ``unique``, ``repeat_interleave`` with tensor repeats, boolean
  indexing, ``equal``/``is_nonzero``) and the methods that read without the dispatcher
  (``tolist``, ``numpy``, ``__array__``, ``cpu``).
- The local kernel is the one place the CPU must read: the exact reference groups entries by
  their lengths. :func:`sync_free_kernel` replaces it by a dense masked kernel that builds its
  masks from ``cu_seqlens`` with device ops only (as a GPU kernel takes them), so nothing on the
  path is exempt.
- Host tensors stand in for device ones: checks the package runs only on host-resident data
  (a host ``cu_seqlens``' values, free to read there) take the device's path while active
  (:mod:`megatron_cp_ext.runtime.stand_in`).

``tests/L1/test_no_sync_guard.py`` shows the guard fails on injected syncs of each kind.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..runtime.stand_in import STAND_IN

__all__ = ["HostReadError", "no_host_reads", "sync_free_kernel"]

_aten = torch.ops.aten
_READS = {
    _aten._local_scalar_dense.default: "item/int/float/bool",
    _aten.nonzero.default: "nonzero",
    _aten.masked_select.default: "masked_select",
    _aten._unique2.default: "unique",
    _aten.unique_consecutive.default: "unique_consecutive",
    _aten.unique_dim.default: "unique",
    _aten.repeat_interleave.Tensor: "repeat_interleave with tensor repeats",
    _aten.equal.default: "torch.equal",
    _aten.is_nonzero.default: "bool(tensor)",
}
_METHODS = ("tolist", "numpy", "__array__", "cpu")


class HostReadError(AssertionError):
    """A host read of tensor data where a GPU would have to sync."""


class _Mode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        why = _READS.get(func)
        if why is None and func in (_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default):
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None):
                why = "boolean-mask indexing (a data-dependent shape)"
        if why is not None:
            raise HostReadError(f"host read of device data in the hot path: {why} ({func})")
        return func(*args, **kwargs)


_LOCAL = threading.local()


@contextlib.contextmanager
def no_host_reads():
    """Raise :class:`HostReadError` on any host read of tensor data in this thread while active.
    The tensor methods are patched process-wide but only refuse in a thread that is inside."""
    saved = {n: getattr(torch.Tensor, n) for n in _METHODS}

    def refusing(name):
        def call(self, *a, **k):
            if getattr(_LOCAL, "active", False):
                raise HostReadError(f"host read of device data in the hot path: Tensor.{name}")
            return saved[name](self, *a, **k)

        return call

    _LOCAL.active = True
    STAND_IN.on = True  # the package's host-only value checks take the device's path
    try:
        for n in _METHODS:
            setattr(torch.Tensor, n, refusing(n))
        with _Mode():
            yield
    finally:
        _LOCAL.active = STAND_IN.on = False
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)


def _entry_of(cu: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of a packed side: its entry and its position in it (device ops only)."""
    rows = torch.arange(n, device=cu.device)
    cu = cu.to(torch.int64)
    e = torch.searchsorted(cu[1:], rows, right=True)
    return e, rows - cu.index_select(0, e.clamp(max=cu.numel() - 2))


def _visible(cu_q, cu_k, nq: int, nk: int, causal: bool, window: tuple[int, int]) -> torch.Tensor:
    """``[nq, nk]`` bool: the contract's visibility (same entry, bottom-right aligned band)."""
    eq, pq = _entry_of(cu_q, nq)
    ek, pk = _entry_of(cu_k, nk)
    cu_q, cu_k = cu_q.to(torch.int64), cu_k.to(torch.int64)
    lq = (cu_q[1:] - cu_q[:-1]).index_select(0, eq.clamp(max=cu_q.numel() - 2))
    lk = (cu_k[1:] - cu_k[:-1]).index_select(0, eq.clamp(max=cu_k.numel() - 2))
    d = pk[None] - (pq + lk - lq)[:, None]
    vis = eq[:, None] == ek[None]
    left, right = window[0], 0 if causal else window[1]
    if left >= 0:
        vis = vis & (d >= -left)
    if right >= 0:
        vis = vis & (d <= right)
    return vis


def _scores(q, k, cu_q, cu_k, causal, window, scale):
    g = q.shape[1] // k.shape[1]
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    kh = k.to(ct).repeat_interleave(g, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.to(ct) * scale, kh)
    vis = _visible(cu_q, cu_k, q.shape[0], k.shape[0], causal, window)
    return torch.where(vis[None], s, float("-inf")), g, ct


def _attn_fwd(q, k, v, cu_q, cu_k, max_q, max_k, causal, window, scale):
    s, g, ct = _scores(q, k, cu_q, cu_k, causal, window, scale)
    lse = torch.logsumexp(s, dim=-1)  # [H, N]
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    out = torch.einsum("hqk,khd->qhd", p, v.to(ct).repeat_interleave(g, dim=1))
    return out.to(q.dtype), lse.t().contiguous()


def _attn_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, window, scale):
    s, g, ct = _scores(q, k, cu_q, cu_k, causal, window, scale)
    lse_h = lse.t().to(ct)
    p = torch.exp(s - torch.where(torch.isfinite(lse_h), lse_h, 0.0)[..., None])
    do, o = dout.to(ct), out.to(ct)
    vh, kh = v.to(ct).repeat_interleave(g, dim=1), k.to(ct).repeat_interleave(g, dim=1)
    dv = torch.einsum("hqk,qhd->khd", p, do)
    ds = p * (torch.einsum("qhd,khd->hqk", do, vh) - (do * o).sum(-1).t()[..., None])
    dq = torch.einsum("hqk,khd->qhd", ds, kh) * scale
    dk = torch.einsum("hqk,qhd->khd", ds, q.to(ct)) * scale
    fold = lambda x: x.unflatten(1, (k.shape[1], g)).sum(2)  # noqa: E731 - GQA heads add up
    return dq, fold(dk), fold(dv)


def sync_free_kernel():
    """The reference backend's varlen kernel replaced, while active, by a dense masked one that
    reads nothing on the host (the same contract; small inputs only: it forms ``[H, N, M]``)."""
    from . import reference_kernels

    return reference_kernels(_attn_fwd, _attn_bwd)

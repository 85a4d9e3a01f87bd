"""Count what a GPU run of ``cp_attention`` would allocate and launch, on the CPU.

Two pieces, used together by ``benchmarks/memory_launches.py`` and the tests that pin exact
counts:

* :func:`flash_stub` — swaps the CPU ``reference`` kernels for flash-shaped stubs: each call
  allocates exactly the outputs a flash varlen kernel returns (``out`` in the input dtype and
  an fp32 ``lse`` forward; ``dq, dk, dv`` in the input dtype backward) and is one op, so the
  reference kernel's padded batches and dense probabilities (a CPU artefact) do not count.
  a2a's 16-bit row dot and stand-in output likewise allocate only what their csrc kernels
  return (one op each, namespace ``mcx_fused``), not their CPU forms' widened temporaries.
  The values are zeros: use it to count, never to check results.
* :class:`Tracker` — a dispatch mode that counts the aten ops that launch work (views and
  metadata ops excluded; the stub's kernels and collectives counted apart) and follows every
  storage the ops allocate, so ``peak`` is the most bytes alive at once, including tracked
  inputs and what autograd keeps.

Both run under ``torch.compiler.disable``-free eager code only.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections import Counter
from collections.abc import Iterator

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["flash_stub", "Tracker", "saved_bytes", "add_storage"]

_LIB = torch.library.Library("mcx_testing", "DEF")  # noqa: TOR901 - test-only ops
_LIB.define("stub_fwd(Tensor q, Tensor k, Tensor v) -> (Tensor, Tensor)")
_LIB.define("stub_bwd(Tensor dout, Tensor q, Tensor k, Tensor v) -> (Tensor, Tensor, Tensor)")
_FUSED = torch.library.Library("mcx_fused", "DEF")  # noqa: TOR901 - test-only ops
_FUSED.define("row_dot(Tensor a, Tensor b) -> Tensor")
_FUSED.define("stand_in(Tensor dout, Tensor delta) -> Tensor")


@torch.library.impl(_FUSED, "row_dot", "CompositeExplicitAutograd")
def _fused_row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.new_zeros(a.shape[:-1], dtype=torch.float32)


@torch.library.impl(_FUSED, "stand_in", "CompositeExplicitAutograd")
def _fused_stand_in(dout: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(dout)


@torch.library.impl(_LIB, "stub_fwd", "CompositeExplicitAutograd")
def _stub_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out = q.new_zeros((q.shape[0], q.shape[1], v.shape[2]))
    return out, q.new_zeros((q.shape[0], q.shape[1]), dtype=torch.float32)


@torch.library.impl(_LIB, "stub_bwd", "CompositeExplicitAutograd")
def _stub_bwd(dout, q, k, v) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


def _fwd(q, k, v, *_args) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ops.mcx_testing.stub_fwd(q, k, v)


def _bwd(dout, q, k, v, *_args) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.ops.mcx_testing.stub_bwd(dout, q, k, v)


@contextlib.contextmanager
def flash_stub() -> Iterator[None]:
    """Within the block, the ``reference`` backend's kernels are flash-shaped stubs, and a2a's
    16-bit row dot and stand-in are their csrc kernels' shapes."""
    from ..schedules import delta
    from . import reference_kernels

    before = delta._row_dot16, delta._stand_in16
    delta._row_dot16 = torch.ops.mcx_fused.row_dot
    delta._stand_in16 = torch.ops.mcx_fused.stand_in
    try:
        with reference_kernels(_fwd, _bwd):
            yield
    finally:
        delta._row_dot16, delta._stand_in16 = before


class Tracker(TorchDispatchMode):
    """Aten ops and live bytes of everything dispatched inside the mode.

    ``ops``: launching aten ops by name (views excluded); ``kernels``: stub kernel calls;
    ``comms``: collectives and peer ops. ``live``/``peak``: bytes of the storages alive now
    and at most, over tracked inputs (:meth:`track`) and every op's outputs.
    """

    def __init__(self, where: bool = False) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.kernels = 0
        self.comms = 0
        self.where = where
        """Label every storage with the package source line that allocated it (slower)."""
        self._live: dict[int, tuple[StorageWeakRef, int, str]] = {}
        self.live = 0
        self.peak = 0
        self.at_peak: tuple[str, list[int]] = ("", [])
        """The op after which the peak was reached and the sizes alive then (largest first)."""
        self.live_at_peak: list[tuple[int, str]] = []
        """With ``where``: ``(bytes, label)`` of every storage alive at the peak, largest first."""

    def track(self, *tensors: torch.Tensor) -> None:
        """Count these (already allocated) tensors as live."""
        for t in tensors:
            self._add(t)
        self.peak = max(self.peak, self.live)

    def restart(self, saved: dict[int, tuple[StorageWeakRef, int]], *tensors: torch.Tensor) -> None:
        """Follow only the ``saved`` storages (:func:`saved_bytes`' ``refs``) still alive and
        ``tensors`` from here on, peak included: what a backward starts from, leaving out
        inputs that only the caller keeps (a training step frees them after forward)."""
        self._live = {key: (ref, n, "saved") for key, (ref, n) in saved.items() if not ref.expired()}
        self.live = sum(n for _, n, _ in self._live.values())
        self.track(*tensors)
        self.peak = self.live

    def reset_peak(self) -> None:
        self._sweep()
        self.peak = self.live

    def _add(self, t: torch.Tensor, label: str = "input") -> None:
        st = t.untyped_storage()
        ref = StorageWeakRef(st)
        if ref.cdata not in self._live:
            self._live[ref.cdata] = (ref, st.nbytes(), label)
            self.live += st.nbytes()

    def _sweep(self) -> None:
        for key, (ref, n, _) in list(self._live.items()):
            if ref.expired():
                del self._live[key]
                self.live -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ns = func.namespace
        if ns == "mcx_testing":
            self.kernels += 1
        elif ns == "c10d":
            self.comms += 1
        elif not func.is_view and func not in _METADATA:
            self.ops[func.name()] += 1
        self._sweep()
        label = f"{func.name()} {_caller()}" if self.where else func.name()
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._add(t, f"{label} {list(t.shape)}")
        if self.live > self.peak:
            self.peak = self.live
            self.at_peak = (func.name(), sorted((n for _, n, _ in self._live.values()), reverse=True))
            if self.where:
                self.live_at_peak = sorted(((n, lab) for _, n, lab in self._live.values()), reverse=True)
        return out

    @property
    def num_ops(self) -> int:
        return sum(self.ops.values())


_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SKIP = (os.path.join(_PKG, "testing"), os.path.join(_PKG, "runtime", "ops.py"))


def _caller() -> str:
    """``file:line`` of the innermost package frame outside the testing tools and ``ops``."""
    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if name.startswith(_PKG) and not name.startswith(_SKIP):
            return f"{os.path.relpath(name, _PKG)}:{f.f_lineno}"
        f = f.f_back
    return "?"


_METADATA = {torch.ops.aten.detach.default, torch.ops.aten.lift_fresh.default}


@contextlib.contextmanager
def saved_bytes(
    seen: dict[int, int] | None = None, refs: dict[int, tuple[StorageWeakRef, int]] | None = None
) -> Iterator[dict[int, int]]:
    """The distinct storages autograd saves for backward inside the block, as
    ``{storage id: bytes}`` (filled while the block runs). Add the block's outputs with
    :func:`add_storage` to count what the next layer keeps too. ``refs``, if given, gets a
    weak reference and the size of each (for :meth:`Tracker.restart`)."""
    seen = {} if seen is None else seen

    def pack(t: torch.Tensor) -> torch.Tensor:
        ref = StorageWeakRef(t.untyped_storage())
        seen.setdefault(ref.cdata, t.untyped_storage().nbytes())
        if refs is not None:
            refs.setdefault(ref.cdata, (ref, t.untyped_storage().nbytes()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield seen


def add_storage(seen: dict[int, int], t: torch.Tensor) -> None:
    """Count ``t``'s storage in ``seen`` (once, however many tensors view it)."""
    seen.setdefault(StorageWeakRef(t.untyped_storage()).cdata, t.untyped_storage().nbytes())

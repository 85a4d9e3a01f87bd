"""Strict argument checks: type and range of every user argument, before any collective.

A bad value must fail here, on the host, with a message that names the argument and lists
what is valid — not as a TypeError deep inside a kernel, a truncation (``int(10.5)``) or a
hang in a collective. Integer-valued arguments refuse non-integers (``10.5`` and ``16.0``
alike: a float where a count belongs is a bug upstream) and bools (``True`` is an int in
Python, but ``cp_size=True`` is not a size); flags refuse ``0``/``1``. Values read from
tensors would cost a host-device sync, so scalars must be Python (or NumPy) numbers.

Errors are :class:`CPArgumentError` (a ``ValueError``); wrong types raise
:class:`CPArgumentTypeError`, which is also a ``TypeError``. :mod:`.agreement` re-raises a
rank's error on every CP rank as the same class with the same message.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "CPArgumentError",
    "CPArgumentTypeError",
    "CPRankMismatchError",
    "DTYPES",
    "QKVShapes",
    "as_bool",
    "as_choice",
    "as_int",
    "as_ints",
    "as_scale",
    "as_window",
    "as_chunk",
    "check_qkv",
    "check_backend_dtype",
]

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
"""Supported q/k/v dtypes; the index is what the cross-rank signature carries."""


class CPArgumentError(ValueError):
    """An argument of ``cp_attention`` (or the sharding / batch helpers) is invalid."""


class CPArgumentTypeError(CPArgumentError, TypeError):
    """An argument has the wrong type (also a ``TypeError``)."""


class CPRankMismatchError(CPArgumentError):
    """CP ranks passed arguments that must agree but do not; raised on every rank."""


def _got(value: object) -> str:
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"got {text} ({type(value).__name__})"


def _is_int(value: object) -> bool:
    if isinstance(value, (bool,)) or type(value).__name__ == "bool_":  # bool and numpy.bool_
        return False
    if isinstance(value, numbers.Integral):
        return True
    return (
        isinstance(value, torch.Tensor)
        and value.dim() == 0
        and value.device.type == "cpu"
        and not value.dtype.is_floating_point
        and not value.dtype.is_complex
        and value.dtype != torch.bool
    )


def as_int(value: object, name: str, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` as a Python int; refuses floats (even ``16.0``), bools, strings, device tensors."""
    bounds = ""
    if minimum is not None and maximum is not None:
        bounds = f" in [{minimum}, {maximum}]"
    elif minimum is not None:
        bounds = f" >= {minimum}"
    if not _is_int(value):
        raise CPArgumentTypeError(f"{name} must be an int{bounds}, {_got(value)}")
    out = int(value)
    if (minimum is not None and out < minimum) or (maximum is not None and out > maximum):
        raise CPArgumentError(f"{name} must be an int{bounds}, got {out}")
    return out


def as_ints(values: object, name: str) -> list[int]:
    """A sequence of ints (e.g. host ``cu_seqlens`` as a list, or a 1-D NumPy integer array);
    every entry strictly an int."""
    if isinstance(values, np.ndarray) and values.ndim == 1 and values.dtype.kind in "iu":
        values = values.tolist()
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        kinds = "a CPU integer tensor, a 1-D integer NumPy array or a sequence of ints"
        raise CPArgumentTypeError(f"{name} must be {kinds}, {_got(values)}")
    out = []
    for i, x in enumerate(values):
        if not _is_int(x):
            raise CPArgumentTypeError(f"{name} must hold ints only; entry {i} is {x!r} ({type(x).__name__})")
        out.append(int(x))
    return out


def as_bool(value: object, name: str) -> bool:
    """A flag: ``True`` or ``False`` only (``0``/``1`` are ambiguous: a count or a flag?)."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise CPArgumentTypeError(f"{name} must be a bool (True or False), {_got(value)}")


def as_choice(value: object, name: str, choices: Sequence[str]) -> str:
    """One of ``choices`` (strings)."""
    if not isinstance(value, str):
        raise CPArgumentTypeError(f"{name} must be one of {tuple(choices)}, {_got(value)}")
    if value not in choices:
        raise CPArgumentError(f"{name} must be one of {tuple(choices)}, got {value!r}")
    return value


def as_scale(value: object, name: str = "softmax_scale") -> float | None:
    """``None`` (default ``1/sqrt(head_dim)``) or a finite positive real number."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise CPArgumentTypeError(
            f"{name} must be None or a positive finite float (a Python number, not a tensor), {_got(value)}"
        )
    try:
        out = float(value)
    except OverflowError:  # an int past float's range
        out = math.inf
    if not math.isfinite(out) or out <= 0:
        raise CPArgumentError(f"{name} must be None or a positive finite float, got {out!r}")
    return out


def as_seq_ids(value: object, num_seqs: int, name: str = "muted") -> frozenset[int]:
    """A set of sequence indices ``0 <= i < num_seqs`` as a frozenset of Python ints."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (set, frozenset, list, tuple)):
        raise CPArgumentTypeError(f"{name} must be a set of sequence indices, {_got(value)}")
    ids = frozenset(as_int(i, name, minimum=0) for i in value)
    if ids and max(ids) >= num_seqs:
        raise CPArgumentError(f"{name} holds sequence {max(ids)}, but the batch has {num_seqs} sequences")
    return ids


INT32_MAX = 2**31 - 1
"""Largest ``cu_seqlens`` entry: the local kernels take int32 offsets."""

MAX_EXTENT = 2**62
"""Largest window side or chunk accepted: anything past a sequence's length acts alike, and
the cross-rank exchange carries these values as int64."""


def as_window(value: object, name: str = "window_size") -> tuple[int, int]:
    """``(left, right)``: two ints >= -1 (-1 = unbounded; ``(-1, -1)`` = no window)."""
    what = f"{name} must be a (left, right) pair of ints >= -1 (-1 = unbounded; (-1, -1) = no window)"
    if not isinstance(value, (tuple, list)):
        raise CPArgumentTypeError(f"{what}, {_got(value)}")
    if len(value) != 2:
        raise CPArgumentError(f"{what}, got {len(value)} entries: {value!r}")
    left = as_int(value[0], f"{name}[0] (left)", minimum=-1, maximum=MAX_EXTENT)
    right = as_int(value[1], f"{name}[1] (right)", minimum=-1, maximum=MAX_EXTENT)
    return left, right


def as_chunk(value: object, name: str = "chunk_size") -> int | None:
    """``None`` (no chunking) or an int >= 1."""
    if value is None:
        return None
    if not _is_int(value):
        raise CPArgumentTypeError(f"{name} must be None or an int >= 1, {_got(value)}")
    if not 1 <= int(value) <= MAX_EXTENT:
        raise CPArgumentError(f"{name} must be None or an int in [1, 2**62], got {int(value)}")
    return int(value)


@dataclass(frozen=True)
class QKVShapes:
    """What a rank's q, k, v say about the call (thd view)."""

    tokens: int
    """Local tokens."""
    hq: int
    """Query heads."""
    hkv: int
    """Key/value heads."""
    dqk: int
    """Query/key head dim."""
    dv: int
    """Value head dim."""
    dtype: torch.dtype
    device: torch.device


def _tensor(x: object, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise CPArgumentTypeError(f"{name} must be a torch.Tensor, {_got(x)}")
    if x.layout != torch.strided:
        raise CPArgumentError(f"{name} must be a dense (strided) tensor, got layout {x.layout}")
    return x


def check_qkv(q: object, k: object, v: object, layout: str = "[tokens, heads, head_dim]") -> QKVShapes:
    """Validate thd ``q [t, hq, d], k [t, hkv, d], v [t, hkv, dv]`` (``hq % hkv == 0``)."""
    ts = [_tensor(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v"))]
    for name, x in zip("qkv", ts):
        if x.dim() != 3:
            raise CPArgumentError(f"{name} must be 3-D {layout}, got shape {tuple(x.shape)}")
    q, k, v = ts
    if q.dtype not in DTYPES:
        raise CPArgumentError(f"q dtype must be one of {DTYPES}, got {q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise CPArgumentError(f"q, k, v must share one dtype; got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if not (q.device == k.device == v.device):
        raise CPArgumentError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")
    if k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0]:
        raise CPArgumentError(f"q, k, v token counts differ: q {q.shape[0]}, k {k.shape[0]}, v {v.shape[0]}")
    if q.shape[1] < 1 or k.shape[1] < 1:
        raise CPArgumentError(f"q and k/v need at least one head, got q {q.shape[1]}, k {k.shape[1]}")
    if k.shape[1] != v.shape[1]:
        raise CPArgumentError(f"k and v head counts differ: k {k.shape[1]} vs v {v.shape[1]}")
    if q.shape[1] % k.shape[1]:
        raise CPArgumentError(f"num_heads of q ({q.shape[1]}) must be a multiple of k/v heads ({k.shape[1]})")
    if k.shape[2] != q.shape[2]:
        raise CPArgumentError(f"q and k head dims differ: q {q.shape[2]} vs k {k.shape[2]}")
    if q.shape[2] < 1 or v.shape[2] < 1:
        raise CPArgumentError(f"head dims must be >= 1, got q/k {q.shape[2]}, v {v.shape[2]}")
    return QKVShapes(q.shape[0], q.shape[1], k.shape[1], q.shape[2], v.shape[2], q.dtype, q.device)


def check_offset(offset: object, shapes: QKVShapes) -> torch.Tensor | None:
    """``softmax_offset``: None, or a floating tensor ``[num_heads]`` (the global query heads) on
    q's device. Its values are not inspected (that would read the device)."""
    if offset is None:
        return None
    if not isinstance(offset, torch.Tensor):
        raise CPArgumentTypeError(f"softmax_offset must be None or a torch.Tensor [num_heads], got {_got(offset)}")
    if not offset.dtype.is_floating_point:
        raise CPArgumentTypeError(f"softmax_offset must be a floating tensor, got {offset.dtype}")
    if tuple(offset.shape) != (shapes.hq,):
        raise CPArgumentError(
            f"softmax_offset must have shape [num_heads] = [{shapes.hq}] (one per query head), "
            f"got {tuple(offset.shape)}"
        )
    if offset.device != shapes.device:
        raise CPArgumentError(f"softmax_offset must be on q's device {shapes.device}, got {offset.device}")
    return offset


def check_backend_dtype(backend_name: str, dtype: torch.dtype) -> None:
    """The flash kernels run fp16/bf16 only; fp32/fp64 need ``backend='reference'``."""
    if backend_name == "flash" and dtype not in (torch.float16, torch.bfloat16):
        raise CPArgumentError(
            f"backend 'flash' runs float16/bfloat16 only, got dtype {dtype}; "
            "use backend='reference' (exact, slow) for float32/float64"
        )

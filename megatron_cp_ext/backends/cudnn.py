"""Candidate local kernel: cuDNN's fused flash attention through cudnn-frontend graphs (the
kernels TransformerEngine's CP runs), under the contract of :mod:`.reference`.

``pip install "megatron_cp_ext[cudnn]"`` brings cudnn-frontend; it loads the libcudnn that
torch ships (cuDNN >= 9.10.2 for bands on ragged batches). One graph per bucketed call
geometry is built on first use and cached (:mod:`.cudnn_args` says what a graph is keyed by and
how calls map onto it); the hot path computes the ragged offsets on the device and executes.

Every mask of the contract is a bottom-right band (causal, windows on either side, none), GQA
and MQA are native, ``Dv != D`` (MLA) is passed as is. Sinks never reach a local kernel (they
enter at the final merge). A geometry cuDNN refuses to build falls back to the flash kernels
(or the reference where they cannot express it), with one logged line per refused graph. The
backward reads the final lse as ragged stats where the engine takes them, else as padded ones.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, NamedTuple

import torch

from . import cudnn_args as ca

__all__ = ["available", "supports", "attn_fwd", "attn_bwd", "graph_counts", "graph_key"]
__all__ += ["fwd_buffers", "bwd_buffers", "MIN_BACKEND", "MAX_HEAD_DIM"]

log = logging.getLogger("megatron_cp_ext.kernels")

MIN_BACKEND = 91002
"""cuDNN 9.10.2: the first release with diagonal bands on ragged (THD) batches."""
MAX_HEAD_DIM = 256
BATCH_FLOOR, SEQ_FLOOR, TOKENS_FLOOR = 32, 8192, 8192
"""Smallest buckets of the entries, the length bound and the packed tokens of a call."""
SEQ_SPAN = 8
"""The length bound is the call's tokens, at most SEQ_SPAN x its longest entry: a looser bound
costs cuDNN nothing measurable up to 16x the longest entry (H200, 128K tokens, causal: 9.64 ms
forward, 29.74 ms backward with the longest entry as the bound; 9.72 and 29.83 ms with 16x it;
9.46 and 29.94 ms with 4x the entries), and a bound that follows the tokens rather than the
longest entry lets a training run reuse a handful of graphs (:func:`graph_key`)."""


def _module() -> Any:
    try:
        import cudnn  # noqa: PLC0415 - optional: cudnn-frontend
    except Exception:  # not installed, or no loadable libcudnn behind it
        return None
    return cudnn


@functools.cache
def available() -> bool:
    """cudnn-frontend imports, a CUDA device is present and its cuDNN has ragged bands."""
    mod = _module() if torch.cuda.is_available() else None
    try:
        return mod is not None and int(mod.backend_version()) >= MIN_BACKEND
    except Exception:
        return False


def supports(dtype: torch.dtype, d: int, dv: int) -> bool:
    """Whether a call is expressible (host values only): fp16/bf16, head dims multiples of 8 up
    to :data:`MAX_HEAD_DIM`; every mask of the contract."""
    return dtype in (torch.float16, torch.bfloat16) and d % 8 == 0 and dv % 8 == 0 and max(d, dv) <= MAX_HEAD_DIM


class _U(IntEnum):
    """Tensor ids of the graphs' operands."""

    Q, K, V, O, STATS, DO, DQ, DK, DV = range(1, 10)  # noqa: E741 - O: the output
    LEN_Q, LEN_K, OFF_Q, OFF_K, OFF_V, OFF_O, OFF_STATS = range(10, 17)


@dataclass(frozen=True)
class _Key:
    """Everything a built graph depends on (bucketed: :mod:`.cudnn_args`)."""

    bwd: bool
    dtype: torch.dtype
    batch: int
    hq: int
    hk: int
    sq: int
    sk: int
    d: int
    dv: int
    scale: float
    band: ca.Band
    ragged_stats: bool
    top_left: bool = False
    """Every entry has as many queries as keys (``cu_seqlens_k is cu_seqlens_q``): the band is
    anchored top-left, the same mask, and cuDNN's backward then skips the masked tiles (the
    bottom-right one computes them: 53.6 against 30.7 ms, causal, 128K tokens, H200)."""
    tq: int = 0
    """Bucketed packed query tokens (backward: sizes its dQ accumulator)."""
    tk: int = 0
    deterministic: bool = False
    device: int | None = 0


class _Built(NamedTuple):
    graph: Any
    workspace: int
    uids: tuple[int, ...]


_GRAPHS: dict[_Key, _Built | None] = {}
_BUILD_LOCK = threading.Lock()
_TLS = threading.local()
_COUNTS = {"fwd": 0, "bwd": 0, "refused": 0, "build_s": 0.0}
_STATE = {"ragged_stats_bwd": True}
"""Whether the backward takes ragged stats; turned off (once, logged) if the engine refuses."""


def graph_counts() -> dict:
    """Graphs built so far (forward, backward), refused, and the seconds spent building."""
    return dict(_COUNTS)


def _handle(mod: Any, device: torch.device) -> Any:
    """This thread's cuDNN handle for ``device``, on torch's current stream (handles are not
    thread-safe; the in-process runner's ranks are threads)."""
    handles = getattr(_TLS, "handles", None)
    if handles is None:
        handles = _TLS.handles = {}
    h = handles.get(device.index)
    if h is None:
        with torch.cuda.device(device):
            h = handles[device.index] = mod.create_handle()
    mod.set_stream(handle=h, stream=torch.cuda.current_stream(device).cuda_stream)
    return h


def _build(mod: Any, key: _Key, handle: Any) -> _Built:
    io = {torch.float16: mod.data_type.HALF, torch.bfloat16: mod.data_type.BFLOAT16}[key.dtype]
    f32 = mod.data_type.FLOAT
    g = mod.pygraph(handle=handle, io_data_type=io, intermediate_data_type=f32, compute_data_type=f32)
    b, hq, hk, sq, sk = key.batch, key.hq, key.hk, key.sq, key.sk

    def rows(name: str, uid: int, h: int, s: int, dim: int, dtype: Any = io) -> Any:
        """A token-major ``[B, H, S, D]`` descriptor (entries located by ragged offsets)."""
        return g.tensor(name=name, dim=[b, h, s, dim], stride=[s * h * dim, dim, h * dim, 1], data_type=dtype, uid=uid)

    def column(name: str, uid: int, n: int, dtype: Any) -> Any:
        return g.tensor(name=name, dim=[n, 1, 1, 1], stride=[1, 1, 1, 1], data_type=dtype, uid=uid)

    def output(t: Any, uid: int, h: int, s: int, dim: int, dtype: Any = io) -> Any:
        t.set_uid(uid).set_output(True).set_dim([b, h, s, dim]).set_stride([s * h * dim, dim, h * dim, 1])
        return t.set_data_type(dtype)

    len_q, len_k = column("len_q", _U.LEN_Q, b, mod.data_type.INT32), column("len_k", _U.LEN_K, b, mod.data_type.INT32)
    ragged_stats = not key.bwd or key.ragged_stats
    off = {u: column(u.name.lower(), u, b + 1, mod.data_type.INT64)
           for u in (_U.OFF_Q, _U.OFF_K, _U.OFF_V, _U.OFF_O) + ((_U.OFF_STATS,) if ragged_stats else ())}  # fmt: skip
    q, k, v = rows("q", _U.Q, hq, sq, key.d), rows("k", _U.K, hk, sk, key.d), rows("v", _U.V, hk, sk, key.dv)
    for t, u in ((q, _U.OFF_Q), (k, _U.OFF_K), (v, _U.OFF_V)):
        t.set_ragged_offset(off[u])
    right = key.band.bottom_right and not key.top_left
    align = mod.diagonal_alignment.BOTTOM_RIGHT if right else mod.diagonal_alignment.TOP_LEFT
    bounds = dict(diagonal_band_left_bound=key.band.left_bound, diagonal_band_right_bound=key.band.right_bound)
    mask = dict(use_padding_mask=True, seq_len_q=len_q, seq_len_kv=len_k, diagonal_alignment=align, **bounds)
    uids = [_U.Q, _U.K, _U.V, _U.O, _U.STATS, _U.LEN_Q, _U.LEN_K, _U.OFF_Q, _U.OFF_K, _U.OFF_V, _U.OFF_O]
    if not key.bwd:
        o, stats = g.sdpa(name="fwd", q=q, k=k, v=v, generate_stats=True, attn_scale=key.scale, **mask)
        output(o, _U.O, hq, sq, key.dv).set_ragged_offset(off[_U.OFF_O])
        output(stats, _U.STATS, hq, sq, 1, f32)  # token-major [T, H, 1]
        stats.set_ragged_offset(off[_U.OFF_STATS])
        uids.append(_U.OFF_STATS)
    else:
        o, do = rows("o", _U.O, hq, sq, key.dv), rows("do", _U.DO, hq, sq, key.dv)
        stats = g.tensor(name="stats", dim=[b, hq, sq, 1], stride=[sq * hq, 1, hq, 1], data_type=f32, uid=_U.STATS)
        for t, u in ((o, _U.OFF_O), (do, _U.OFF_O)) + (((stats, _U.OFF_STATS),) if key.ragged_stats else ()):
            t.set_ragged_offset(off[u])
        grads = g.sdpa_backward(
            name="bwd", q=q, k=k, v=v, o=o, dO=do, stats=stats, attn_scale=key.scale,
            max_total_seq_len_q=key.tq, max_total_seq_len_kv=key.tk,
            use_deterministic_algorithm=key.deterministic, **mask,
        )  # fmt: skip
        for t, uid, h, s, dim, u in zip(grads, (_U.DQ, _U.DK, _U.DV), (hq, hk, hk), (sq, sk, sk),
                                        (key.d, key.d, key.dv), (_U.OFF_Q, _U.OFF_K, _U.OFF_V)):  # fmt: skip
            output(t, uid, h, s, dim).set_ragged_offset(off[u])
        uids += [_U.DO, _U.DQ, _U.DK, _U.DV] + ([_U.OFF_STATS] if key.ragged_stats else [])
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([mod.heur_mode.A, mod.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()
    return _Built(graph=g, workspace=int(g.get_workspace_size()), uids=tuple(int(u) for u in uids))


def _graph(mod: Any, key: _Key, handle: Any) -> _Built | None:
    """The cached graph of ``key``, built on first use; None (logged once) if cuDNN refuses it."""
    if key in _GRAPHS:
        return _GRAPHS[key]
    with _BUILD_LOCK:
        if key in _GRAPHS:
            return _GRAPHS[key]
        t0 = time.perf_counter()
        try:
            built = _build(mod, key, handle)
        except Exception as exc:  # cuDNN says why: not supported, bad dims, no engine
            built = None
            _COUNTS["refused"] += 1
            log.warning("cudnn candidate: graph refused, falling back (%s): %s", key, str(exc).splitlines()[0][:300])
        _COUNTS["bwd" if key.bwd else "fwd"] += built is not None
        _COUNTS["build_s"] += time.perf_counter() - t0
        _GRAPHS[key] = built
        return built


def _dense(x: torch.Tensor) -> torch.Tensor:
    return x if x.is_contiguous() else x.contiguous()


def graph_key(
    *,
    bwd: bool,
    dtype: torch.dtype,
    entries: int,
    tokens_q: int,
    tokens_k: int,
    max_q: int,
    max_k: int,
    hq: int,
    hk: int,
    d: int,
    dv: int,
    causal: bool,
    window: tuple[int, int],
    scale: float,
    same_entries: bool,
    ragged_stats: bool = True,
    deterministic: bool = False,
    device: int | None = 0,
) -> _Key:
    """The graph a call runs on, from host values only (what the cache is keyed by): entries,
    length bound (:data:`SEQ_SPAN`) and tokens rounded up to powers of two
    (:func:`.cudnn_args.bucket`); ``same_entries``: every entry has as many keys as queries."""
    return _Key(
        bwd=bwd, dtype=dtype, batch=ca.bucket(entries, BATCH_FLOOR), hq=hq, hk=hk,
        sq=ca.bucket(min(tokens_q, SEQ_SPAN * max_q), SEQ_FLOOR),
        sk=ca.bucket(min(tokens_k, SEQ_SPAN * max_k), SEQ_FLOOR), d=d, dv=dv, scale=float(scale),
        band=ca.band(causal, window), ragged_stats=ragged_stats, top_left=same_entries and max_q == max_k,
        tq=ca.bucket(tokens_q, TOKENS_FLOOR) if bwd else 0, tk=ca.bucket(tokens_k, TOKENS_FLOOR) if bwd else 0,
        deterministic=deterministic, device=device,
    )  # fmt: skip


def _key(q, k, v, cu_q, cu_k, max_q, max_k, causal, window, scale, **kw) -> _Key:
    """:func:`graph_key` of a call (``cu_k is cu_q``: the plans' one tensor for equal entries)."""
    return graph_key(
        dtype=q.dtype, entries=cu_q.numel() - 1, tokens_q=q.shape[0], tokens_k=k.shape[0], max_q=max_q,
        max_k=max_k, hq=q.shape[1], hk=k.shape[1], d=q.shape[-1], dv=v.shape[-1], causal=causal, window=window,
        scale=scale, same_entries=cu_k is cu_q, device=q.device.index, **kw,
    )  # fmt: skip


def _offsets(key: _Key, cu_q: torch.Tensor, cu_k: torch.Tensor) -> dict[int, torch.Tensor]:
    hq, hk = key.hq, key.hk
    rq = ca.ragged(cu_q, key.batch, (hq * key.d, hq * key.dv, hq))
    rk = ca.ragged(cu_k, key.batch, (hk * key.d, hk * key.dv))
    # An entry with queries but no keys: cuDNN leaves garbage in its rows, so it gets no query
    # rows either and its rows keep the zeros / -inf they were allocated with.
    len_q = rq.lengths * (rk.lengths > 0)
    return {_U.LEN_Q: len_q, _U.LEN_K: rk.lengths, _U.OFF_Q: rq.offsets[0], _U.OFF_O: rq.offsets[1],
            _U.OFF_STATS: rq.offsets[2], _U.OFF_K: rk.offsets[0], _U.OFF_V: rk.offsets[1]}  # fmt: skip


def _run(mod: Any, built: _Built, handle: Any, buffers: dict[int, torch.Tensor], device: torch.device) -> None:
    ws = torch.empty(max(built.workspace, 1), dtype=torch.uint8, device=device)
    built.graph.execute([buffers[u] for u in built.uids], ws, handle=handle, tensor_uids=built.uids)


def _fallback():
    from . import flash, reference

    return flash, reference


def attn_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window, scale):
    n, hq, dv = q.shape[0], q.shape[1], v.shape[-1]
    if n == 0 or k.shape[0] == 0:  # nothing to compute: the contract's empty rows
        return q.new_zeros(n, hq, dv), torch.full((n, hq), float("-inf"), device=q.device)
    mod = _module()
    q, k, v = _dense(q), _dense(k), _dense(v)
    key = _key(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window, scale, bwd=False,
               ragged_stats=True)  # fmt: skip
    h = _handle(mod, q.device)
    built = _graph(mod, key, h)
    if built is None:
        flash, reference = _fallback()
        ok = flash.supports(causal, window, q.dtype, q.shape[-1], dv)
        return (flash if ok else reference).attn_fwd(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window, scale
        )
    bufs = fwd_buffers(key, q, k, v, cu_seqlens_q, cu_seqlens_k)
    _run(mod, built, h, bufs, q.device)
    return bufs[_U.O], ca.contract_lse(bufs[_U.STATS])


def fwd_buffers(key: _Key, q, k, v, cu_q, cu_k) -> dict[int, torch.Tensor]:
    """Every operand of the forward graph by tensor id, outputs allocated (device ops only)."""
    n, hq, dv = q.shape[0], q.shape[1], v.shape[-1]
    # zeros / -inf: the contract's rows where an entry has no keys (see _offsets). Equal entries
    # (top-left) have none, and cuDNN writes every row: no fill (a memset of out is 0.32 ms at
    # 128K tokens, 3 % of the causal forward, H200).
    out = q.new_empty((n, hq, dv)) if key.top_left else q.new_zeros((n, hq, dv))
    stats = q.new_empty((n, hq, 1), dtype=torch.float32)
    if not key.top_left:
        stats.fill_(float("-inf"))
    return {_U.Q: q, _U.K: k, _U.V: v, _U.O: out, _U.STATS: stats, **_offsets(key, cu_q, cu_k)}


def _bwd_graph(mod, h, q, k, v, cu_q, cu_k, max_q, max_k, causal, window, scale) -> tuple[_Key, _Built | None]:
    """The backward graph: ragged stats while the engine takes them, else padded ones."""
    kw = dict(bwd=True, deterministic=torch.are_deterministic_algorithms_enabled())
    if _STATE["ragged_stats_bwd"]:
        key = _key(q, k, v, cu_q, cu_k, max_q, max_k, causal, window, scale, ragged_stats=True, **kw)
        built = _graph(mod, key, h)
        if built is not None:
            return key, built
        _STATE["ragged_stats_bwd"] = False
        log.warning("cudnn candidate: backward with ragged stats refused; padded stats from now on")
    key = _key(q, k, v, cu_q, cu_k, max_q, max_k, causal, window, scale, ragged_stats=False, **kw)
    return key, _graph(mod, key, h)


def attn_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window, scale):
    if q.shape[0] == 0 or k.shape[0] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    mod = _module()
    q, k, v, out = _dense(q), _dense(k), _dense(v), _dense(out)
    h = _handle(mod, q.device)
    key, built = _bwd_graph(
        mod, h, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window, scale
    )
    args = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window, scale)
    if built is None:
        flash, reference = _fallback()
        ok = flash.supports(causal, window, q.dtype, q.shape[-1], v.shape[-1])
        return (flash if ok else reference).attn_bwd(dout, q, k, v, out, lse, *args)
    bufs = bwd_buffers(key, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
    _run(mod, built, h, bufs, q.device)
    return bufs[_U.DQ], bufs[_U.DK], bufs[_U.DV]


def bwd_buffers(key: _Key, dout, q, k, v, out, lse, cu_q, cu_k) -> dict[int, torch.Tensor]:
    """Every operand of the backward graph by tensor id, gradients allocated (device ops only)."""
    # A row that sees no key anywhere has lse -inf; +inf makes every probability of it exp(-inf) = 0.
    lse = lse.float().masked_fill(lse == float("-inf"), float("inf"))
    if key.ragged_stats:
        stats = _dense(lse).view(lse.shape[0], lse.shape[1], 1)
    else:
        stats = ca.padded_stats(lse, cu_q, key.batch, key.sq)
    dq = torch.empty_like(q) if key.top_left else torch.zeros_like(q)  # see fwd_buffers
    return {_U.Q: q, _U.K: k, _U.V: v, _U.O: out, _U.DO: _dense(dout.to(q.dtype)), _U.STATS: stats,
            _U.DQ: dq, _U.DK: torch.empty_like(k), _U.DV: torch.empty_like(v), **_offsets(key, cu_q, cu_k)}  # fmt: skip

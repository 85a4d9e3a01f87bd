"""Cross-rank agreement: the signature every CP rank exchanges before it trusts a plan.

What one rank cannot see alone — another rank's comm type, dtype, head counts, scale,
backend, mask, sharding, token count, whether it will run a backward — is packed into a
fixed-length integer *signature* and all-gathered once per new signature (every call in
check mode). Every rank then runs the same comparison over the same list, so a mismatch
raises the same :class:`~.validation.CPRankMismatchError` with the same message everywhere.

The exchange runs on one group every rank can name whatever comm type it was given: the
whole CP group (the default group when the CP group spans the world, else the group passed,
or ``HierarchicalCPGroups.cp_group`` for ``a2a+p2p``). A rank whose own arguments are invalid
still joins it with an error flag (bounded by :data:`ERROR_WAIT_S`), and every rank raises
that rank's error — the same class and message — instead of leaving the others waiting.
"""

from __future__ import annotations

import struct
import zlib
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist

from .comm import exchange_ints
from .groups import CPGroups, peek_groups, ranks_crc
from .validation import DTYPES, CPArgumentError, CPArgumentTypeError, CPRankMismatchError

__all__ = ["FIELDS", "ERROR_WAIT_S", "ExchangePath", "exchange_path", "signature", "agree", "raise_everywhere"]

ERROR_WAIT_S = 60.0
"""How long a rank with an invalid argument waits for the others to join the exchange before
raising its error alone (they may be running attention on a cached plan; see check mode)."""

_MAGIC = 0x4D4358_0E  # "MCX", signature layout 14: a rank with another layout never matches
_MSG_LEN = 1024

FIELDS = (
    "magic", "error", "global_rank", "cp_rank", "comm_type", "cp_size", "a2a_size",
    "a2a_name", "a2a_members", "p2p_name", "p2p_members", "qkv_format", "check", "batch", "seq_local",
    "dtype", "device", "hq", "hkv", "dqk", "dv", "causal", "left", "right", "chunk", "scale", "backend",
    "grad", "sink", "cu_crc", "total_tokens", "num_seqs", "seg_crc", "tokens", "rank_tokens", "max_logit", "auto",
    "schedule",
)  # fmt: skip
"""Signature layout (one int64 each); -1 where an erroring rank could not tell."""

_ERROR_CLASSES = {1: CPArgumentError, 2: CPArgumentTypeError, 3: CPRankMismatchError}


def signature(**fields: int) -> tuple[int, ...]:
    """The signature vector; unknown fields are -1."""
    unknown = set(fields) - set(FIELDS)
    assert not unknown, unknown
    return tuple([_MAGIC] + [int(fields.get(f, -1)) for f in FIELDS[1:]])


def sink_field(offset, check: bool) -> int:
    """The ``sink`` field: 0 without ``softmax_offset``, 1 with one; in check mode 2 + a crc of
    its values, so that ranks passing different sinks (a learned offset out of sync) are told
    apart. Reading the values syncs with the device: check mode syncs anyway, the default
    compares presence only."""
    if offset is None:
        return 0
    if not check:
        return 1
    return 2 + zlib.crc32(offset.detach().to("cpu", torch.float64).numpy().tobytes())


def float_bits(x: float) -> int:
    """A float as the int64 of its IEEE bits (exact comparison across ranks)."""
    return struct.unpack("<q", struct.pack("<d", x))[0]


# ---- where the exchange runs ------------------------------------------------------------------
@dataclass(frozen=True)
class ExchangePath:
    """One agreed group, or (a hierarchical pair without its whole group) a2a then p2p."""

    group: object = None
    a2a: object = None
    p2p: object = None


def exchange_path(groups: CPGroups | None, cp_size: int | None) -> ExchangePath | None:
    """The group every CP rank exchanges on, or None when there is nobody to talk to."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    # The group this rank passed is where its peers exchange; only without one (or with
    # cp_group=None, CP size 1) does the sharding's CP size stand in. A bad call may pass a
    # group and a sharding that disagree: a sharding for the world size with a CP group of a
    # data-parallel replica must not send its error over the world while its CP peers wait.
    size = groups.size if groups is not None and groups.size > 1 else cp_size
    if size == dist.get_world_size() > 1:
        return ExchangePath(group=dist.group.WORLD)  # the CP group is the world: every rank can name it
    if groups is None or groups.size <= 1:
        return None
    if groups.whole is not None:
        return ExchangePath(group=groups.whole)
    return ExchangePath(a2a=groups.a2a, p2p=groups.p2p)


def _gather(values: list[int], path: ExchangePath, timeout: float | None) -> list[list[int]]:
    if path.group is not None:
        return exchange_ints(values, path.group, timeout=timeout)
    rows = exchange_ints(values, path.a2a, timeout=timeout) if path.a2a is not None else [values]
    if path.p2p is None:
        return rows
    # Second stage: every p2p peer contributes its whole a2a group's rows, so every rank ends
    # up with all CP ranks' rows.
    n = len(values)
    flat = exchange_ints([x for r in rows for x in r], path.p2p, timeout=timeout)
    return [f[i : i + n] for f in flat for i in range(0, len(f), n)]


def _encode(text: str) -> list[int]:
    data = text.encode()[: _MSG_LEN - 1]
    return [len(data), *data] + [0] * (_MSG_LEN - 1 - len(data))


def _decode(values: list[int]) -> str:
    return bytes(values[1 : 1 + values[0]]).decode(errors="replace")


# ---- errors found on some rank -----------------------------------------------------------------
def _who(sig: dict) -> str:
    c, g = sig["cp_rank"], sig["global_rank"]
    return f"global rank {g}" if c < 0 else f"CP rank {c}" if c == g else f"CP rank {c} (global rank {g})"


def _raise_reported(sigs: list[dict], path: ExchangePath, own: str, timeout: float | None) -> None:
    """If any rank flagged an error, fetch the messages (a second exchange) and raise the
    lowest rank's error, identically on every rank."""
    bad = [s for s in sigs if s["error"] > 0]
    if not bad:
        return
    texts = _gather(_encode(own), path, timeout)
    by_rank = {(s["global_rank"]): _decode(t) for s, t in zip(sigs, texts)}
    bad.sort(key=lambda s: (s["cp_rank"] < 0, s["cp_rank"], s["global_rank"]))
    first = bad[0]
    where = _who(first)
    if len(bad) > 1:
        where += f" (and {', '.join(_who(s) for s in bad[1:])})"
    cls = _ERROR_CLASSES.get(first["error"], CPArgumentError)
    raise cls(f"{by_rank[first['global_rank']]} [input rejected on {where}; raised on every CP rank]")


def raise_everywhere(
    err: Exception,
    groups: CPGroups | None,
    cp_size: int | None,
    cp_rank: int = -1,
    wait: float | None = None,
    cp_group: object = None,
    also: Sequence[object] = (),
) -> None:
    """Raise a rank's own argument error on every CP rank (it never returns).

    The rank joins the exchange with an error flag; ranks that exchange at the same time
    (first call of a micro-batch, or check mode) see the flag and raise the same error. If no
    rank joins within ``wait`` seconds (default :data:`ERROR_WAIT_S`), or there is no group to
    talk on, it raises alone. ``cp_group``: the argument as passed, for a validation that
    failed before it resolved ``groups`` (an unknown comm type, a missing sharding): its
    groups are still where the peers exchange.

    A group and a sharding for the world size that disagree leave two candidates: the group
    (its CP peers, with a sharding built for the world by mistake) and the world (every other
    rank, this one having passed a smaller group by mistake). The rank tries its group first
    and the world after half the wait. ``also``: further groups whose ranks may wait for this
    one (Megatron's hybrid CP sub-groups a call's params name), tried after them, in order.
    """
    wait = ERROR_WAIT_S if wait is None else wait
    if groups is None and cp_group is not None:
        groups = peek_groups(cp_group)
        cp_rank = groups.rank if groups is not None else cp_rank
    paths = [exchange_path(groups, cp_size)]
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if paths[0] is not None and paths[0].group is not dist.group.WORLD and cp_size == world > 1:
        paths.append(ExchangePath(group=dist.group.WORLD))
    paths = [p for p in paths if p is not None]
    ranks = [cp_rank] * len(paths)  # on a sub-group of ``also``: this rank's place in it
    for g in also:
        if all(g is not p.group for p in paths):
            paths.append(ExchangePath(group=g))
            ranks.append(dist.get_rank(g))
    if not paths:
        raise err
    code = 2 if isinstance(err, TypeError) else 3 if isinstance(err, CPRankMismatchError) else 1
    for path, rank in zip(paths, ranks):
        sig = signature(error=code, global_rank=dist.get_rank(), cp_rank=rank)
        try:
            sigs = [dict(zip(FIELDS, s)) for s in _gather(list(sig), path, wait / len(paths))]
            _raise_reported(sigs, path, str(err), wait)
        except CPArgumentError as everywhere:
            raise everywhere from err  # keep this rank's own traceback
        except TimeoutError:
            continue
    err.add_note(
        f"(no other CP rank joined the consistency exchange within {wait}s: they may be "
        "running attention on a cached plan; pass check=True on every rank to compare every call)"
    )
    raise err from None


# ---- comparing valid signatures ----------------------------------------------------------------
_COMM = ("p2p", "all_gather", "a2a", "a2a+p2p")
_FORMATS = ("thd", "bshd", "sbhd")
_BACKENDS = ("reference", "flash")
_DEVICES = ("cpu", "cuda")


def _name(names: tuple) -> Callable[[int], str]:
    return lambda i: repr(names[i]) if 0 <= i < len(names) else f"<{i}>"


def _scale(bits: int) -> str:
    return repr(struct.unpack("<d", struct.pack("<q", bits))[0])


# (fields compared together, the argument they come from, a note, how to show a value)
_AGREE: list[tuple[tuple[str, ...], str, str, Callable]] = [
    (("comm_type",), "comm_type", "", _name(_COMM)),
    (("cp_size",), "cp_group", " (number of CP ranks)", str),
    (("a2a_size",), "cp_group", " (a2a group size)", str),
    (("qkv_format",), "qkv_format", "", _name(_FORMATS)),
    (("check",), "check", "", lambda x: repr(bool(x))),
    (("max_logit",), "return_max_logit", " (the max-logit all-reduce)", lambda x: repr(bool(x))),
    (("batch",), "q", " (batch size, bshd/sbhd)", str),
    (("seq_local",), "q", " (local sequence length, bshd/sbhd)", str),
    (("dtype",), "dtype", " (of q, k, v)", _name(tuple(str(d) for d in DTYPES))),
    (("device",), "device", " (type, of q, k, v)", _name(_DEVICES)),
    (("hq",), "q", " (number of heads)", str),
    (("hkv",), "k/v", " (number of heads)", str),
    (("dqk",), "q/k", " (head dim)", str),
    (("dv",), "v", " (head dim)", str),
    (("causal",), "causal", "", lambda x: repr(bool(x))),
    (("left", "right"), "window_size", "", lambda x: repr(x)),
    (("chunk",), "chunk_size", "", lambda x: "None" if x == 0 else str(x)),
    (("scale",), "softmax_scale", " (resolved: None means 1/sqrt(head_dim))", _scale),
    (("backend",), "backend", " (resolved)", _name(_BACKENDS)),
    (("grad",), "requires_grad", " (whether q, k, v or softmax_offset need gradients under grad mode)",
     lambda x: repr(bool(x))),
    (("sink",), "softmax_offset", " (a tensor or None; its values in check mode)",
     lambda x: "None" if x == 0 else "a tensor" if x == 1 else f"a tensor with values crc {x - 2:#x}"),
    (("total_tokens", "num_seqs", "cu_crc"), "cu_seqlens", " (of the sharding)",
     lambda x: f"{x[0]} tokens in {x[1]} sequences (crc {x[2]:#x})"),
    (("seg_crc",), "sharding", " (token -> rank assignment: balance or custom segments)", lambda x: f"crc {x:#x}"),
    (("schedule",), "MEGATRON_CP_EXT_P2P_SCHEDULE", " (environment; p2p rings)", _name(("staged", "ring"))),
]  # fmt: skip


def _parts(sigs: list[dict], fields: tuple[str, ...], show: Callable) -> str | None:
    """``"<value> on CP ranks [..]; ..."`` where the ranks' ``fields`` differ, else None."""
    values: dict = defaultdict(list)
    for s in sigs:
        key = s[fields[0]] if len(fields) == 1 else tuple(s[f] for f in fields)
        values[key].append(s["cp_rank"])
    if len(values) < 2:
        return None
    return "; ".join(f"{show(v)} on CP ranks {r}" for v, r in sorted(values.items(), key=lambda kv: kv[1]))


def _differs(sigs: list[dict], fields: tuple[str, ...], name: str, note: str, show: Callable) -> str | None:
    parts = _parts(sigs, fields, show)
    if parts is None:
        return None
    return f"{name} differs across CP ranks{note}: {parts}. Every CP rank must pass the same {name}"


def _layout_error(sigs: list[dict]) -> str | None:
    """CP ranks must be 0..n-1 once each, and each rank's groups the ones the layout implies."""
    n, a = sigs[0]["cp_size"], sigs[0]["a2a_size"]
    ranks = sorted(s["cp_rank"] for s in sigs)
    if ranks != list(range(n)):
        return (
            f"cp_group: the CP ranks of the {len(sigs)} ranks are {ranks}, not 0..{n - 1} once each; "
            "pass every rank its own CP group(s) (for 'a2a+p2p': CP rank = p2p rank * a2a size + a2a rank)"
        )
    glob = {s["cp_rank"]: s["global_rank"] for s in sigs}
    for s in sorted(sigs, key=lambda s: s["cp_rank"]):
        c = s["cp_rank"]
        a2a = [glob[x] for x in range((c // a) * a, (c // a + 1) * a)]
        p2p = [glob[x] for x in range(c % a, n, a)]
        for kind, members in (("a2a", a2a), ("p2p", p2p)):
            same_group = [t for t in sigs if glob[t["cp_rank"]] in members]
            if s[f"{kind}_members"] != ranks_crc(members) or len({t[f"{kind}_name"] for t in same_group}) > 1:
                return (
                    f"cp_group: the {kind} group of CP rank {c} is not the group of global ranks {members} "
                    "that the other ranks use; every rank must pass groups built together "
                    "(for 'a2a+p2p': a2a groups are consecutive CP ranks)"
                )
    order = [glob[c] for c in range(n)]
    if any(b <= a for a, b in zip(order, order[1:])):  # e.g. a plain pair passed p2p first
        return (
            f"cp_group: CP ranks 0..{n - 1} are global ranks {order}, not in global-rank order, which is the "
            "CP group's own order (new_group sorts it) and the rank the data is split by: for 'a2a+p2p' pass "
            "[a2a_group, p2p_group], a2a groups of consecutive CP ranks"
        )
    return None


def _auto_differs(sigs: list[dict], chose: str) -> NoReturn:
    """Every rank asked for ``comm_type="auto"`` and they chose differently: name the input that
    differs where one does (auto prices shapes and dtype), else auto's profile."""
    for spec in _AGREE[3:]:
        if cause := _differs(sigs, *spec):
            raise CPRankMismatchError(f"{cause} (so comm_type='auto' chose differently too)")
    raise CPRankMismatchError(
        f"comm_type='auto' chose differently across CP ranks ({chose}) with the same inputs: auto's "
        "profile differs (set_auto_profile / MCX_PLAN_PROFILE); set the same on every rank"
    )


def check_signatures(sigs: list[dict]) -> None:
    """Raise the same :class:`CPRankMismatchError` on every rank if any rank disagrees."""
    sigs = sorted(sigs, key=lambda s: (s["cp_rank"], s["global_rank"]))
    if len({s["magic"] for s in sigs}) > 1:
        raise CPRankMismatchError("megatron_cp_ext versions differ across CP ranks (signature layouts differ)")
    if all(s["auto"] == 1 for s in sigs) and (chose := _parts(sigs, ("comm_type",), _name(_COMM))):
        _auto_differs(sigs, chose)
    for spec in _AGREE[:3]:
        if msg := _differs(sigs, *spec):
            raise CPRankMismatchError(msg)
    if msg := _layout_error(sigs):
        raise CPRankMismatchError(msg)
    for spec in _AGREE[3:]:
        if msg := _differs(sigs, *spec):
            raise CPRankMismatchError(msg)
    for s in sigs:
        if s["tokens"] != s["rank_tokens"]:
            raise CPRankMismatchError(
                f"q on CP rank {s['cp_rank']} has {s['tokens']} tokens but the sharding gives that rank "
                f"{s['rank_tokens']} (shard inputs with sharding.shard(x, rank)); raised on every CP rank"
            )


def agree(sig: tuple[int, ...], path: ExchangePath) -> None:
    """Exchange this rank's signature and compare all of them (every rank raises together)."""
    sigs = [dict(zip(FIELDS, s)) for s in _gather(list(sig), path, None)]
    _raise_reported(sigs, path, "", None)
    check_signatures(sigs)


def device_index(device: torch.device) -> int:
    return _DEVICES.index(device.type) if device.type in _DEVICES else len(_DEVICES)

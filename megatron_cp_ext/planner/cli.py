"""``mcx-plan`` / ``python -m megatron_cp_ext.planner``: a CP job's per-layer cost before launch.

For every CP size x comm type x balance: max/mean work and tokens, tile efficiency, padding,
bytes per layer, kernel calls, predicted forward/backward attention time on a hardware profile
and whether comm hides; with the model's widths (``--hidden``, ``--ffn``) also the whole
layer's time per rank (linear work on its tokens plus attention), slowest rank; then the
predicted winner per CP size. See ``docs/planning.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import numpy as np
import torch

from ..inspect import COMM_TYPES, inspect_plan
from ..runtime.validation import CPArgumentError
from ..sharding import batches, shard_sequences
from .cost import LinearShape, predict
from .profiles import PROFILES, HardwareProfile, load_profile
from .rows import Row

__all__ = ["main", "build_parser", "sweep", "Row"]

BALANCES = ("workload", "dualchunk", "contiguous")
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32}  # fmt: skip


def _ints(flag: str, text: str, parser: argparse.ArgumentParser, lo: int = 0) -> list[int]:
    try:
        vals = [int(x) for x in text.replace("\n", ",").split(",") if x.strip()]
    except ValueError:
        parser.error(f"argument {flag}: expected comma-separated integers, got {text[:60]!r}")
    if not vals or min(vals) < lo:
        parser.error(f"argument {flag}: expected integers >= {lo}, got {text[:60]!r}")
    return vals


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mcx-plan", description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--lengths", help="document lengths, comma-separated (one packed micro-batch)")
    src.add_argument("--lengths-file", help="file of lengths or cu_seqlens (whitespace/comma separated)")
    src.add_argument("--dist", choices=("uniform", "lognormal", "long+short"), help="synthetic lengths")
    p.add_argument(
        "--file-format",
        choices=("auto", "lengths", "cu_seqlens"),
        default="auto",
        help="--lengths-file holds lengths or cu_seqlens (auto: cu_seqlens if it starts at 0 and ascends)",
    )
    p.add_argument("--total", type=int, default=131072, help="--dist: tokens in the micro-batch")
    p.add_argument("--median", type=int, default=2048, help="--dist: median length (short ones for long+short)")
    p.add_argument("--sigma", type=float, default=1.0, help="--dist lognormal: log-space spread")
    p.add_argument("--long", type=int, default=65536, help="--dist long+short: the long document")
    p.add_argument("--seed", type=int, default=0, help="--dist: random seed")
    p.add_argument("--cp", default="8", help="CP sizes, comma-separated (a sweep)")
    p.add_argument("--comm-type", default=",".join(COMM_TYPES), help="comm types, comma-separated")
    p.add_argument("--a2a-size", type=int, default=None, help="a2a+p2p: ranks per a2a group (default: a node's)")
    p.add_argument("--balance", default="workload", help=f"balances, comma-separated: {', '.join(BALANCES)}")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True, help="causal mask")
    p.add_argument("--window", default=None, help="sliding window L[,R] (-1 = unbounded)")
    p.add_argument("--chunk", type=int, default=None, help="chunked attention: chunk size")
    p.add_argument("--heads", type=int, default=64, help="query heads")
    p.add_argument("--kv-heads", type=int, default=8, help="KV heads")
    p.add_argument("--head-dim", type=int, default=128, help="q/k head dim")
    p.add_argument("--v-head-dim", type=int, default=None, help="v head dim (default: --head-dim)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="activation dtype")
    p.add_argument("--hidden", type=int, default=None, help="model hidden size: also predict the whole layer's time")
    p.add_argument("--ffn", type=int, default=None, help="MLP inner size one rank holds (FFN size / TP); with --hidden")
    p.add_argument("--gated-mlp", action="store_true", help="gated MLP (SwiGLU: three FFN matrices)")
    p.add_argument("--profile", default="h100-nvlink-ib400", help=f"{', '.join(PROFILES)}, or a JSON/TOML file")
    p.add_argument("--ranks-per-node", type=int, default=None, help="CP ranks per node (default: the profile's)")
    p.add_argument("--hybrid-max-seqlen", type=int, default=None,
                   help="also predict Megatron's hybrid CP (its BalancedCPScheduler, this max_seqlen_per_dp_cp_rank) "
                   "against workload at each --cp size, side by side (needs megatron-core)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--plot", default=None, help="write a PNG of per-rank work and traffic (needs matplotlib)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar on stderr (default: when stderr is a terminal)")  # fmt: skip
    return p


def _lengths(args: argparse.Namespace, p: argparse.ArgumentParser) -> list[int]:
    if args.lengths is not None:
        return _ints("--lengths", args.lengths, p)
    if args.lengths_file is not None:
        try:
            with open(args.lengths_file) as f:
                text = " ".join(f.read().split()).replace(" ", ",")
        except OSError as err:
            p.error(f"argument --lengths-file: {err.strerror}: {args.lengths_file!r}")
        vals = _ints("--lengths-file", text, p)
        ascending = all(b >= a for a, b in zip(vals, vals[1:], strict=False))
        cu = args.file_format == "cu_seqlens" or (args.file_format == "auto" and vals[0] == 0 and ascending)
        if cu and not ascending:
            p.error("argument --lengths-file: cu_seqlens must be non-decreasing")
        return [b - a for a, b in zip(vals, vals[1:], strict=False)] if cu else vals
    for flag, val in (("--total", args.total), ("--median", args.median), ("--long", args.long)):
        if val < 1:
            p.error(f"argument {flag}: must be >= 1, got {val}")
    if args.dist == "uniform":
        return batches.uniform(args.total, median=args.median, seed=args.seed)
    if args.dist == "lognormal":
        if not math.isfinite(args.sigma) or args.sigma < 0:
            p.error(f"argument --sigma: must be a finite number >= 0, got {args.sigma}")
        return batches.lognormal(args.total, median=args.median, sigma=args.sigma, seed=args.seed)
    if args.long + 157 > args.total:  # batches.long_short's 157 short documents of at least one token
        p.error(f"argument --total: {args.total} cannot hold --long {args.long} and 157 short documents")
    return batches.long_short(args.total, long=args.long, short_median=args.median, seed=args.seed)


def _validate(args: argparse.Namespace, p: argparse.ArgumentParser) -> dict:
    cps = _ints("--cp", args.cp, p, lo=1)
    comms = [c.strip() for c in args.comm_type.split(",") if c.strip()]
    bad = [c for c in comms if c not in COMM_TYPES]
    if bad or not comms:
        p.error(f"argument --comm-type: unknown {bad or comms} (choose from {', '.join(COMM_TYPES)})")
    bals = [b.strip() for b in args.balance.split(",") if b.strip()]
    if not bals or any(b not in BALANCES for b in bals):
        p.error(f"argument --balance: expected some of {', '.join(BALANCES)}, got {args.balance!r}")
    for flag, val in (("--heads", args.heads), ("--kv-heads", args.kv_heads), ("--head-dim", args.head_dim)):
        if val < 1:
            p.error(f"argument {flag}: must be >= 1, got {val}")
    if args.heads % args.kv_heads:
        p.error(f"argument --kv-heads: {args.kv_heads} must divide --heads {args.heads}")
    if args.v_head_dim is not None and args.v_head_dim < 1:
        p.error(f"argument --v-head-dim: must be >= 1, got {args.v_head_dim}")
    window = (-1, -1)
    if args.window is not None:
        w = (
            [int(x) for x in args.window.split(",")]
            if all(x.strip().lstrip("-").isdigit() for x in args.window.split(","))
            else []
        )
        if len(w) not in (1, 2) or min(w) < -1:
            p.error(f"argument --window: expected L or L,R with values >= -1, got {args.window!r}")
        window = (w[0], w[1] if len(w) == 2 else (0 if args.causal else -1))
    if (args.hidden is None) != (args.ffn is None):
        p.error(f"argument {'--ffn' if args.ffn is None else '--hidden'}: --hidden and --ffn go together")
    for flag, val in (("--hidden", args.hidden), ("--ffn", args.ffn)):
        if val is not None and val < 1:
            p.error(f"argument {flag}: must be >= 1, got {val}")
    linear = LinearShape(hidden=args.hidden, ffn=args.ffn, gated=args.gated_mlp) if args.hidden else None
    if args.chunk is not None and args.chunk < 1:
        p.error(f"argument --chunk: must be >= 1, got {args.chunk}")
    if args.a2a_size is not None and (args.a2a_size < 1 or all(cp % args.a2a_size for cp in cps)):
        p.error(f"argument --a2a-size: {args.a2a_size} divides none of the CP sizes {cps}")
    try:
        prof = load_profile(args.profile)
        if args.ranks_per_node is not None:
            prof = load_profile(prof, ranks_per_node=args.ranks_per_node)
    except (ValueError, OSError) as err:
        flag = "--ranks-per-node" if args.ranks_per_node is not None and args.profile in PROFILES else "--profile"
        p.error(f"argument {flag}: {err}")
    lengths = _lengths(args, p)
    if sum(lengths) < 1:
        p.error("the lengths hold no tokens")
    mask = dict(causal=args.causal, window_size=window, chunk_size=args.chunk)
    if args.hybrid_max_seqlen is not None and args.hybrid_max_seqlen < 1:
        p.error(f"argument --hybrid-max-seqlen: must be >= 1, got {args.hybrid_max_seqlen}")
    return dict(lengths=lengths, cps=cps, comms=comms, balances=bals, mask=mask, profile=prof, linear=linear)


def _a2a_for(comm: str, cp: int, a2a_size: int | None, prof: HardwareProfile) -> int | None:
    if comm != "a2a+p2p":
        return None
    a = a2a_size or min(prof.ranks_per_node, cp)
    return a if cp % a == 0 else None


def sweep(cfg: dict, shapes: dict, a2a_size: int | None = None, progress=None) -> list[Row]:
    """Plan and predict every configuration of ``cfg`` (from the parser) with ``shapes``."""
    rows, prof = [], cfg["profile"]
    todo = [(cp, c, b) for cp in cfg["cps"] for b in cfg["balances"] for c in cfg["comms"]]
    cu = batches.cu_seqlens(cfg["lengths"])
    shardings = {}
    for i, (cp, comm, bal) in enumerate(todo):
        if progress:
            progress(i, len(todo), f"cp {cp} {comm} {bal}")
        a = _a2a_for(comm, cp, a2a_size, prof)
        if comm == "a2a+p2p" and a is None:
            continue
        if (cp, bal) not in shardings:
            shardings[(cp, bal)] = shard_sequences(cu, cp, bal, **cfg["mask"])
        rep = inspect_plan(shardings[(cp, bal)], comm, a2a_size=a, **cfg["mask"], **shapes)
        linear = cfg.get("linear")
        cost = predict(rep, prof, linear)
        rk = list(rep.ranks.values())
        rows.append(Row(
            cp=cp, comm_type=comm, balance=bal, a2a_size=rep.a2a_size, max_work=max(r.work for r in rk),
            mean_work=float(np.mean([r.work for r in rk])), tile_efficiency=rep.tile_efficiency,
            padding=max(r.padding for r in rk),
            fwd_bytes=max(max(r.bytes_sent["forward"], r.bytes_received["forward"]) for r in rk),
            bwd_bytes=max(max(r.bytes_sent["backward"], r.bytes_received["backward"]) for r in rk),
            calls=max(len(r.calls) for r in rk), fwd_ms=cost.forward_s * 1e3, bwd_ms=cost.backward_s * 1e3,
            fwd_hidden=cost.hidden("forward"), bwd_hidden=cost.hidden("backward"),
            work=[r.work for r in rk], sent=[r.bytes_sent["forward"] for r in rk], tokens=rep.tokens,
            token_imbalance=rep.token_imbalance, layer_ms=cost.layer_total_s * 1e3 if linear else None,
        ))  # fmt: skip
    if progress:
        progress(len(todo), len(todo), "done")
    return rows


def _time(r: Row) -> float:
    return r.layer_ms if r.layer_ms is not None else r.fwd_ms + r.bwd_ms


def winners(rows: list[Row]) -> dict[int, Row]:
    """The row with the lowest predicted forward + backward time per CP size (whole layer when
    the model's widths are given, else attention)."""
    best: dict[int, Row] = {}
    for r in rows:
        if r.cp not in best or _time(r) < _time(best[r.cp]):
            best[r.cp] = r
    return best


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f}"


def table(rows: list[Row]) -> str:
    layer = any(r.layer_ms is not None for r in rows)
    head = ("cp", "comm", "balance", "max work", "max/mean", "tok max/mean", "tile eff", "pad", "fwd MiB", "bwd MiB",
            "calls", "fwd ms", "bwd ms", "hidden f/b", *(("layer ms",) if layer else ()), "")  # fmt: skip
    best = {id(r) for r in winners(rows).values()}
    body = [(
        str(r.cp), r.comm_type + (f"({r.a2a_size})" if r.comm_type == "a2a+p2p" else ""), r.balance,
        f"{r.max_work:.3g}", f"{r.max_work / max(r.mean_work, 1e-30):.3f}", f"{r.token_imbalance:.3f}",
        f"{r.tile_efficiency:.3f}", str(r.padding), _mb(r.fwd_bytes), _mb(r.bwd_bytes), str(r.calls),
        f"{r.fwd_ms:.3f}", f"{r.bwd_ms:.3f}", f"{'yes' if r.fwd_hidden else 'no'}/{'yes' if r.bwd_hidden else 'no'}",
        *((f"{r.layer_ms:.3f}",) if layer else ()), "<- best" if id(r) in best else "",
    ) for r in rows]  # fmt: skip
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(x, widths, strict=True)).rstrip() for x in [head, *body]]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def _hybrid(args, cfg: dict, shapes: dict, p: argparse.ArgumentParser) -> list:
    from .hybrid_cp import compare

    comms = tuple(c for c in cfg["comms"] if c != "a2a+p2p")  # hybrid sub-groups run without hierarchy
    if not comms:
        p.error("argument --hybrid-max-seqlen: compares p2p, all_gather or a2a; --comm-type names none of them")
    try:
        return [h for cp in cfg["cps"] for h in compare(
            cfg["lengths"], gpus=cp, max_seqlen_per_rank=args.hybrid_max_seqlen, comm_types=comms,
            mask=cfg["mask"], shapes=shapes, profile=cfg["profile"],
        )]  # fmt: skip
    except (ImportError, CPArgumentError) as err:
        p.error(f"argument --hybrid-max-seqlen: {err}")


def _bar(stream):
    def show(i: int, n: int, label: str) -> None:
        filled = int(30 * i / max(n, 1))
        end = "\n" if i >= n else ""
        stream.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {i}/{n} {label:<32}{end}")
        stream.flush()

    return show


def _window_value_joined(argv: list[str]) -> list[str]:
    """``--window -1,0`` as ``--window=-1,0``: argparse takes a value such as ``-1,0`` (not a
    plain negative number) for an option and would report ``--window`` without its value."""
    out: list[str] = []
    for arg in argv:
        if out and out[-1] == "--window" and arg.startswith("-") and arg[1:2].isdigit():
            out[-1] = f"--window={arg}"
        else:
            out.append(arg)
    return out


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(_window_value_joined(sys.argv[1:] if argv is None else list(argv)))
    cfg = _validate(args, p)
    shapes = dict(num_heads=args.heads, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
                  v_head_dim=args.v_head_dim, dtype=DTYPES[args.dtype])  # fmt: skip
    show = args.progress if args.progress is not None else sys.stderr.isatty()
    if args.plot:
        from .plot import check_matplotlib

        err = check_matplotlib()
        if err:
            p.error(f"argument --plot: {err}")
        folder = os.path.dirname(os.path.abspath(args.plot))
        if not os.path.isdir(folder):  # before the sweep, not after it
            p.error(f"argument --plot: folder {folder} does not exist")
    rows = sweep(cfg, shapes, args.a2a_size, _bar(sys.stderr) if show else None)
    if not rows:
        p.error("argument --a2a-size: no configuration left to plan (a2a+p2p needs a divisor of --cp)")
    best = winners(rows)
    hybrid = _hybrid(args, cfg, shapes, p) if args.hybrid_max_seqlen else []
    if args.json:
        out = {
            "profile": cfg["profile"].name, "tokens": sum(cfg["lengths"]), "documents": len(cfg["lengths"]),
            "rows": [r.__dict__ for r in rows],
            "winner": {str(cp): {"comm_type": r.comm_type, "balance": r.balance} for cp, r in best.items()},
            "hybrid": [dict(h.__dict__, ratio=h.ratio) for h in hybrid],
        }  # fmt: skip
        print(json.dumps(out, indent=1))
    else:
        prof = cfg["profile"]
        print(f"{len(cfg['lengths'])} documents, {sum(cfg['lengths'])} tokens; profile {prof.name} "
              f"({prof.description or 'user file'}); per layer, slowest rank")  # fmt: skip
        print(table(rows))
        for cp, r in best.items():
            whole = f"; whole layer {r.layer_ms:.3f} ms" if r.layer_ms is not None else ""
            print(f"cp {cp}: predicted best {r.comm_type} with {r.balance} balance "
                  f"({r.fwd_ms:.3f} ms forward + {r.bwd_ms:.3f} ms backward attention per layer{whole})")  # fmt: skip
        if hybrid:
            print(f"\nMegatron's hybrid CP (max_seqlen_per_dp_cp_rank {args.hybrid_max_seqlen}) vs workload on all "
                  f"the ranks; predicted on {prof.name}, attention forward + backward per layer:")  # fmt: skip
            for h in hybrid:
                print(f"  {h.gpus} ranks, {h.comm_type}: hybrid {h.hybrid_ms:.3f} ms ({h.groups} group(s), "
                      f"sub-samples per CP size {h.cp_sizes}), workload {h.workload_ms:.3f} ms, "
                      f"hybrid / workload {h.ratio:.3f}")  # fmt: skip
    if args.plot:
        from .plot import plot_rows

        plot_rows(rows, args.plot, title=f"{sum(cfg['lengths'])} tokens, profile {cfg['profile'].name}")
    return 0


if __name__ == "__main__":  # python -m megatron_cp_ext.planner.cli, as python -m megatron_cp_ext.planner
    raise SystemExit(main())

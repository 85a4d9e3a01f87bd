"""Each rank's peak memory on the GPU against what the accounting predicts (the suite's ``cp`` step).

Every rank of the in-process runner runs in stream mode, so it allocates on a CUDA stream of
its own; one forward+backward is measured twice on the same rank, the same way the CPU
accounting (``benchmarks/memory_launches.py``, ``tests/L1/test_accounting.py``) counts it:

* ``accounting``: the dispatch-level tracker (:class:`megatron_cp_ext.testing.accounting.Tracker`,
  one per rank thread): forward, q, k, v and all the call allocates; backward, what forward
  saved, the output, dout and all backward allocates;
* ``allocator``: the same phases from the caching allocator's trace of the rank's stream
  (:mod:`megatron_cp_ext.testing.alloc_trace`): the rise over each phase's start, on the
  accounting's base — kernel workspaces and allocator rounding included.

Both ÷ the ideal (q, k, v, out, lse), worst rank, and their ratio: where it is above 1.1 the
accounting misses something the GPU holds. ``torch.cuda.max_memory_allocated`` of the whole
process (the old figure) sums every rank's input shards and results and peaks that need not
coincide; it is printed beside them. On CPU (the suite's rehearsal) only the accounting runs.
"""

from __future__ import annotations

import numpy as np
import torch
from gpu_bench import Sizes, _batch, result

import megatron_cp_ext as mcx
from megatron_cp_ext.testing import alloc_trace
from megatron_cp_ext.testing.accounting import Tracker, add_storage, saved_bytes
from megatron_cp_ext.testing.inproc import run_threads

COMMS = ("p2p", "all_gather", "a2a", "a2a+p2p")


def _rank(rank: int, world: int, s: Sizes, comm: str, lens: list[int], full: list) -> dict:
    import torch.distributed as dist

    group = mcx.hierarchical_cp_groups(2) if comm == "a2a+p2p" else dist.group.WORLD
    sh = mcx.shard_sequences([0, *np.cumsum(lens).tolist()], world, causal=True)
    q, k, v, dout = (sh.shard(x, rank).contiguous() for x in full)
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    call = dict(cp_group=group, comm_type=comm, sharding=sh, causal=True)
    mcx.cp_attention(q, k, v, **call).backward(dout)  # plan built and agreed
    q.grad = k.grad = v.grad = None
    ideal = sum(x.nbytes for x in (q, k, v)) + q.nbytes + q.shape[0] * s.hq * 4
    tr, refs = Tracker(), {}
    tr.track(q, k, v)
    with tr, saved_bytes(refs=refs) as saved:
        out = mcx.cp_attention(q, k, v, **call)
    add_storage(saved, out)
    fwd_acc, fwd_base = tr.peak, sum(x.nbytes for x in (q, k, v))
    tr.restart(refs, dout, out)
    bwd_base = tr.live
    with tr:
        out.backward(dout)
    bwd_acc = tr.peak
    del out
    q.grad = k.grad = v.grad = None
    res = {"ideal": ideal, "fwd_acc": fwd_acc, "bwd_acc": bwd_acc, "fwd_base": fwd_base, "bwd_base": bwd_base}
    if q.is_cuda:
        torch.cuda.synchronize()
        dist.barrier()
        alloc_trace.marker(0, q.device)
        out = mcx.cp_attention(q, k, v, **call)
        alloc_trace.marker(1, q.device)
        out.backward(dout)
        del out
        alloc_trace.marker(2, q.device)
        torch.cuda.synchronize()
        res["stream"] = torch.cuda.current_stream().cuda_stream
    return res


def memory_by_rank(s: Sizes, comms=COMMS, cps=(8,)) -> None:
    lens, cu, q, k, v = _batch(s)
    full = [q, k, v, torch.randn_like(q)]
    cuda = s.device == "cuda"
    print("\n| comm | CP | fwd allocator ÷ ideal | fwd accounting ÷ ideal | bwd allocator ÷ ideal "
          "| bwd accounting ÷ ideal | allocator ÷ accounting | process peak ÷ ideal |\n"
          "|---|---|---|---|---|---|---|---|")  # fmt: skip
    worst_gap = 0.0
    for cp in cps:
        for comm in comms:
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                alloc_trace.record(True)
            try:
                out = run_threads(cp, _rank, s, comm, lens, full, device=s.device, timeout=300, streams=cuda)
                trace = alloc_trace.trace_of(q.device) if cuda else []
                process = (torch.cuda.max_memory_allocated() - base) / cp if cuda else float("nan")
            finally:
                if cuda:
                    alloc_trace.record(False)
            rows = []
            for o in out:
                grown = alloc_trace.phase_growth(trace, o["stream"]) if cuda else None
                fwd_a = (o["fwd_base"] + grown[0]) / o["ideal"] if grown else float("nan")
                bwd_a = (o["bwd_base"] + grown[1]) / o["ideal"] if grown else float("nan")
                rows.append((fwd_a, o["fwd_acc"] / o["ideal"], bwd_a, o["bwd_acc"] / o["ideal"]))
            fa, fc, ba, bc = (max(r[i] for r in rows) for i in range(4))
            gap = max(max(r[0] / r[1], r[2] / r[3]) for r in rows) if cuda else float("nan")
            worst_gap = max(worst_gap, gap) if cuda else worst_gap
            ideal = sum(o["ideal"] for o in out) / cp
            print(f"| {comm} | {cp} | {fa:.2f} | {fc:.2f} | {ba:.2f} | {bc:.2f} | {gap:.3f} | {process / ideal:.2f} |")
            result(step="memory", comm=comm, cp=cp, fwd_alloc=fa, fwd_acc=fc, bwd_alloc=ba, bwd_acc=bc, gap=gap,
                   process=process / ideal)  # fmt: skip
    if cuda:
        print(f"\nmemory: allocator ÷ accounting, worst rank and phase: {worst_gap:.3f} (goal <= 1.10)")

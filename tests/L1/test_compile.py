"""``torch.compile`` of a block that calls ``cp_attention``: every comm type at CP 1/2/4.

A small block (QKV projection -> cp_attention -> output projection) is compiled once and run
on several micro-batches of different lengths. Asserted: outputs and gradients equal the
eager block exactly, the host side is never traced (no crash in the planner), and new
micro-batches compile nothing new once token counts are dynamic.
"""

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.testing import CompileCounterWithBackend

import megatron_cp_ext as mcx
from megatron_cp_ext.testing.pool import run_on_ranks

H, D = 4, 8
MICRO_BATCHES = [(7, 30, 11), (19, 5, 40, 3), (64,)]
# dualchunk: every rank gets >= 2 tokens. A rank with 0 or 1 tokens compiles one more graph
# (PyTorch specializes sizes 0 and 1; docs/compile.md).


def _block(x, w_in, w_out, sharding, group, comm):
    t = x.shape[0]
    q, k, v = (x @ w_in).view(t, 3, H, D).unbind(1)
    o = mcx.cp_attention(q, k, v, cp_group=group, comm_type=comm, sharding=sharding)
    return o.flatten(1) @ w_out  # no Python int carried across the call (see docs/compile.md)


def _compile_worker(rank, world, comm, backend):
    group = mcx.hierarchical_cp_groups(min(2, world)) if comm == "a2a+p2p" else dist.group.WORLD
    if world == 1:
        group = None
    torch.manual_seed(0)
    w_in = torch.randn(16, 3 * H * D, dtype=torch.float64, requires_grad=True)
    w_out = torch.randn(H * D, 16, dtype=torch.float64, requires_grad=True)
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(_block, backend=counter)
    frames, errors = [], []
    for i, lens in enumerate(MICRO_BATCHES):
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        sharding = mcx.shard_sequences(cu, world, balance="dualchunk")
        g = torch.Generator().manual_seed(i)
        x_all = torch.randn(cu[-1], 16, generator=g, dtype=torch.float64)
        x = sharding.shard(x_all, rank, dim=0)
        results = []
        for fn in (_block, compiled):
            xi = x.clone().requires_grad_()
            if fn is compiled:
                torch._dynamo.mark_dynamic(xi, 0)
            y = fn(xi, w_in, w_out, sharding, group, comm)
            grads = torch.autograd.grad(y.square().sum(), (xi, w_in, w_out))
            results.append((y.detach(), *grads))
        errors.append(max(float((a - b).abs().amax()) if a.numel() else 0.0 for a, b in zip(*results)))
        frames.append(counter.frame_count)
    return frames, errors


@pytest.mark.parametrize(
    "world,comm",
    [(1, "p2p"), (2, "p2p"), (2, "all_gather"), (2, "a2a"), (4, "a2a+p2p")],
)
def test_compiled_block_equals_eager_without_recompiles(world, comm):
    res = run_on_ranks(world, _compile_worker, comm, "aot_eager", timeout=240)
    for frames, errors in res:
        assert max(errors) < 1e-12, errors
        assert frames[-1] == frames[0], f"new micro-batches compiled new graphs: {frames}"


def test_inductor_default_mode():
    """Default ``torch.compile`` (inductor, generated C++ on CPU)."""
    res = run_on_ranks(1, _compile_worker, "p2p", "inductor", timeout=400)
    for frames, errors in res:
        assert max(errors) < 1e-10, errors
        assert frames[-1] == frames[0], frames


def _call_all(cases):
    return [prepared(q, k, v) for prepared, (q, k, v) in cases]


def _fullgraph_worker(rank, world, dynamic):
    """Per case: (fullgraph?, max |prepared call - cp_attention eager| over out and grads).
    The prepared calls that claim to trace whole are compiled together as one
    ``fullgraph=True`` function (one compile: CPU compile time is what the test costs), and
    run before any eager call: nothing on the plans is made while dynamo traces (all_gather's
    kept rows were, and failed as an aliased intermediate)."""
    torch.manual_seed(0)
    x_all = torch.randn(24, 3, H, D, dtype=torch.float64)
    kws, cases = {}, {}
    for comm, cp in (("cp1", 1), ("all_gather", world), ("a2a", world), ("p2p", world)):
        sharding = mcx.shard_sequences([0, 9, 24], cp, balance="dualchunk")
        group = dist.group.WORLD if cp > 1 else None
        kws[comm] = dict(cp_group=group, comm_type="p2p" if comm == "cp1" else comm, sharding=sharding)
        qkv = tuple(t.requires_grad_() for t in sharding.shard(x_all, rank if cp > 1 else 0).clone().unbind(1))
        cases[comm] = (mcx.plan_cp_attention(*qkv, **kws[comm]), qkv)
    # p2p: one graph break; all_gather under dynamic=True: dynamo's own assertion (docs/compile.md)
    full = [c for c in cases if cases[c][0].fullgraph and not (dynamic and c == "all_gather")]
    rest = [c for c in cases if c not in full]
    compiled = torch.compile(_call_all, backend="aot_eager", fullgraph=True, dynamic=dynamic)
    # dynamic=True also makes Python floats (the softmax scale) symbolic: dynamo then traces
    # everything twice (a restart to specialize them). Shapes stay dynamic; the trace is halved.
    with torch._dynamo.config.patch(specialize_float=True):
        prepared = compiled([cases[c] for c in full]) + _call_all([cases[c] for c in rest])
    eager = [mcx.cp_attention(*cases[c][1], **kws[c]) for c in cases]
    return _compare(cases, (list(cases), eager), ([*full, *rest], prepared))


def _all_gather_micro_batches_worker(rank, world):
    """all_gather's prepared call compiled with ``dynamic=False`` over micro-batches of other
    token counts per rank (20/20, then 27/26): max |prepared - eager| per micro-batch."""
    compiled = torch.compile(lambda p, q, k, v: p(q, k, v), backend="aot_eager", fullgraph=True, dynamic=False)
    errs = []
    for i, cu in enumerate(([0, 13, 13, 14, 34, 40], [0, 13, 13, 14, 44, 51, 53])):
        sharding = mcx.shard_sequences(cu, world)
        x_all = torch.randn(cu[-1], 3, H, D, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
        qkv = tuple(t.requires_grad_() for t in sharding.shard(x_all, rank).clone().unbind(1))
        kw = dict(cp_group=dist.group.WORLD, comm_type="all_gather", sharding=sharding)
        cases = {"all_gather": (mcx.plan_cp_attention(*qkv, **kw), qkv)}
        prepared = [compiled(cases["all_gather"][0], *qkv)]
        errs.append(_compare(cases, (["all_gather"], [mcx.cp_attention(*qkv, **kw)]), (["all_gather"], prepared)))
    return errs


def test_all_gather_prepared_call_static_over_micro_batches():
    """Under the default automatic dynamic shapes the second count recompiles symbolic, and the
    ranks' graphs may gather K/V differently (docs/compile.md): ``dynamic=False`` is exact."""
    for res in run_on_ranks(2, _all_gather_micro_batches_worker, timeout=300):
        assert [r["all_gather"] for r in res] == [(True, 0.0), (True, 0.0)], res


def _compare(cases, eager, prepared):
    """Per case: (fullgraph?, max |prepared - eager| over out and q/k/v gradients); ``eager``
    and ``prepared`` are ``(case order, outputs)``, one backward each (a compiled graph has one)."""
    got = {}
    for name, (order, outs) in (("eager", eager), ("prepared", prepared)):
        inputs = [x for c in order for x in cases[c][1]]
        grads = torch.autograd.grad(sum(o.square().sum() for o in outs), inputs)
        got[name] = {c: (outs[i].detach(), *grads[3 * i : 3 * i + 3]) for i, c in enumerate(order)}
    return {
        c: (
            p.fullgraph,
            max(float((a - b).abs().max()) if a.numel() else 0.0 for a, b in zip(got["eager"][c], got["prepared"][c])),
        )
        for c, (p, _) in cases.items()
    }


def _ring_cp4_worker(rank, world):
    """Prepared calls at CP 4 on a batch where some ranks send or receive nothing in a ring
    step (the default balance, documents of length 0 and 1, a sliding window): ``p2p`` and
    ``a2a+p2p`` (a2a groups of 2, a ring of two groups) compiled together in default mode;
    per case (fullgraph?, max |prepared - eager cp_attention| over out and grads)."""
    torch.manual_seed(1)
    cu = [0, 37, 157, 157, 222, 423, 424, 460]
    x_all = torch.randn(cu[-1], 3, H, D, dtype=torch.float64)
    mask = dict(window_size=(24, 0))
    sharding = mcx.shard_sequences(cu, world, **mask)
    kws, cases = {}, {}
    for comm, group in (("p2p", dist.group.WORLD), ("a2a+p2p", mcx.hierarchical_cp_groups(2))):
        kws[comm] = dict(cp_group=group, comm_type=comm, sharding=sharding, **mask)
        qkv = tuple(t.requires_grad_() for t in sharding.shard(x_all, rank).clone().unbind(1))
        cases[comm] = (mcx.plan_cp_attention(*qkv, **kws[comm]), qkv)
    compiled = torch.compile(_call_all, backend="aot_eager")
    eager = [mcx.cp_attention(*cases[c][1], **kws[c]) for c in cases]
    return _compare(cases, (list(cases), eager), (list(cases), compiled(list(cases.values()))))


def test_prepared_ring_cp4_default_mode():
    """The rings at CP 4 (window mask, empty and one-token documents, default balance; some
    ranks idle in some steps) run behind their graph break in a compiled function and equal
    eager ``cp_attention`` exactly, forward and backward; they report ``fullgraph`` False
    (docs/compile.md: why a traced ring was withdrawn)."""
    for res in run_on_ranks(4, _ring_cp4_worker, timeout=600):
        assert not any(f for f, _ in res.values()), res
        assert all(err == 0.0 for _, err in res.values()), res


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_prepared_call_fullgraph(dynamic):
    """``plan_cp_attention`` outside, the prepared call inside: ``fullgraph=True`` (static and
    ``dynamic=True`` shapes) at CP 1 and for the comm types with traceable collectives
    (all_gather, a2a; all_gather static only) equals eager ``cp_attention`` exactly; p2p (no traceable P2P) reports that
    it keeps its graph break and runs eagerly."""
    for res in run_on_ranks(2, _fullgraph_worker, dynamic, timeout=300):
        assert {c: f for c, (f, _) in res.items()} == {"cp1": True, "all_gather": True, "a2a": True, "p2p": False}
        assert all(err == 0.0 for _, err in res.values()), res


def _idle_worker(rank, world):
    """all_gather with a rank that holds no token, a2a with a member that gets no query head."""
    torch.manual_seed(0)
    cases, kws = {}, {}
    for comm, cu, hq in (("all_gather", [0, 1], H), ("a2a", [0, 9, 24], 1)):
        sharding = mcx.shard_sequences(cu, world)
        x_all = torch.randn(cu[-1], hq, 3, D, dtype=torch.float64)
        kws[comm] = dict(cp_group=dist.group.WORLD, comm_type=comm, sharding=sharding)
        qkv = tuple(t.requires_grad_() for t in sharding.shard(x_all, rank).clone().unbind(2))
        cases[comm] = (mcx.plan_cp_attention(*qkv, **kws[comm]), qkv)
    compiled = torch.compile(_call_all, backend="aot_eager")
    prepared = compiled(list(cases.values()))
    eager = [mcx.cp_attention(*cases[c][1], **kws[c]) for c in cases]
    return _compare(cases, (list(cases), eager), (list(cases), prepared))


def test_prepared_call_keeps_its_break_where_a_rank_would_feed_nothing():
    """A traced all_gather on a rank with no token (AOT autograd dropped its gather: the other
    rank hung) and a traced a2a on a member with no query head (gloo aborted it) run behind
    their graph break instead, on every rank alike, and equal eager exactly."""
    for res in run_on_ranks(2, _idle_worker, timeout=300):
        assert res == {"all_gather": (False, 0.0), "a2a": (False, 0.0)}, res

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


def _fullgraph_worker(rank, world):
    """Per case: (fullgraph?, max |prepared call - cp_attention eager| over out and grads).
    Every prepared call is compiled together as one ``fullgraph=True`` function (one compile:
    CPU compile time is what the test costs). ``a2a+p2p`` with a2a groups of one rank is a
    ring of two groups: the traced ring under the head layout."""
    torch.manual_seed(0)
    x_all = torch.randn(24, 3, H, D, dtype=torch.float64)
    hier = mcx.hierarchical_cp_groups(1)
    kws, cases = {}, {}
    for comm, cp in (("cp1", 1), ("all_gather", world), ("a2a", world), ("p2p", world), ("a2a+p2p", world)):
        sharding = mcx.shard_sequences([0, 9, 23, 24], cp, balance="dualchunk")
        group = (hier if comm == "a2a+p2p" else dist.group.WORLD) if cp > 1 else None
        kws[comm] = dict(cp_group=group, comm_type="p2p" if comm == "cp1" else comm, sharding=sharding)
        qkv = tuple(t.requires_grad_() for t in sharding.shard(x_all, rank if cp > 1 else 0).clone().unbind(1))
        cases[comm] = (mcx.plan_cp_attention(*qkv, **kws[comm]), qkv)
    compiled = torch.compile(_call_all, backend="aot_eager", fullgraph=True)
    runs = {"eager": [mcx.cp_attention(*cases[c][1], **kws[c]) for c in cases]}
    runs["prepared"] = compiled(list(cases.values()))
    got = {}
    for name, outs in runs.items():  # one backward per run (the compiled graph has one)
        inputs = [x for c in cases for x in cases[c][1]]
        grads = torch.autograd.grad(sum(o.square().sum() for o in outs), inputs)
        got[name] = {c: (outs[i].detach(), *grads[3 * i : 3 * i + 3]) for i, c in enumerate(cases)}
    res = {}
    for comm, (prepared, _) in cases.items():
        pairs = zip(got["eager"][comm], got["prepared"][comm])
        res[comm] = (prepared.fullgraph, max(float((a - b).abs().max()) for a, b in pairs))
    return res


def test_prepared_call_fullgraph():
    """``plan_cp_attention`` outside, the prepared call inside: ``fullgraph=True`` at CP 1 and
    for every comm type (the p2p ring traced as all-to-alls, ``docs/compile.md``) equals eager
    ``cp_attention`` exactly, forward and backward."""
    for res in run_on_ranks(2, _fullgraph_worker, timeout=300):
        assert all(f for f, _ in res.values()), res
        assert all(err == 0.0 for _, err in res.values()), res


def _traced_batch_worker(rank, world):
    """``comm._traced`` run eagerly (functional collectives also run outside dynamo): mixed
    dtypes and odd byte counts, several messages per peer, and a member with nothing to send."""
    from megatron_cp_ext.comm import Message, Peers, _traced

    def payload(src, dst, i, dtype, n):
        return (torch.arange(n, dtype=torch.float64) + 1000 * src + 100 * dst + 10 * i).to(dtype)

    kinds = [(torch.bfloat16, 3), (torch.float32, 5), (torch.float64, 1), (torch.bfloat16, 7)]
    silent = world - 1  # sends nothing, still receives
    sends, recvs = [], []
    for peer in range(world):
        if peer == rank:
            continue
        if rank != silent:
            sends += [Message(peer, payload(rank, peer, i, dt, n)) for i, (dt, n) in enumerate(kinds)]
        if peer != silent:
            recvs += [Message(peer, torch.empty(n, dtype=dt)) for dt, n in kinds]
    batch = _traced(dist.group.WORLD, sends, recvs, torch.device("cpu"))
    Peers.wait(batch)
    got = {}
    for m in recvs:
        got.setdefault(m.peer, []).append(m.tensor)
    return all(
        torch.equal(t, payload(peer, rank, i, dt, n))
        for peer, ts in got.items()
        for i, (t, (dt, n)) in enumerate(zip(ts, kinds, strict=True))
    ) and len(got) == world - 1 - (rank != silent)


def test_traced_batch_moves_mixed_messages():
    """The ring's batch as dynamo traces it (one all-to-all of bytes, each message aligned)
    delivers every message to its buffer: 16-bit messages of odd length before 32/64-bit ones."""
    assert all(run_on_ranks(2, _traced_batch_worker, timeout=120))

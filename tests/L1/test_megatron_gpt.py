"""Whole-model checks: plan reuse across layers, hierarchical groups from the config, and
3-step GPT training at CP > 1 reproducing the CP-1 losses (the demo: launched by torchrun as
CI runs it, and its training loop in the test pool)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_cp_ext.testing.pool import run_on_ranks  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(REPO, "examples", "train_gpt.py")
LENGTHS = [9, 1, 14, 5, 11]


def _setup(cp: int, hcp=None) -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state._HIERARCHICAL_CONTEXT_PARALLEL_GROUPS = None  # not reset by destroy (0.16)
    parallel_state.initialize_model_parallel(context_parallel_size=cp, hierarchical_context_parallel_sizes=hcp)


def _block(cp: int, num_layers: int = 3, **extra):
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_cp_ext.megatron import get_gpt_layer_cp_spec

    config = TransformerConfig(
        num_layers=num_layers,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        context_parallel_size=cp,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        **extra,
    )
    torch.manual_seed(0)
    return TransformerBlock(config, get_gpt_layer_cp_spec())


def plain_params_case(rank: int, world: int) -> dict:
    """Worker: a plain Megatron PackedSeqParams (global cu_seqlens, nothing attached; the batch
    split by Megatron's own THD split) must give the same result as ours built with that split,
    and derive one sharding (one plan) for all layers."""
    from megatron.core import parallel_state
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_cp_ext.megatron import CPRotaryEmbedding, make_packed_seq_params

    _setup(world)
    block = _block(world)
    lengths = [n * 2 * world for n in LENGTHS]  # Megatron's split needs multiples of 2*cp
    cu = torch.tensor([0] + lengths).cumsum(0)
    ours = make_packed_seq_params(cu, cp_group=parallel_state.get_context_parallel_group(), balance="te")
    sharding = ours._mcx_cp_context.sharding
    x = torch.randn(int(cu[-1]), 1, 32, generator=torch.Generator().manual_seed(3))
    x_loc = sharding.shard(x, rank, dim=0)
    table = CPRotaryEmbedding(8)(max(lengths))
    plain = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu.int(), cu_seqlens_kv=cu.int(), max_seqlen_q=56, max_seqlen_kv=56
    )
    y_plain = block(x_loc, attention_mask=None, rotary_pos_emb=table, packed_seq_params=plain)
    derived = plain._mcx_cp_context.sharding
    y_plain.sum().backward()
    y_ours = block(x_loc, attention_mask=None, rotary_pos_emb=table, packed_seq_params=ours)
    return {
        "diff": (y_plain - y_ours).abs().max().item(),
        "te": derived.balance == "te",
        "same_context_after_backward": plain._mcx_cp_context.sharding is derived,
        "plans": len(derived._plans),
    }


def test_plain_packed_seq_params_one_plan_per_micro_batch() -> None:
    for res in run_on_ranks(2, plain_params_case):
        assert res["diff"] < 1e-6 and res["te"], res
        assert res["same_context_after_backward"], res
        assert res["plans"] == 1, f"3 layers + backward must share one plan, got {res['plans']}"


def hcp_from_config_case(rank: int, world: int) -> list[list[int]]:
    """Worker: no hierarchical groups in parallel_state, sizes only on the config (NeMo 2)."""
    import torch.distributed as dist

    _setup(world)
    block = _block(world, num_layers=1, cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=[2, 2])
    groups = block.layers[0].self_attention.core_attention.comm_group
    return [dist.get_process_group_ranks(g) for g in groups]


def test_hierarchical_groups_built_from_config_sizes() -> None:
    got = run_on_ranks(4, hcp_from_config_case)
    # a2a groups are consecutive CP ranks, p2p groups stride by the a2a size.
    assert got == [[[0, 1], [0, 2]], [[0, 1], [1, 3]], [[2, 3], [0, 2]], [[2, 3], [1, 3]]]


def _train(nproc: int, tmp_path, *flags: str) -> list[float]:
    """The demo as a user launches it (torchrun, one process per rank): its losses."""
    out = tmp_path / f"losses-{nproc}-{'-'.join(flags).replace(' ', '')}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", DEMO]
    cmd += ["--train-iters", "3", "--json-out", str(out), *flags]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "tokens/s" in proc.stdout
    return json.loads(out.read_text())["losses"]


def _load_demo():
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_gpt_demo", DEMO)
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    return demo


def demo_case(rank: int, world: int, flags: list[str]) -> list[float]:
    """Worker: the demo's training loop (``run``, what its ``main`` calls after starting the
    process group) on the pool's group; the same losses as a torchrun launch, without starting
    and importing ``world`` fresh processes."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state._HIERARCHICAL_CONTEXT_PARALLEL_GROUPS = None  # not reset by destroy (0.16)
    demo = _load_demo()
    return demo.run(demo.parse_args(["--train-iters", "3", *flags]))["losses"]


def _train_in_pool(nproc: int, *flags: str) -> list[float]:
    losses = run_on_ranks(nproc, demo_case, list(flags))
    assert all(ls == losses[0] for ls in losses), losses  # every rank reports the all-reduced loss
    return losses[0]


def test_gpt_training_matches_cp1(tmp_path) -> None:
    """CP 2, p2p, Megatron's dual-chunk split, launched by torchrun (``balance="workload"`` at
    CP 4 below), against CP 1."""
    flags = ["--context-parallel-size", "2", "--cp-comm-type", "p2p", "--cp-load-balance", "dualchunk"]
    losses = _train(2, tmp_path, *flags)
    ref = _train_in_pool(1, "--context-parallel-size", "1")
    assert len(losses) == 3
    assert max(abs(a - b) for a, b in zip(losses, ref)) < 1e-4, (losses, ref)


def test_gpt_training_workload_cut_documents_matches_cp1() -> None:
    """Documents up to 600 tokens: the workload balance cuts the long ones across 4 ranks, and
    the two layers run different comm types (per-layer ``--cp-comm-type``) on that one split."""
    data = ["--seq-length", "1024", "--max-doc-len", "600", "--cp-load-balance", "workload"]
    ref = _train_in_pool(1, "--context-parallel-size", "1", *data)
    losses = _train_in_pool(4, "--context-parallel-size", "4", "--cp-comm-type", "p2p", "all_gather", *data)
    assert len(losses) == 3
    assert max(abs(a - b) for a, b in zip(losses, ref)) < 1e-4, (losses, ref)


def test_demo_batches_with_empty_documents() -> None:
    """``--min-doc-len 0`` draws empty documents (the package takes them): the demo's batch
    builder indexed the last token of each (an IndexError); lengths that cannot fill a batch
    (max 0) are refused by name."""
    demo = _load_demo()
    args = demo.parse_args(["--min-doc-len", "0", "--max-doc-len", "2", "--seq-length", "64"])
    batch = demo.make_batch(args, 0, 0)
    lens = batch["cu_seqlens"].diff().tolist()
    assert 0 in lens and sum(lens) == 64 == batch["tokens"].shape[1] == batch["labels"].shape[1]
    assert batch["loss_mask"].sum() == sum(n - 1 for n in lens if n)  # no target across a boundary
    with pytest.raises(SystemExit):
        demo.parse_args(["--min-doc-len", "0", "--max-doc-len", "0"])

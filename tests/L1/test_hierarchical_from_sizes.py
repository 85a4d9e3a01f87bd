"""Hierarchical CP groups built from ``hierarchical_context_parallel_sizes`` (no Megatron
hierarchical groups: NeMo 2) never leave some ranks waiting at model build.

The groups are made by a collective over every rank. Under pipeline parallelism each stage
builds its own layers, and with a per-layer comm type list a layer that runs ``a2a+p2p`` may
exist on one stage only: only that stage's ranks joined the collective, and they waited
forever. Every CP layer now joins it (cached: once per CP group) whatever its comm type. Here
world 4 is two CP groups of 2 whose layers differ, as two stages' would: {0, 1} builds an
``a2a+p2p`` layer, {2, 3} a ``p2p`` one; both build and run, against CP 1.
"""

import pytest
import torch

from megatron_cp_ext.testing.pool import run_on_ranks

pytest.importorskip("megatron.core")

CU = [0, 9, 10, 23, 32]


def _layers_differ_by_group(rank: int, world: int) -> tuple[str, list[int], float]:
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.core.transformer.transformer_config import TransformerConfig

    import megatron_cp_ext as mcx
    from megatron_cp_ext.megatron import get_gpt_layer_cp_spec, make_packed_seq_params
    from megatron_cp_ext.testing.megatron import setup_parallel_state

    kind = "a2a+p2p" if rank < 2 else "p2p"
    outs = []
    for cp in (2, 1, 2):  # the CP-1 set-up in between rebuilds the CP groups (same ranks, new objects)
        setup_parallel_state(cp)
        config = TransformerConfig(
            num_layers=1, hidden_size=32, num_attention_heads=4, context_parallel_size=cp,
            cp_comm_type=kind if cp > 1 else "p2p", hierarchical_context_parallel_sizes=[2, 1] if cp > 1 else None,
            hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
        )  # fmt: skip
        torch.manual_seed(0)
        block = TransformerBlock(config, get_gpt_layer_cp_spec())
        x = torch.randn(CU[-1], 1, 32, generator=torch.Generator().manual_seed(1))
        group = parallel_state.get_context_parallel_group()
        sharding = mcx.shard_sequences(CU, cp)
        me = dist.get_rank(group) if cp > 1 else 0
        params = make_packed_seq_params(CU, cp_group=group if cp > 1 else None, sharding=sharding)
        out = block(sharding.shard(x, me), attention_mask=None, packed_seq_params=params)
        outs.append((out, sharding, me))
    core = block.layers[0].self_attention.core_attention
    ranks = [dist.get_process_group_ranks(g) for g in core.comm_group] if kind == "a2a+p2p" else []
    (first, sh, me), (ref, sh1, _), (again, _, _) = outs
    want = sh.shard(ref, me)
    return kind, ranks, max((first - want).abs().max().item(), (again - want).abs().max().item())


def test_layers_that_differ_by_rank_all_build_and_match_cp1():
    got = run_on_ranks(4, _layers_differ_by_group, timeout=120)
    assert [g[0] for g in got] == ["a2a+p2p", "a2a+p2p", "p2p", "p2p"]
    assert got[0][1] == [[0, 1], [0]] and got[1][1] == [[0, 1], [1]]  # the rebuilt CP group's pair
    assert max(g[2] for g in got) < 1e-5, got

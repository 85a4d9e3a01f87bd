"""One sharding per micro-batch, whatever the layers' masks: a model mixing sliding-window and
full layers, fed by the default batch split, equals its CP-1 twin at CP 2/4/8 on a batch with
0- and 1-length documents (outputs, input gradient and every parameter gradient)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_cp_ext.testing.pool import run_on_ranks  # noqa: E402

LENGTHS = [0, 1, 37, 5, 1, 0, 90, 13, 2]
HIDDEN = 32


def _block(cp: int, pg_collection=None):
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_cp_ext.megatron import CPAttentionOptions, get_gpt_layer_cp_spec

    config = TransformerConfig(
        num_layers=4, hidden_size=HIDDEN, num_attention_heads=4, num_query_groups=2, context_parallel_size=cp,
        window_size=(24, 0), window_attn_skip_freq=2,  # layers 1 and 3 windowed, 2 and 4 full
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
    )  # fmt: skip
    torch.manual_seed(0)
    spec = get_gpt_layer_cp_spec(options=CPAttentionOptions(load_balance="workload"))
    kw = {"pg_collection": pg_collection} if pg_collection is not None else {}
    return TransformerBlock(config, spec, **kw)


def mixed_case(rank: int, world: int, how: str) -> dict[str, float]:
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    import megatron_cp_ext as mcx
    from megatron_cp_ext.megatron import CPRotaryEmbedding, make_packed_seq_params
    from megatron_cp_ext.testing.megatron import cp_vs_cp1_errors, setup_parallel_state

    setup_parallel_state(world)
    group = parallel_state.get_context_parallel_group()
    model = _block(world)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    pgs.cp = None
    ref = _block(1, pgs)
    ref.load_state_dict(model.state_dict())
    windowed = [layer.self_attention.core_attention.window_size for layer in model.layers]
    assert windowed == [(24, 0), (-1, -1), (24, 0), (-1, -1)], windowed
    cu = torch.tensor([0, *LENGTHS]).cumsum(0)
    if how == "given":  # a pipeline's own default split, handed to the params it builds
        sharding = mcx.shard_sequences(cu, world)
        params = make_packed_seq_params(cu, cp_group=group, sharding=sharding)
    else:  # the batch split's params carry its (window-balanced) split
        params = make_packed_seq_params(cu, cp_group=group, window_size=(24, 0))
        sharding = params._mcx_cp_context.sharding
    assert 0 not in sharding.counts(), sharding.counts()
    glob = make_packed_seq_params(cu)
    table = CPRotaryEmbedding(8)(128)
    x = torch.randn(int(cu[-1]), 1, HIDDEN, generator=torch.Generator().manual_seed(1))
    # the data split (recorded: the layers check theirs against it); rows as by index
    assert torch.equal(sharding.shard(x, rank), x[torch.as_tensor(sharding.global_index(rank))])

    def run(module, inp, is_cp):
        psp = params if is_cp else glob
        return module(inp, attention_mask=None, rotary_pos_emb=table, packed_seq_params=psp)

    return cp_vs_cp1_errors(model, ref, run, x, sharding.global_index(rank), group)


@pytest.mark.parametrize("how", ["given", "attached"])
@pytest.mark.parametrize("world", [2, 4, 8])
def test_mixed_window_and_full_layers_share_one_sharding(world: int, how: str) -> None:
    for rank, errs in enumerate(run_on_ranks(world, mixed_case, how)):
        assert len(errs) > 20, errs.keys()
        bad = {k: v for k, v in errs.items() if not v <= 2e-5}
        assert not bad, f"rank {rank}: CP {world} ({how}) differs from CP 1: {bad}"

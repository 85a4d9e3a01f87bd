"""Seeded random Megatron blocks for the Megatron fuzz test: a ``TransformerBlock`` built from
``get_gpt_layer_cp_spec()`` at CP 2 or 4 against its CP-1 twin (the same weights, the whole
batch on one rank), outputs and every gradient.

One seed draws: the world size, the comm type (``a2a+p2p`` with hierarchical sizes ``[2, cp /
2]``), the head layout (MHA, GQA, MQA, odd counts), 1–3 layers, a causal sliding window or
none (every other layer full with ``window_attn_skip_freq``), chunked attention, packed
lengths with many 0- and 1-length documents, and how the batch reaches the layers: split by a
pipeline's own ``shard_sequences`` (workload, dualchunk or contiguous; ``shard``: recorded) and
handed to ``make_packed_seq_params(cu, sharding=...)``, or split by ``make_packed_seq_params``
whose params carry the (mask-balanced) sharding. Needs megatron-core.
"""

from __future__ import annotations

import random

import torch

__all__ = ["draw", "block_case", "HEAD_DIM"]

HEAD_DIM = 8
_HEADS = [(8, 4), (8, 8), (8, 2), (8, 1), (6, 3), (4, 4), (4, 1)]
_WINDOWS = [None, None, (0, 0), (1, 0), (3, 0), (7, 0), (30, 0)]


def draw(seed: int) -> tuple[int, dict]:
    """``(world, config)`` of one seeded case; every draw is a valid configuration."""
    r = random.Random(seed)
    world = r.choice([2, 4])
    heads, groups = r.choice(_HEADS)
    lens = [r.choice([0, 1, 2, r.randint(3, 40), r.randint(40, 160)]) for _ in range(r.randint(1, 9))]
    if sum(lens) < 2 * world:
        lens.append(3 * world)
    window = r.choice(_WINDOWS)
    layers = r.choice([1, 2, 3])
    how = r.choice(["given", "attached"])
    return world, dict(
        comm=r.choice(["p2p", "all_gather", "a2a", "a2a+p2p"]),
        heads=heads,
        groups=groups,
        lens=lens,
        window=window,
        chunk=r.choice([None, None, None, 5, 32]),
        layers=layers,
        skip=r.choice([None, 2]) if window and layers >= 2 else None,
        how=how,
        balance="workload" if how == "attached" else r.choice(["workload", "dualchunk", "contiguous"]),
    )


def _block(cp: int, cfg: dict, pg_collection=None):
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.core.transformer.transformer_config import TransformerConfig

    from ..megatron import CPAttentionOptions, get_gpt_layer_cp_spec

    extra = {"window_attn_skip_freq": cfg["skip"]} if cfg["skip"] else {}
    config = TransformerConfig(
        num_layers=cfg["layers"], hidden_size=cfg["heads"] * HEAD_DIM, num_attention_heads=cfg["heads"],
        num_query_groups=cfg["groups"], ffn_hidden_size=32, context_parallel_size=cp, cp_comm_type=cfg["comm"],
        window_size=cfg["window"], hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
        params_dtype=torch.float32, **extra,
    )  # fmt: skip
    torch.manual_seed(0)
    options = CPAttentionOptions(load_balance=cfg["balance"], chunk_size=cfg["chunk"])
    kw = {"pg_collection": pg_collection} if pg_collection is not None else {}
    return TransformerBlock(config, get_gpt_layer_cp_spec(options=options), **kw)


def block_case(rank: int, world: int, cfg: dict) -> dict[str, float]:
    """Worker (:func:`~.pool.run_on_ranks`): max |CP - CP 1| per output, input gradient and
    parameter gradient (:func:`~.megatron.cp_vs_cp1_errors`)."""
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    from .. import shard_sequences
    from ..megatron import CPRotaryEmbedding, make_packed_seq_params
    from .megatron import cp_vs_cp1_errors, setup_parallel_state

    # one layout per world size, whatever the comm type: re-initialising parallel state per case
    # would leave the old groups' communication threads behind (thousands over a long run)
    setup_parallel_state(world, (2, world // 2))
    group = parallel_state.get_context_parallel_group()
    model = _block(world, cfg)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    pgs.cp = None  # the twin runs the whole batch alone through the same code
    ref = _block(1, cfg, pgs)
    ref.load_state_dict(model.state_dict())
    cu = torch.tensor([0, *cfg["lens"]]).cumsum(0)
    if cfg["how"] == "given":
        sharding = shard_sequences(cu, world, balance=cfg["balance"])
        params = make_packed_seq_params(cu, cp_group=group, sharding=sharding)
    else:
        params = make_packed_seq_params(cu, cp_group=group, window_size=cfg["window"], chunk_size=cfg["chunk"])
        sharding = params._mcx_cp_context.sharding
    whole = make_packed_seq_params(cu)
    table = CPRotaryEmbedding(HEAD_DIM)(max(cfg["lens"]) + 1)
    x = torch.randn(int(cu[-1]), 1, cfg["heads"] * HEAD_DIM, generator=torch.Generator().manual_seed(1))
    sharding.shard(x, rank)  # the pipeline's data split (recorded: the layers check theirs against it)

    def run(module, inp, is_cp):
        return module(inp, attention_mask=None, rotary_pos_emb=table, packed_seq_params=params if is_cp else whole)

    return cp_vs_cp1_errors(model, ref, run, x, sharding.global_index(rank), group)

"""megatron-core's ``HybridModel`` (0.19+) with our attention layers at CP 2 == CP 1.

A four-layer ``*-*-`` hybrid (attention, MLP, attention, MLP; RoPE, GQA) built from
:func:`get_hybrid_stack_cp_spec`, batches split by :func:`shard_batch_for_cp`: logits and every
parameter gradient match the CP-1 twin. Mamba layers need CUDA kernels and are not built here;
the local stack refuses them by name.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("megatron.core.models.hybrid.hybrid_model", reason="HybridModel needs megatron-core >= 0.19")

from megatron_cp_ext.testing.pool import run_on_ranks  # noqa: E402

LENGTHS = [9, 1, 14, 5, 11, 0, 8]  # 48 tokens
VOCAB = 64


def _model(cp: int, comm: str, pg_collection=None):
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_cp_ext.megatron import install_cp_rope
    from megatron_cp_ext.megatron.hybrid import get_hybrid_stack_cp_spec

    config = TransformerConfig(
        num_layers=4,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=64,
        context_parallel_size=cp,
        cp_comm_type=comm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
    )
    torch.manual_seed(0)
    kwargs = {"pg_collection": pg_collection} if pg_collection is not None else {}
    model = HybridModel(
        config,
        hybrid_stack_spec=get_hybrid_stack_cp_spec(normalization="RMSNorm"),
        vocab_size=VOCAB,
        max_sequence_length=64,
        hybrid_layer_pattern="*-*-",
        position_embedding_type="rope",
        **kwargs,
    )
    return install_cp_rope(model)


def hybrid_case(rank: int, world: int, fmt: str, comm: str) -> dict:
    """Worker: max |CP - CP1| over logits and every parameter gradient."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_cp_ext.megatron import make_packed_seq_params, shard_batch_for_cp
    from megatron_cp_ext.megatron.batch import zigzag_positions
    from megatron_cp_ext.testing.megatron import setup_parallel_state

    setup_parallel_state(world)
    group = parallel_state.get_context_parallel_group()
    model = _model(world, comm)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    pgs.cp = None
    ref = _model(1, comm, pgs)
    ref.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(3)
    if fmt == "thd":
        cu = torch.tensor([0] + LENGTHS).cumsum(0)
        tokens = torch.randint(0, VOCAB, (1, int(cu[-1])), generator=gen)
        psp = make_packed_seq_params(cu)  # CP size 1 (shard_batch_for_cp defaults to Megatron's group)
        pos = psp._mcx_cp_context.positions("cpu")[None]
        full = {"tokens": tokens, "position_ids": pos, "packed_seq_params": psp}
        local = shard_batch_for_cp({"tokens": tokens}, cu_seqlens=cu, cp_group=group)
        idx = local["packed_seq_params"]._mcx_cp_context.sharding.global_index(rank)
    else:
        tokens = torch.randint(0, VOCAB, (2, 16), generator=gen)
        pos = torch.arange(16).expand(2, 16)
        full = {"tokens": tokens, "position_ids": pos, "packed_seq_params": None}
        local = shard_batch_for_cp({"tokens": tokens, "position_ids": pos}, cp_group=group)
        local["packed_seq_params"] = None
        idx = zigzag_positions(16 // world, world, rank)

    def run(module, batch):
        return module(batch["tokens"], batch["position_ids"], None, packed_seq_params=batch["packed_seq_params"])

    y_ref = run(ref, full)
    w = torch.randn(y_ref.shape, generator=torch.Generator().manual_seed(4))
    (y_ref * w).sum().backward()
    y = run(model, local)
    (y * w[:, idx]).sum().backward()
    errs = {"logits": (y - y_ref[:, idx]).abs().max().item()}
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g, group=group)
        errs[name] = (g - ref_params[name].grad).abs().max().item()
    return errs


@pytest.mark.parametrize("fmt", ["thd", "sbhd"])
@pytest.mark.parametrize("comm", ["p2p", "a2a"])
def test_hybrid_model_matches_cp1(fmt: str, comm: str) -> None:
    for rank, errs in enumerate(run_on_ranks(2, hybrid_case, fmt, comm)):
        assert len(errs) > 10, errs.keys()
        bad = {k: v for k, v in errs.items() if not v <= 2e-5}
        assert not bad, f"rank {rank}: HybridModel CP2 {comm} {fmt} differs from CP1: {bad}"


def refused_case(rank: int, world: int) -> str:
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_cp_ext.megatron.hybrid import get_hybrid_stack_cp_spec
    from megatron_cp_ext.testing.megatron import setup_parallel_state

    setup_parallel_state(1)
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True)
    try:
        spec = get_hybrid_stack_cp_spec()
        HybridModel(config, spec, vocab_size=VOCAB, max_sequence_length=64, hybrid_layer_pattern="M*")
    except ValueError as e:
        return str(e)
    return "no error"


def test_local_hybrid_stack_refuses_mamba_by_name() -> None:
    msg = run_on_ranks(1, refused_case)[0]
    assert "'M'" in msg and "Mamba" in msg, msg

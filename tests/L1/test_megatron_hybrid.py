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
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_cp_ext.testing.megatron import model_vs_cp1_errors, setup_parallel_state, token_batches

    setup_parallel_state(world)
    group = parallel_state.get_context_parallel_group()
    model = _model(world, comm)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    pgs.cp = None
    ref = _model(1, comm, pgs)
    ref.load_state_dict(model.state_dict())
    full, local, idx = token_batches(rank, world, group, fmt, lengths=LENGTHS, shape=(16, 2), vocab=VOCAB)
    return model_vs_cp1_errors(model, ref, full, local, idx, group, lambda a, b: (a - b).abs().max().item())


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

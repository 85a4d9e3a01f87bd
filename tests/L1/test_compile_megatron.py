"""``torch.compile`` of a Megatron ``TransformerLayer`` built from this package's spec.

The layer (RoPE at true positions, GQA, ``CPCoreAttention``) is compiled in default mode's
front end (dynamo + AOTAutograd, ``aot_eager`` backend: inductor's code generation would
only add minutes of C++ compilation on CPU) and run on two THD micro-batches of different
lengths next to the same layer run eagerly. Asserted: output, input gradient and every
parameter gradient equal eager exactly, and the second micro-batch compiles nothing new
(the host side — sharding, positions, plan — stays out of the graphs; ``docs/compile.md``).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_cp_ext.testing.pool import run_on_ranks  # noqa: E402

HIDDEN, HEADS, GROUPS = 24, 4, 2  # no token count equals a width (duck sizing)
MICRO_BATCHES = ([9, 20, 3], [31, 6, 14, 1])  # odd lengths, a 1-token sequence


def _layer(cp: int, comm: str):
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_cp_ext.megatron import get_gpt_layer_cp_spec

    cfg = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=GROUPS,
        ffn_hidden_size=2 * HIDDEN, context_parallel_size=cp, cp_comm_type=comm, hidden_dropout=0.0,
        attention_dropout=0.0, use_cpu_initialization=True, params_dtype=torch.float32,
    )  # fmt: skip
    torch.manual_seed(0)
    return build_module(get_gpt_layer_cp_spec(), config=cfg, layer_number=1)


def _compiled_layer_case(rank: int, world: int, comm: str) -> tuple[list[float], list[int]]:
    """Worker: max |compiled - eager| over everything per micro-batch, and frames compiled."""
    from megatron.core import parallel_state
    from torch._dynamo.testing import CompileCounterWithBackend

    from megatron_cp_ext.megatron import CPRotaryEmbedding, make_packed_seq_params
    from megatron_cp_ext.testing.megatron import setup_parallel_state

    setup_parallel_state(world)
    layer = _layer(world, comm)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    # every size dynamic from the first trace: megatron-core's frames (compiled one by one,
    # see docs/compile.md) would otherwise each compile a dynamic version on the second shape
    compiled = torch.compile(layer, backend=counter, dynamic=True)
    table = CPRotaryEmbedding(HIDDEN // HEADS)(64)
    errors, frames = [], []
    for i, lengths in enumerate(MICRO_BATCHES):
        cu = torch.tensor([0, *lengths]).cumsum(0)
        psp = make_packed_seq_params(cu, cp_group=parallel_state.get_context_parallel_group())
        idx = psp._mcx_cp_context.sharding.global_index(rank)
        x = torch.randn(int(cu[-1]), 1, HIDDEN, generator=torch.Generator().manual_seed(i))[idx]
        w = torch.randn(x.shape, generator=torch.Generator().manual_seed(10 + i))
        results = []
        for fn in (layer, compiled):
            layer.zero_grad(set_to_none=True)
            xi = x.clone().requires_grad_()
            if fn is compiled:
                torch._dynamo.maybe_mark_dynamic(xi, 0)  # the token count changes every micro-batch
            y, _ = fn(xi, attention_mask=None, rotary_pos_emb=table, packed_seq_params=psp)
            (y * w).sum().backward()
            results.append([y.detach(), xi.grad, *(p.grad for p in layer.parameters())])
        errors.append(max(float((a - b).abs().max()) for a, b in zip(*results)))
        frames.append(counter.frame_count)
    return errors, frames


@pytest.mark.parametrize("world,comm", [(2, "p2p")])
def test_compiled_megatron_layer_equals_eager(world: int, comm: str) -> None:
    for errors, frames in run_on_ranks(world, _compiled_layer_case, comm, timeout=300):
        assert max(errors) == 0.0, errors
        assert frames[1] == frames[0], f"the second micro-batch compiled new graphs: {frames}"

"""MoE router losses need every CP rank to hold as many tokens.

Megatron's router divides the z-loss coefficient by the TP x CP size and averages over each
rank's own tokens, and prices the load-balancing losses with ``local tokens x TP x CP`` tokens.
A packed total that is not a multiple of CP gives counts one token apart, and the router's
gradients then differ from CP 1 (about 1e-4 relative in fp64 for the z-loss) while the LM loss
matches. So a layer with such losses refuses unequal counts on every rank, naming the loss and
the fix; equal counts run, and unequal counts without router losses run.
"""

from __future__ import annotations

from types import SimpleNamespace
from unittest import mock

import pytest

pytest.importorskip("megatron.core")

import torch  # noqa: E402
from test_split_agreement import _one_error_everywhere  # noqa: E402

from megatron_cp_ext.megatron.context import router_losses  # noqa: E402
from megatron_cp_ext.testing.pool import run_on_ranks  # noqa: E402

HIDDEN, HEADS, EXPERTS = 32, 4, 4


def _moe_layer_case(rank: int, world: int, lengths: list[int], losses: dict) -> dict:
    """A MoE ``TransformerLayer`` of our spec at CP ``world``: forward and backward, or the error."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_cp_ext import CPArgumentError
    from megatron_cp_ext.megatron import CPRotaryEmbedding, get_gpt_layer_cp_spec, shard_batch_for_cp
    from megatron_cp_ext.testing.megatron import setup_parallel_state

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # megatron-core 0.16 names it only when TE imports
    setup_parallel_state(world)
    group = parallel_state.get_context_parallel_group()
    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=2 * HIDDEN,
        context_parallel_size=world, cp_comm_type="p2p", hidden_dropout=0.0, attention_dropout=0.0,
        add_bias_linear=False, num_moe_experts=EXPERTS, moe_router_topk=2, moe_ffn_hidden_size=HIDDEN,
        moe_token_dispatcher_type="allgather", use_cpu_initialization=True, params_dtype=torch.float32,
        **{"moe_aux_loss_coeff": 0.0, **losses},
    )  # fmt: skip
    torch.manual_seed(0)
    layer = build_module(get_gpt_layer_cp_spec(num_experts=EXPERTS), config=config, layer_number=1)
    cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    x = torch.randn(cu[-1], 1, HIDDEN, generator=torch.Generator().manual_seed(1))
    local = shard_batch_for_cp({"tokens": x.transpose(0, 1)}, cu_seqlens=cu, cp_group=group, token_multiple=1)
    inp = local["tokens"].transpose(0, 1).contiguous().requires_grad_()
    table = CPRotaryEmbedding(HIDDEN // HEADS)(max(lengths))
    try:  # the router moves its weight to torch.cuda.current_device() on every call
        with mock.patch.object(torch.cuda, "current_device", lambda: "cpu"):
            out, _ = layer(inp, attention_mask=None, rotary_pos_emb=table, packed_seq_params=local["packed_seq_params"])
            out.sum().backward()
    except CPArgumentError as err:
        return {"error": type(err).__name__, "message": str(err)}
    return {"tokens": inp.shape[0], "finite": bool(torch.isfinite(inp.grad).all())}


UNEVEN, EVEN = [37, 0, 1, 63, 9, 0, 1, 27, 5], [37, 0, 1, 63, 9, 0, 1, 27, 6]  # 143 and 144 tokens


@pytest.mark.parametrize(
    "losses, needle",
    [({"moe_z_loss_coeff": 0.1}, "moe_z_loss_coeff"), ({"moe_aux_loss_coeff": 0.1}, "aux_loss (moe_aux_loss_coeff)")],
    ids=["z_loss", "aux_loss"],
)
def test_router_losses_refuse_unequal_counts_everywhere(losses, needle):
    results = run_on_ranks(2, _moe_layer_case, UNEVEN, losses, timeout=120)
    _one_error_everywhere(results, needle, "counts [72, 71]", "multiple of 2 x token_multiple")


@pytest.mark.parametrize(
    "lengths, losses", [(EVEN, {"moe_z_loss_coeff": 0.1}), (UNEVEN, {})], ids=["equal-counts", "no-router-loss"]
)
def test_what_the_router_allows_runs(lengths, losses):
    results = run_on_ranks(2, _moe_layer_case, lengths, losses, timeout=120)
    assert all("error" not in r and r["finite"] for r in results), results
    assert sum(r["tokens"] for r in results) == sum(lengths)


@pytest.mark.parametrize(
    "fields, expected",
    [
        ({"num_moe_experts": None, "moe_z_loss_coeff": 0.1}, None),
        ({"moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 0.0}, None),
        ({"moe_router_load_balancing_type": "sinkhorn", "moe_aux_loss_coeff": 0.1}, None),
        ({"moe_router_load_balancing_type": "seq_aux_loss", "moe_aux_loss_coeff": 0.1}, "seq_aux_loss"),
        (
            {"moe_router_load_balancing_type": ["aux_loss", "global_aux_loss"], "moe_aux_loss_coeff": [0.0, 0.2]},
            "global_aux_loss (moe_aux_loss_coeff)",
        ),
        ({"moe_z_loss_coeff": 1e-3}, "moe_z_loss_coeff"),
    ],
)  # fmt: skip
def test_router_losses_names_what_needs_equal_counts(fields, expected):
    base = {"num_moe_experts": 8, "moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 0.0}
    got = router_losses(SimpleNamespace(**{"moe_z_loss_coeff": None, **base, **fields}))
    assert got == expected or (expected and got == f"{expected} (moe_aux_loss_coeff)"), got

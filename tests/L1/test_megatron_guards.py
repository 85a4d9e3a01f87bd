"""Megatron path guards: plans follow refilled ``cu_seqlens``; sequence parallelism never hangs
on token counts it cannot scatter; per-call CP groups are refused by name, on every rank."""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_cp_ext.testing.pool import run_on_ranks  # noqa: E402

HIDDEN = 32


def _block(cp: int, **extra):
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_cp_ext.megatron import CPAttentionOptions, get_gpt_layer_cp_spec

    config = TransformerConfig(
        num_layers=2, hidden_size=HIDDEN, num_attention_heads=4, num_query_groups=2, context_parallel_size=cp,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
    )  # fmt: skip
    torch.manual_seed(0)
    return TransformerBlock(config, get_gpt_layer_cp_spec(options=CPAttentionOptions(**extra)))


def refill_case(rank: int, world: int) -> list[float]:
    """Worker: one static ``cu_seqlens`` buffer refilled per micro-batch (plain params, and
    params made by make_packed_seq_params) gives what fresh params give, micro-batch by
    micro-batch, whether the refill bumps the version counter (``copy_``) or not (``.data``, NumPy)."""
    from megatron.core import parallel_state
    from megatron.core.packed_seq_params import PackedSeqParams

    import megatron_cp_ext as mcx
    from megatron_cp_ext.megatron import CPRotaryEmbedding, make_packed_seq_params
    from megatron_cp_ext.testing.megatron import setup_parallel_state

    setup_parallel_state(world)
    group = parallel_state.get_context_parallel_group()
    block = _block(world)
    table = CPRotaryEmbedding(8)(64)
    micro_batches = [[8, 24, 4, 12], [16, 4, 20, 8], [4, 4, 36, 4]]  # one shape, new values each step
    x = torch.randn(48, 1, HIDDEN, generator=torch.Generator().manual_seed(1))
    refills = {
        "copy_": lambda dst, cu: dst.copy_(cu),
        "data": lambda dst, cu: dst.data.copy_(cu),  # leaves the version counter alone
        "numpy": lambda dst, cu: dst.numpy().__setitem__(slice(None), cu.numpy()),  # so does NumPy
    }
    diffs = []
    for refill in refills.values():
        buf = torch.zeros(5, dtype=torch.int32)
        plain = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=buf, cu_seqlens_kv=buf, max_seqlen_q=64, max_seqlen_kv=64
        )
        ours = make_packed_seq_params([0, *torch.tensor(micro_batches[0]).cumsum(0).tolist()], cp_group=group)
        for lengths in micro_batches:
            cu = torch.tensor([0, *lengths]).cumsum(0)
            refill(buf, cu.int())
            refill(ours.cu_seqlens_q, cu.to(ours.cu_seqlens_q.dtype))
            for params, sharding, fresh in (
                (plain, mcx.te_thd_sharding(cu, world), PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu.int())),
                (ours, mcx.shard_sequences(cu, world), make_packed_seq_params(cu, cp_group=group)),
            ):
                x_loc = sharding.shard(x, rank)
                with torch.no_grad():
                    y = block(x_loc, attention_mask=None, rotary_pos_emb=table, packed_seq_params=params)
                    y_ref = block(x_loc, attention_mask=None, rotary_pos_emb=table, packed_seq_params=fresh)
                diffs.append((y - y_ref).abs().max().item())
    return diffs


def test_refilled_cu_seqlens_rebuild_the_plan() -> None:
    for rank, diffs in enumerate(run_on_ranks(2, refill_case)):
        assert len(diffs) == 18 and max(diffs) == 0.0, (rank, diffs)


def given_split_refill_case(rank: int, world: int) -> list:
    """Worker: params made with the split the data got (a ``workload`` split balanced under the
    model's window), data cut by index; the buffer refilled with the same values keeps that
    split (a rebuild from the params' default mask was another split: max error 3.1, silent),
    and refilled with other values it refuses on every rank."""
    from megatron.core import parallel_state
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    import megatron_cp_ext as mcx
    from megatron_cp_ext.megatron import CPCoreAttention, make_packed_seq_params
    from megatron_cp_ext.testing.megatron import setup_parallel_state
    from megatron_cp_ext.testing.reference import dense_attention

    setup_parallel_state(world)
    window = (8, 0)
    config = TransformerConfig(
        num_layers=1, hidden_size=32, num_attention_heads=4, context_parallel_size=world, window_size=window,
        attention_dropout=0.0, hidden_dropout=0.0, use_cpu_initialization=True,
    )  # fmt: skip
    core = CPCoreAttention(config, 1, AttnMaskType.causal)
    cu = torch.tensor([0, 300, 307, 308, 578, 578, 591])
    sh = mcx.shard_sequences(cu, world, window_size=window)
    params = make_packed_seq_params(cu, cp_group=parallel_state.get_context_parallel_group(), sharding=sh)
    idx = sh.global_index(rank)
    out = []
    for step in range(3):
        if step:
            refill = cu if step == 1 else torch.tensor([0, 7, 300, 301, 578, 578, 591])
            params.cu_seqlens_q.copy_(refill.to(params.cu_seqlens_q.dtype))
        g = torch.Generator().manual_seed(step)
        q, k, v = (torch.randn(591, 4, 8, generator=g, dtype=torch.float64) for _ in range(3))
        try:
            got = core(q[idx], k[idx], v[idx], None, packed_seq_params=params)
        except mcx.CPArgumentError as err:
            out.append(str(err))
            continue
        want = dense_attention(q, k, v, cu, causal=True, window_size=window).flatten(-2)[idx]
        out.append((got - want).abs().max().item())
    return out


def test_refilled_params_keep_the_split_they_were_given() -> None:
    res = run_on_ranks(2, given_split_refill_case)
    for same, same_refilled, other in res:
        assert same < 1e-12 and same_refilled < 1e-12, res
        assert "refilled in place with other values" in other, other
    assert res[0][2] == res[1][2]  # one error, on every rank


@contextlib.contextmanager
def _megatron_on_cpu():
    """Megatron's TP collectives allocate on "the current CUDA device" (the CPU here) and
    sequence parallelism forks the CUDA RNG for dropout (0 here); its torch LayerNorm stand-in
    refuses sequence parallelism although a LayerNorm is per token."""
    from megatron.core import tensor_parallel
    from megatron.core.transformer import torch_norm

    tracker = type(tensor_parallel.get_cuda_rng_tracker())
    plain_norm = lambda cls, config, hidden_size, eps=1e-5, **_: torch.nn.LayerNorm(hidden_size, eps=eps)  # noqa: E731
    with (
        mock.patch.object(torch.cuda, "current_device", lambda: "cpu"),
        mock.patch.object(tracker, "fork", lambda *a, **k: contextlib.nullcontext()),
        mock.patch.object(torch_norm.WrappedTorchNorm, "__new__", plain_norm),
    ):
        yield


def sp_case(rank: int, world: int, how: str) -> tuple[str, str]:
    """Worker (TP 2 + SP, CP 2): a 7-token batch cannot give every CP rank a token count that
    TP 2 divides. Returns (exception type, message) — never hangs."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    import megatron_cp_ext as mcx
    from megatron_cp_ext.megatron import (
        CPAttentionOptions,
        core_attention,
        cp_layer_spec,
        install_cp_rope,
        make_packed_seq_params,
        shard_batch_for_cp,
    )
    from megatron_cp_ext.testing.megatron import setup_parallel_state

    setup_parallel_state(2, tp=2)
    cu = torch.tensor([0, 3, 7])
    tokens = torch.arange(7)[None] % 5
    try:
        if how == "split":  # megatron_cp_ext's batch split refuses before anything runs
            shard_batch_for_cp({"tokens": tokens}, cu_seqlens=cu)
            return ("no error", "")
        config = TransformerConfig(
            num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, context_parallel_size=2,
            tensor_model_parallel_size=2, sequence_parallel=True, hidden_dropout=0.0, attention_dropout=0.0,
            use_cpu_initialization=True,
        )  # fmt: skip
        # Ranks 2 and 3 never reach attention (Megatron's scatter fails first): ranks 0 and 1
        # wait for them REFUSAL_WAIT_S, then refuse; a shorter wait changes nothing else.
        with _megatron_on_cpu(), mock.patch.object(core_attention, "REFUSAL_WAIT_S", 2.0):
            spec = cp_layer_spec(config, options=CPAttentionOptions(load_balance="workload"))
            model = install_cp_rope(GPTModel(config, spec, vocab_size=8, max_sequence_length=16))
            # A pipeline's own split with shard_sequences, handed to the params it builds.
            sharding = mcx.shard_sequences(cu, 2)
            local = sharding.shard(tokens, parallel_state.get_context_parallel_rank(), dim=1)
            params = make_packed_seq_params(cu, cp_group=parallel_state.get_context_parallel_group(), sharding=sharding)
            model(local, sharding.positions(parallel_state.get_context_parallel_rank())[None], None,
                  packed_seq_params=params)  # fmt: skip
        return ("no error", "")
    except Exception as err:  # noqa: BLE001 - the point is which error each rank gets
        return (type(err).__name__, str(err))


def test_sequence_parallel_split_refuses_the_same_way_on_every_rank() -> None:
    results = run_on_ranks(4, sp_case, "split", timeout=120)
    assert len(set(results)) == 1, results
    kind, msg = results[0]
    assert kind == "CPArgumentError" and "multiple of 2" in msg, results


def test_sequence_parallel_counts_it_cannot_scatter_never_hang() -> None:
    """A CP rank with an odd count fails in Megatron's own scatter (before any collective);
    every other rank refuses in its first attention layer instead of waiting for it."""
    results = run_on_ranks(4, sp_case, "model", timeout=120)  # a hang would time out here
    assert all(kind != "no error" for kind, _ in results), results
    ours = [msg for kind, msg in results if kind == "CPArgumentError"]
    assert ours and all("sequence parallelism (TP 2)" in msg for msg in ours), results


def group_case(rank: int, world: int) -> str:
    """Worker: PackedSeqParams carrying another CP group than the layer's (Megatron's hybrid CP)."""
    import torch.distributed as dist
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_cp_ext.testing.megatron import setup_parallel_state

    setup_parallel_state(world)
    singles = [dist.new_group([r]) for r in range(world)]  # collective: every rank makes all
    block = _block(world)
    cu = torch.tensor([0, 8, 16], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cp_group=singles[rank])
    try:
        block(torch.randn(8, 1, HIDDEN), attention_mask=None, packed_seq_params=params)
    except ValueError as err:
        return str(err)
    return "no error"


def test_per_call_cp_group_is_refused_on_every_rank() -> None:
    for msg in run_on_ranks(2, group_case, timeout=120):
        assert "PackedSeqParams.cp_group" in msg and "not this layer's CP group [0, 1]" in msg, msg
        assert "shard_batch_for_cp" in msg and "hybrid CP" in msg, msg


def rope_case(rank: int, world: int, rows: int, fmt: str = "thd") -> str:
    """Worker: a block on a batch whose longest sequence (40 tokens, held by rank 0 under TE's
    split only in part) is longer than the RoPE table (Megatron sizes it from ``max_seqlen_q``);
    ``fmt`` other than thd: the packed split's params switched to that format."""
    from megatron.core import parallel_state

    import megatron_cp_ext as mcx
    from megatron_cp_ext.megatron import CPRotaryEmbedding, make_packed_seq_params
    from megatron_cp_ext.testing.megatron import setup_parallel_state

    setup_parallel_state(world)
    block = _block(world)
    cu = [0, 8, 48, 60]
    params = make_packed_seq_params(cu, cp_group=parallel_state.get_context_parallel_group())
    n = params._mcx_cp_context.sharding.num_tokens(rank)
    if fmt != "thd":  # the packed split's params switched to another format
        params.qkv_format, params.max_seqlen_q, params.max_seqlen_kv = fmt, rows, rows
    try:
        block(torch.randn(n, 1, HIDDEN), attention_mask=None, rotary_pos_emb=CPRotaryEmbedding(8)(rows),
              packed_seq_params=params)  # fmt: skip
    except mcx.CPArgumentError as err:
        return str(err)
    return "ran"


def test_a_rope_table_shorter_than_the_longest_sequence_is_refused_everywhere() -> None:
    """An index error on some ranks only (a device assert on a GPU) would leave the others waiting."""
    for rows, want in ((39, "rotary_pos_emb has 39 positions"), (40, "ran")):
        results = run_on_ranks(2, rope_case, rows, timeout=120)
        assert len(set(results)) == 1 and want in results[0], results


def rank_local_case(rank: int, world: int, kind: str) -> str:
    """Worker: a block whose input is wrong on some CP ranks only. ``count``: THD data cut
    [12, 13, 12] under params whose sharding gives [13, 12, 12] (rank 2's count agrees);
    ``sbhd``: local sbhd rows [4, 3] with RoPE (no dual-chunk split makes 7 tokens)."""
    from megatron.core import parallel_state

    import megatron_cp_ext as mcx
    from megatron_cp_ext.megatron import CPRotaryEmbedding, make_packed_seq_params
    from megatron_cp_ext.testing.megatron import setup_parallel_state

    setup_parallel_state(world)
    block = _block(world)
    kw = {}
    if kind == "count":
        kw["packed_seq_params"] = make_packed_seq_params(
            [0, 7, 13, 14, 23, 37], cp_group=parallel_state.get_context_parallel_group()
        )
        counts = list(kw["packed_seq_params"]._mcx_cp_context.sharding.counts())
        counts[0], counts[1] = counts[1], counts[0]
        n = counts[rank]
    else:
        n = [4, 3][rank]
    try:
        block(torch.randn(n, 1, HIDDEN), attention_mask=None, rotary_pos_emb=CPRotaryEmbedding(8)(64), **kw)
    except mcx.CPArgumentError as err:
        return str(err)
    return "ran"


@pytest.mark.parametrize(
    "kind, world, want", [("count", 3, "CP rank 0 holds 12 tokens"), ("sbhd", 2, "must be divisible by 2*cp")]
)
def test_an_input_wrong_on_some_ranks_is_refused_everywhere(kind, world, want) -> None:
    """The rank whose input looks right used to wait in its exchange while the others raised."""
    results = run_on_ranks(world, rank_local_case, kind, timeout=120)
    assert len(set(results)) == 1 and want in results[0], results


def test_thd_split_params_switched_to_sbhd_are_refused_everywhere() -> None:
    """The layer would have split by Megatron's dual-chunk rule, not the data's: silently wrong
    (relative gradient error 0.78 through a GPT at CP 2) where the RoPE table was long enough,
    else refused for the table's length, which is not the cause."""
    for rows in (60, 5000):
        results = run_on_ranks(2, rope_case, rows, "sbhd", timeout=120)
        assert len(set(results)) == 1 and "qkv_format is 'sbhd'" in results[0], results


def kv_case(rank: int, world: int) -> list[str]:
    """Worker: params from make_packed_seq_params (their context cached), cu_seqlens_kv then set
    to another packing, then to an equal copy, then refilled in place with another packing."""
    from megatron.core import parallel_state

    import megatron_cp_ext as mcx
    from megatron_cp_ext.megatron import make_packed_seq_params
    from megatron_cp_ext.testing.megatron import setup_parallel_state

    setup_parallel_state(world)
    block = _block(world)
    params = make_packed_seq_params([0, 8, 48, 60], cp_group=parallel_state.get_context_parallel_group())
    x = torch.randn(params._mcx_cp_context.sharding.num_tokens(rank), 1, HIDDEN)
    out = []
    for step in ("other", "copy", "refill"):
        if step == "other":
            params.cu_seqlens_kv = torch.tensor([0, 10, 48, 60], dtype=torch.int32)
        elif step == "copy":
            params.cu_seqlens_kv = params.cu_seqlens_q.clone()
        else:
            params.cu_seqlens_kv[1] = 9
        try:
            block(x, attention_mask=None, packed_seq_params=params)
            out.append("ran")
        except mcx.CPArgumentError as err:
            out.append(str(err))
    return out


def test_cu_seqlens_kv_other_than_q_is_refused_on_a_cached_context() -> None:
    """The refusal ran only where the context was built or rebuilt: params whose context was
    cached (make_packed_seq_params, shard_batch_for_cp) took any cu_seqlens_kv."""
    for other, copy, refill in run_on_ranks(2, kv_case, timeout=120):
        assert "cu_seqlens_kv == cu_seqlens_q" in other and copy == "ran", (other, copy)
        assert "cu_seqlens_kv == cu_seqlens_q" in refill, refill


def bshd_per_token_case(rank: int, world: int) -> list[str]:
    """Worker: a [b, s] batch whose per-token extras are not [b, s] (a 1-D ``position_ids``,
    a 2-D ``attention_mask``): refused by name, where Megatron's own split fails on them too."""
    import torch.distributed as dist

    from megatron_cp_ext.megatron import shard_batch_for_cp

    s = 8
    msgs = []
    for extra in ({"position_ids": torch.arange(s)}, {"attention_mask": torch.ones(s, s, dtype=torch.bool)}):
        try:
            shard_batch_for_cp({"tokens": torch.zeros(2, s, dtype=torch.long), **extra}, cp_group=dist.group.WORLD)
            msgs.append("no error")
        except ValueError as err:
            msgs.append(str(err))
    kept = shard_batch_for_cp({"tokens": torch.zeros(2, s), "weights": torch.ones(2)}, cp_group=dist.group.WORLD)
    msgs.append(str(list(kept["weights"].shape)))  # a per-sample [b] tensor passes through
    return msgs


def test_bshd_per_token_tensors_without_the_batch_dim_are_refused() -> None:
    for pos, mask, weights in run_on_ranks(2, bshd_per_token_case, timeout=120):
        assert "batch['position_ids'] has shape [8]" in pos, pos
        assert "batch['attention_mask'] has shape [8, 8]" in mask, mask
        assert weights == "[2]"

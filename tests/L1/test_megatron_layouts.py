"""THD layouts real Megatron pipelines produce, trained exactly at CP > 1.

Megatron's ``get_thd_batch_on_this_cp_rank`` (0.16) / ``get_batch_on_this_cp_rank`` (0.19) and
the Bridge and NeMo data steps split a packed batch with TransformerEngine's
``thd_get_partitioned_indices``: every (padded) document in ``2*cp`` equal chunks, CP rank r
holding chunk r and chunk ``2*cp-1-r`` of each, document after document. TransformerEngine is
not installed here, so its index function is re-implemented below from that definition and
handed to Megatron's own batch function; everything else (the split, ``PackedSeqParams``, the
GPT model) is Megatron's. The CP model must equal its CP-1 twin on the real tokens: loss,
logits and every parameter gradient.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_cp_ext.testing.pool import run_on_ranks  # noqa: E402

DOCS = [37, 301, 1, 63, 9, 141, 27]
DOCS_EVEN = [37, 301, 1, 63, 9, 141, 28]  # sequence parallelism needs the twin's total to split over TP
VOCAB, HIDDEN = 64, 32


def te_partitioned_indices(cu_seqlens: torch.Tensor, total: int, cp: int, rank: int) -> torch.Tensor:
    """TransformerEngine's ``thd_get_partitioned_indices``, from its definition."""
    cu = [int(x) for x in cu_seqlens.reshape(-1).tolist()]
    idx: list[int] = []
    for start, end in zip(cu[:-1], cu[1:]):
        c = (end - start) // (2 * cp)
        idx += range(start + rank * c, start + (rank + 1) * c)
        idx += range(start + (2 * cp - 1 - rank) * c, start + (2 * cp - rank) * c)
    assert len(idx) * cp == total
    return torch.tensor(idx, dtype=torch.long)


def padded_batch(docs: list[int], multiple: int, vocab: int, pad: bool = True) -> dict:
    """A packed global batch the way Megatron's THD datasets give it: every document padded to
    a multiple of ``multiple`` (pad tokens at its end, loss mask 0), positions per document."""
    gen = torch.Generator().manual_seed(5)
    padded = [-(-n // multiple) * multiple if pad else n for n in docs]
    toks, labels, mask, pos = [], [], [], []
    for n, p in zip(docs, padded):
        doc = torch.randint(0, vocab, (n + 1,), generator=gen)
        toks.append(torch.cat([doc[:n], torch.zeros(p - n, dtype=torch.long)]))
        labels.append(torch.cat([doc[1:], torch.zeros(p - n, dtype=torch.long)]))
        mask.append(torch.cat([torch.ones(n), torch.zeros(p - n)]))
        pos.append(torch.arange(p))
    return {
        "tokens": torch.cat(toks)[None],
        "labels": torch.cat(labels)[None],
        "loss_mask": torch.cat(mask)[None],
        "position_ids": torch.cat(pos)[None],
        "cu_seqlens": torch.tensor([0, *docs]).cumsum(0).int(),
        "cu_seqlens_padded": torch.tensor([0, *padded]).cumsum(0).int(),
    }


def megatron_thd_split(batch: dict, cp: int, rank: int, group, with_padded: bool):
    """This CP rank's batch and PackedSeqParams, made by Megatron's own THD split."""
    from megatron.core import utils as mcu
    from megatron.core.packed_seq_params import PackedSeqParams

    cu, cu_pad = batch["cu_seqlens"], batch["cu_seqlens_padded"]
    data = {k: batch[k].clone() for k in ("tokens", "labels", "loss_mask", "position_ids")}
    tex = SimpleNamespace(thd_get_partitioned_indices=te_partitioned_indices)
    te_version = mock.patch.object(mcu, "is_te_min_version", lambda *a, **k: True)
    with mock.patch.object(mcu, "tex", tex, create=True), te_version:
        if hasattr(mcu, "get_thd_batch_on_this_cp_rank"):  # megatron-core 0.16
            max_len = (cu_pad[1:] - cu_pad[:-1]).max().view(1)
            local, psp = mcu.get_thd_batch_on_this_cp_rank(data, cu, cu_pad, max_len, cp, rank)
        else:  # 0.19: per-document split inside get_batch_on_this_cp_rank
            max_len = int((cu_pad[1:] - cu_pad[:-1]).max())
            data.update(cu_seqlens=cu[None], cu_seqlens_padded=cu_pad[None])
            local = mcu.get_batch_on_this_cp_rank(data, is_hybrid_cp=False, cp_group=group)
            psp = PackedSeqParams(
                qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_pad,
                cu_seqlens_kv_padded=cu_pad, max_seqlen_q=max_len, max_seqlen_kv=max_len,
            )  # fmt: skip
    if not with_padded:  # Megatron >= 0.19 without padding: cu_seqlens only
        psp.cu_seqlens_q_padded = psp.cu_seqlens_kv_padded = None
    return local, psp, te_partitioned_indices(cu_pad, int(cu_pad[-1]), cp, rank)


def gpt(config, load_balance: str, pg_collection=None):
    """A GPT of our layers; full (TP-gathered) logits, so the loss is the real cross entropy."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import torch_norm

    from megatron_cp_ext.megatron import CPAttentionOptions, cp_layer_spec, install_cp_rope

    torch.manual_seed(0)
    kw = {"pg_collection": pg_collection} if pg_collection is not None else {}
    spec = cp_layer_spec(config, options=CPAttentionOptions(load_balance=load_balance))
    # Megatron's torch LayerNorm stand-in (no apex here) refuses sequence parallelism although
    # a LayerNorm is per token; build the plain one (its gradients are summed over TP below).
    plain_norm = lambda cls, config, hidden_size, eps=1e-5, **_: torch.nn.LayerNorm(hidden_size, eps=eps)  # noqa: E731
    with mock.patch.object(torch_norm.WrappedTorchNorm, "__new__", plain_norm):
        model = GPTModel(
            config, spec, vocab_size=VOCAB, max_sequence_length=1024, position_embedding_type="rope",
            parallel_output=False, **kw,
        )  # fmt: skip
    return install_cp_rope(model)


def full_grads(model, cp_group, sequence_parallel: bool) -> dict[str, torch.Tensor]:
    """Every parameter's gradient as the optimizer sees it: summed over CP (each rank saw its
    tokens) and, under sequence parallelism, replicated parameters also over TP."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.clone()
        if cp_group is not None:
            dist.all_reduce(g, group=cp_group)
        if sequence_parallel and not getattr(p, "tensor_model_parallel", False):
            dist.all_reduce(g, group=parallel_state.get_tensor_model_parallel_group())
        grads[name] = g
    return grads


def gpt_config(cp: int, comm: str, hcp=None, tp: int = 1):
    from megatron.core.transformer.transformer_config import TransformerConfig

    extra = {"hierarchical_context_parallel_sizes": list(hcp)} if hcp else {}
    return TransformerConfig(
        num_layers=2, hidden_size=HIDDEN, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
        context_parallel_size=cp, cp_comm_type=comm, tensor_model_parallel_size=tp, sequence_parallel=tp > 1,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True, params_dtype=torch.float32, **extra,
    )  # fmt: skip


def twin_pgs():
    from megatron.core.process_groups_config import ProcessGroupCollection

    pgs = ProcessGroupCollection.use_mpu_process_groups()
    pgs.cp = None  # the twin runs the whole batch alone: CP size 1 through the same code
    return pgs


def weighted_loss(model, tokens, positions, labels, weights, psp) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(tokens, positions, None, packed_seq_params=psp)  # [1, t, V]
    ce = torch.nn.functional.cross_entropy(logits[0].float(), labels[0], reduction="none")
    return (ce * weights).sum(), logits[0]


def te_layout_case(rank: int, world: int, comm: str, load_balance: str, hcp, tp: int, with_padded: bool) -> dict:
    """Worker: GPT at CP ``world // tp`` on Megatron's THD split vs its CP-1 twin on the real
    tokens; relative max differences of loss, logits and every parameter gradient."""
    from megatron.core import tensor_parallel

    # Megatron's tensor-parallel collectives allocate on "the current CUDA device" (the CPU
    # here), and sequence parallelism forks the CUDA RNG for dropout (0 here).
    tracker = type(tensor_parallel.get_cuda_rng_tracker())
    with (
        mock.patch.object(torch.cuda, "current_device", lambda: "cpu"),
        mock.patch.object(tracker, "fork", lambda *a, **k: contextlib.nullcontext()),
    ):
        return _te_layout_errors(world, comm, load_balance, hcp, tp, with_padded)


def _te_layout_errors(world: int, comm: str, load_balance: str, hcp, tp: int, with_padded: bool) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_cp_ext.testing.megatron import setup_parallel_state

    cp = world // tp
    setup_parallel_state(cp, hcp, tp=tp)
    group = parallel_state.get_context_parallel_group()
    cp_rank = parallel_state.get_context_parallel_rank()
    model = gpt(gpt_config(cp, comm, hcp, tp), load_balance)
    ref = gpt(gpt_config(1, comm, None, tp), load_balance, twin_pgs())
    ref.load_state_dict(model.state_dict())

    from megatron_cp_ext.megatron import make_packed_seq_params

    multiple = 2 * cp * tp  # Megatron pads to 2*cp (times TP under sequence parallelism)
    docs = DOCS_EVEN if tp > 1 else DOCS
    if not with_padded:  # then every document length must already be a multiple
        docs = [-(-n // multiple) * multiple for n in docs]
    batch = padded_batch(docs, multiple, VOCAB, pad=with_padded)
    local, psp, idx = megatron_thd_split(batch, cp, cp_rank, group, with_padded)
    weights = torch.rand(batch["tokens"].shape[1], generator=torch.Generator().manual_seed(6))
    weights = weights * batch["loss_mask"][0]  # per-token loss weights; pad tokens carry none

    # The twin sees the real tokens only (no padding at all), exactly as CP 1 trains them.
    real = batch["loss_mask"][0].bool()

    cu_real = batch["cu_seqlens"]
    psp_ref = make_packed_seq_params(cu_real)
    pos_ref = psp_ref._mcx_cp_context.positions("cpu")[None]
    loss_ref, logits_ref = weighted_loss(
        ref, batch["tokens"][:, real], pos_ref, batch["labels"][:, real], weights[real], psp_ref
    )
    loss_ref.backward()

    loss, logits = weighted_loss(model, local["tokens"], local["position_ids"], local["labels"], weights[idx], psp)
    loss.backward()
    loss_sum = loss.detach().clone()
    dist.all_reduce(loss_sum, group=group)
    keep = real[idx]  # this rank's real tokens, and where they sit in the twin's batch
    where = torch.cumsum(real.long(), 0)[idx][keep] - 1

    def rel(a, b):
        return ((a - b).abs().max() / b.abs().max().clamp(min=1.0)).item()

    errs = {"loss": rel(loss_sum, loss_ref.detach()), "logits": rel(logits[keep], logits_ref[where])}
    ref_grads = full_grads(ref, None, tp > 1)
    for name, g in full_grads(model, group, tp > 1).items():
        errs[name] = rel(g, ref_grads[name])
    errs["layout"] = model.decoder.layers[0].self_attention.core_attention.batch_context(psp).sharding.balance
    return errs


CASES = [
    pytest.param(2, "p2p", "workload", None, 1, True, id="cp2-p2p-padded-load_balance=workload"),
    pytest.param(2, "all_gather", "dualchunk", None, 1, True, id="cp2-all_gather-padded-load_balance=dualchunk"),
    pytest.param(4, "a2a", "contiguous", None, 1, True, id="cp4-a2a-padded-load_balance=contiguous"),
    pytest.param(4, "a2a+p2p", "workload", (2, 2), 1, True, id="cp4-a2a+p2p-padded"),
    pytest.param(4, "p2p", "te", None, 1, False, id="cp4-p2p-unpadded-megatron-0.19-style"),
    pytest.param(4, "p2p", "te", None, 2, True, id="tp2-sp-cp2-p2p-padded"),
]


@pytest.mark.parametrize("world,comm,load_balance,hcp,tp,with_padded", CASES)
def test_gpt_on_megatrons_thd_split_matches_cp1(world, comm, load_balance, hcp, tp, with_padded) -> None:
    for rank, errs in enumerate(run_on_ranks(world, te_layout_case, comm, load_balance, hcp, tp, with_padded)):
        assert errs.pop("layout") == "te", rank
        assert len(errs) > 20, errs.keys()  # loss, logits and every parameter of the model
        bad = {k: v for k, v in errs.items() if not v <= 2e-5}
        assert not bad, f"rank {rank}: {world} ranks {comm} (tp {tp}) differs from CP 1: {bad}"

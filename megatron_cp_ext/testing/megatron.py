"""Helpers for multi-rank Megatron tests: parallel_state set-up and CP vs CP-1 comparison.

Used inside :func:`~megatron_cp_ext.testing.pool.run_on_ranks` workers; needs megatron-core.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

__all__ = ["setup_parallel_state", "cp_vs_cp1_errors", "token_batches", "model_vs_cp1_errors", "megatron_dual_chunk"]


def setup_parallel_state(cp: int, hcp_sizes: tuple[int, ...] | None = None, tp: int = 1, hybrid: bool = False) -> None:
    """(Re)initialise Megatron's parallel_state with CP size ``cp`` (hierarchical CP sizes
    ``[a2a, p2p]``), TP size ``tp`` and, with ``hybrid``, the hybrid DP×CP groups of every
    power-of-2 size (``hybrid_context_parallel``), unless a pool worker already has exactly
    that layout."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        hcp = parallel_state.get_hierarchical_context_parallel_groups(check_initialized=False)
        have = tuple(dist.get_world_size(g) for g in hcp) if hcp else None
        same = parallel_state.get_context_parallel_world_size() == cp
        same = same and parallel_state.get_tensor_model_parallel_world_size() == tp
        same = same and bool(getattr(parallel_state, "_HYBRID_DP_CP_GROUPS", None)) == hybrid
        if same and have == (tuple(hcp_sizes) if hcp_sizes else None):
            return
        old = _groups_of(parallel_state)
        parallel_state.destroy_model_parallel()
        live = dist.distributed_c10d._world.pg_map
        for group in old:  # Megatron forgets its groups without destroying them: each keeps gloo threads
            if group in live:
                dist.destroy_process_group(group)
    # destroy_model_parallel (megatron-core 0.16) leaves the hierarchical and hybrid CP groups behind.
    parallel_state._HIERARCHICAL_CONTEXT_PARALLEL_GROUPS = None
    if hasattr(parallel_state, "_HYBRID_DP_CP_GROUPS"):
        parallel_state._HYBRID_DP_CP_GROUPS = {}
    kwargs = {"hybrid_context_parallel": True} if hybrid else {}
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        context_parallel_size=cp,
        hierarchical_context_parallel_sizes=list(hcp_sizes) if hcp_sizes else None,
        **kwargs,
    )


def megatron_dual_chunk(batch: dict, group) -> dict:
    """Megatron's own dual-chunk split of ``[b, s, ...]`` tensors over ``group`` (None: not
    split): ``get_batch_on_this_cp_rank(batch, cp_group=)`` in 0.16; from 0.19 the same function
    takes ``is_hybrid_cp`` first and, for a batch without ``cu_seqlens``, splits alike."""
    import inspect

    from megatron.core.utils import get_batch_on_this_cp_rank

    if group is None:
        return batch
    if "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters:
        return get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=group)
    return get_batch_on_this_cp_rank(batch, cp_group=group)


def _groups_of(parallel_state) -> list:
    """Every process group Megatron's parallel_state holds (the default group excepted), once."""
    found: dict[int, dist.ProcessGroup] = {}
    for value in vars(parallel_state).values():
        if isinstance(value, dict):  # the hybrid DP×CP groups, by size
            value = list(value.values())
        for g in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(g, dist.ProcessGroup) and g is not dist.group.WORLD:
                found[id(g)] = g
    return list(found.values())


def cp_vs_cp1_errors(
    model: torch.nn.Module,
    ref: torch.nn.Module,
    run: Callable[[torch.nn.Module, torch.Tensor, bool], torch.Tensor],
    x: torch.Tensor,
    index: torch.Tensor,
    group: dist.ProcessGroup | None,
) -> dict[str, float]:
    """Max abs differences between a CP model on its shard and its CP-1 twin on everything,
    each divided by the twin's largest magnitude where that exceeds 1.

    ``x``: the global input; ``index``: this rank's rows of ``x`` (dim 0) and of the output;
    ``run(module, input, is_cp)`` returns the output. Compares the output, the input gradient
    and every parameter gradient (the CP model's partial gradients summed over ``group``, as
    Megatron's gradient reduction does). A missing gradient counts as an infinite difference.
    A parameter gradient summed over every token (a final norm's, about 60 for 600 tokens)
    differs between CP and CP 1 by its summation order, a few fp32 ulps of its magnitude: so
    differences are relative to magnitudes above 1 and absolute below.
    """
    x_ref, x_cp = x.clone().requires_grad_(), x[index].clone().requires_grad_()
    y_ref = run(ref, x_ref, False)
    w_full = torch.randn(y_ref.shape, generator=torch.Generator().manual_seed(2))
    (y_ref * w_full).sum().backward()
    y_cp = run(model, x_cp, True)
    (y_cp * w_full[index]).sum().backward()
    errs = {"out": _diff(y_cp, y_ref[index]), "dx": _diff(x_cp.grad, x_ref.grad[index])}
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        g_ref = ref_params[name].grad
        if p.grad is None or g_ref is None:
            errs[name] = float("inf")
            continue
        g = p.grad.clone()
        if group is not None:
            dist.all_reduce(g, group=group)
        errs[name] = _diff(g, g_ref)
    return errs


def _diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """Max abs difference over ``max(1, max |want|)`` (see :func:`cp_vs_cp1_errors`)."""
    if want.numel() == 0:
        return 0.0 if got.shape == want.shape else float("inf")
    return ((got - want).abs().max() / want.abs().max().clamp_min(1.0)).item()


def token_batches(rank: int, world: int, group, fmt: str, *, lengths: list[int], shape: tuple[int, int], vocab: int):
    """``(full, local, index)``: a random token batch for a CP-1 twin, this rank's CP shard of
    it (``shard_batch_for_cp``) and the global token positions of the shard's rows.

    ``fmt="thd"``: one packed row of documents ``lengths`` (cut by the default balance);
    otherwise a ``shape = (seq, batch)`` sbhd batch split in Megatron's dual-chunk order.
    """
    from megatron_cp_ext.megatron import make_packed_seq_params, shard_batch_for_cp
    from megatron_cp_ext.megatron.batch import zigzag_positions

    gen = torch.Generator().manual_seed(3)
    if fmt == "thd":
        cu = torch.tensor([0, *lengths]).cumsum(0)
        tokens = torch.randint(0, vocab, (1, int(cu[-1])), generator=gen)
        psp = make_packed_seq_params(cu)  # CP size 1 for the twin
        full = {"tokens": tokens, "position_ids": psp._mcx_cp_context.positions("cpu")[None], "packed_seq_params": psp}
        local = shard_batch_for_cp({"tokens": tokens}, cu_seqlens=cu, cp_group=group)
        return full, local, local["packed_seq_params"]._mcx_cp_context.sharding.global_index(rank)
    s, b = shape
    tokens = torch.randint(0, vocab, (b, s), generator=gen)
    full = {"tokens": tokens, "position_ids": torch.arange(s).expand(b, s), "packed_seq_params": None}
    local = {**shard_batch_for_cp({k: full[k] for k in ("tokens", "position_ids")}, cp_group=group)}
    local["packed_seq_params"] = None
    return full, local, zigzag_positions(s // world, world, rank)


def model_vs_cp1_errors(model, ref, full: dict, local: dict, index, group, diff: Callable) -> dict[str, float]:
    """``diff(cp, twin)`` of a language model's logits on its shard and of every parameter
    gradient (summed over ``group``) against its CP-1 twin run on the whole batch."""

    def run(module, batch):
        return module(batch["tokens"], batch["position_ids"], None, packed_seq_params=batch["packed_seq_params"])

    y_ref = run(ref, full)
    w = torch.randn(y_ref.shape, generator=torch.Generator().manual_seed(4))
    (y_ref * w).sum().backward()
    y = run(model, local)
    (y * w[:, index]).sum().backward()
    errs = {"logits": diff(y, y_ref[:, index])}
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g, group=group)
        errs[name] = diff(g, ref_params[name].grad)
    return errs

"""Helpers for multi-rank Megatron tests: parallel_state set-up and CP vs CP-1 comparison.

Used inside :func:`~megatron_cp_ext.testing.pool.run_on_ranks` workers; needs megatron-core.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

__all__ = ["setup_parallel_state", "cp_vs_cp1_errors"]


def setup_parallel_state(cp: int, hcp_sizes: tuple[int, ...] | None = None) -> None:
    """(Re)initialise Megatron's parallel_state with CP size ``cp`` (and hierarchical CP
    sizes ``[a2a, p2p]``) unless a pool worker already has exactly that layout."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        hcp = parallel_state.get_hierarchical_context_parallel_groups(check_initialized=False)
        have = tuple(dist.get_world_size(g) for g in hcp) if hcp else None
        if parallel_state.get_context_parallel_world_size() == cp and have == (tuple(hcp_sizes) if hcp_sizes else None):
            return
        parallel_state.destroy_model_parallel()
    # destroy_model_parallel (megatron-core 0.16) leaves the hierarchical CP groups behind.
    parallel_state._HIERARCHICAL_CONTEXT_PARALLEL_GROUPS = None
    parallel_state.initialize_model_parallel(
        context_parallel_size=cp, hierarchical_context_parallel_sizes=list(hcp_sizes) if hcp_sizes else None
    )


def cp_vs_cp1_errors(
    model: torch.nn.Module,
    ref: torch.nn.Module,
    run: Callable[[torch.nn.Module, torch.Tensor, bool], torch.Tensor],
    x: torch.Tensor,
    index: torch.Tensor,
    group: dist.ProcessGroup | None,
) -> dict[str, float]:
    """Max abs differences between a CP model on its shard and its CP-1 twin on everything.

    ``x``: the global input; ``index``: this rank's rows of ``x`` (dim 0) and of the output;
    ``run(module, input, is_cp)`` returns the output. Compares the output, the input gradient
    and every parameter gradient (the CP model's partial gradients summed over ``group``, as
    Megatron's gradient reduction does). A missing gradient counts as an infinite difference.
    """
    x_ref, x_cp = x.clone().requires_grad_(), x[index].clone().requires_grad_()
    y_ref = run(ref, x_ref, False)
    w_full = torch.randn(y_ref.shape, generator=torch.Generator().manual_seed(2))
    (y_ref * w_full).sum().backward()
    y_cp = run(model, x_cp, True)
    (y_cp * w_full[index]).sum().backward()
    errs = {"out": (y_cp - y_ref[index]).abs().max().item(), "dx": (x_cp.grad - x_ref.grad[index]).abs().max().item()}
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        g_ref = ref_params[name].grad
        if p.grad is None or g_ref is None:
            errs[name] = float("inf")
            continue
        g = p.grad.clone()
        if group is not None:
            dist.all_reduce(g, group=group)
        errs[name] = (g - g_ref).abs().max().item()
    return errs

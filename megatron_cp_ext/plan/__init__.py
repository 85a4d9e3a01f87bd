"""The runtime planner: the host-side varlen calls of every step (:mod:`.calls`), built once per
micro-batch by every schedule and read back through :func:`megatron_cp_ext.inspect_plan`. The
planning tools that price plans (cost model, profiles, ``auto``, ``mcx-plan``) sit above
``inspect`` in :mod:`megatron_cp_ext.planner`; nothing here imports them."""

from .calls import MAX_SLICE_CALLS, Layout, StepPlan, VarlenCall, merge_ranges, plan_steps, visible_rows

__all__ = ["Layout", "VarlenCall", "StepPlan", "plan_steps", "visible_rows", "merge_ranges", "MAX_SLICE_CALLS"]

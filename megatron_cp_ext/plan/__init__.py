"""Planning: the host-side varlen calls of every step (:mod:`.calls`), built once per
micro-batch and read back through :func:`megatron_cp_ext.inspect_plan`."""

from .calls import MAX_SLICE_CALLS, Layout, StepPlan, VarlenCall, merge_ranges, plan_steps, visible_rows

__all__ = ["Layout", "VarlenCall", "StepPlan", "plan_steps", "visible_rows", "merge_ranges", "MAX_SLICE_CALLS"]

"""Planning tools, above :mod:`megatron_cp_ext.inspect`: the cost model (:mod:`.cost`), hardware
profiles (:mod:`.profiles`, ``calibration.json``), ``comm_type="auto"`` (:mod:`.auto`) and the
``mcx-plan`` command line (:mod:`.cli`, :mod:`.plot`; also ``python -m megatron_cp_ext.planner``).

They price what :func:`~megatron_cp_ext.inspect_plan` reports, so they read ``inspect`` and the
runtime and nothing below imports them; the runtime planner the schedules run is
:mod:`megatron_cp_ext.plan`. Importing this package installs :func:`.auto.resolve` as
``cp_attention``'s ``auto`` chooser.
"""

from . import auto

__all__ = ["auto"]

"""Whether this thread's host tensors stand in for device ones.

A CPU test of the no-sync rule (:func:`megatron_cp_ext.testing.syncguard.no_host_reads`) runs
what a GPU runs with CPU tensors. Checks that read a tensor's values only because it lives on
the host (free there, a sync on a device) then take the device's path instead.
"""

from __future__ import annotations

import threading

__all__ = ["STAND_IN", "host_as_device"]

STAND_IN = threading.local()
"""``STAND_IN.on``: set by the no-sync guard for its thread."""


def host_as_device() -> bool:
    return getattr(STAND_IN, "on", False)

"""KV-movement schedules. Each is ``build_plan`` + ``forward`` + ``backward`` over the shared
step machinery in :mod:`.common`; none carries its own kernels or merge."""

from . import all_gather, p2p

SCHEDULES = {"p2p": p2p, "all_gather": all_gather}

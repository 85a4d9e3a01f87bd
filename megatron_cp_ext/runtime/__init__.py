"""Runtime plumbing under every schedule, the lowest layer: argument checks (:mod:`.validation`),
process groups (:mod:`.groups`), peer exchanges and gathers (:mod:`.comm`) with their buffers in
flight (:mod:`.inflight`), the cross-rank agreement before a plan is trusted (:mod:`.agreement`),
and the row-movement and merge primitives (:mod:`.ops`). Nothing here knows masks, shardings or
plans."""

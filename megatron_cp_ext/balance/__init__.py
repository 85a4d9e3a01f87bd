"""How a batch is cut across CP ranks when ``balance="workload"``: the equal-token, balanced-work
stream (:mod:`.workload`, its unit order :mod:`.workload_order` and falling-density mirror
:mod:`.workload_mirror`) and the host scoring of candidate cuts on small ranks (:mod:`.pick`,
with exact flash tile areas from :mod:`.tile_pick`). Below :mod:`megatron_cp_ext.sharding`,
which turns a cut into a :class:`~megatron_cp_ext.CPSharding`; it never imports it."""

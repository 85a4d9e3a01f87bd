"""Every bad input gets the same clear error on every rank — never a hang or a wrong result.

Each case runs on a gloo pool under a short watchdog (a hang fails in seconds, and the pool
is rebuilt) and requires: every rank raised, the same exception class (the expected one) and
the same message on every rank, and the message names the argument. Cases where every rank
passes the same bad value run at 2 ranks; rank-divergent ones (one rank differs) at 2 and 4;
check-mode drift (a valid first call caches the plan, then one rank changes) at 2 and 4.
Valid-but-unusual inputs must be accepted on every rank.
"""

import math

import numpy as np
import pytest
import torch

from megatron_cp_ext.runtime.validation import CPArgumentError as VE
from megatron_cp_ext.runtime.validation import CPArgumentTypeError as TE
from megatron_cp_ext.runtime.validation import CPRankMismatchError as ME
from megatron_cp_ext.testing.faults import Fault, attempt
from megatron_cp_ext.testing.pool import run_on_ranks

WATCHDOG_S = 25

# Every rank passes the same bad value: raised before any collective of the attention.
UNIFORM = [
    Fault("q_not_tensor", dict(q="list"), TE, "q must be a torch.Tensor"),
    Fault("cp_group_garbage", dict(cp_group="garbage"), TE, "cp_group"),
    Fault("cp_group_list_for_p2p", dict(cp_group="list"), TE, "cp_group"),
    Fault("a2a_p2p_single_group", dict(comm_type="a2a+p2p", cp_group="world"), TE, "cp_group"),
    Fault("comm_type_unknown", dict(comm_type="ring"), VE, "comm_type must be one of"),
    Fault("comm_type_int", dict(comm_type=3), TE, "comm_type"),
    Fault("qkv_format_unknown", dict(qkv_format="bhsd"), VE, "qkv_format"),
    Fault("qkv_format_none", dict(qkv_format=None), TE, "qkv_format"),
    Fault("sharding_missing", dict(sharding=None), TE, "sharding"),
    Fault("sharding_with_bshd", dict(qkv_format="bshd", sharding="x"), VE, "sharding"),
    Fault("causal_int", dict(causal=1), TE, "causal"),
    Fault("causal_str", dict(causal="yes"), TE, "causal"),
    Fault("window_int", dict(window_size=5), TE, "window_size"),
    Fault("window_none", dict(window_size=None), TE, "window_size"),
    Fault("window_float", dict(window_size=(2.7, 0)), TE, "window_size"),
    Fault("window_whole_float", dict(window_size=(2.0, 0)), TE, "window_size"),
    Fault("window_str", dict(window_size=("1", 0)), TE, "window_size"),
    Fault("window_bool", dict(window_size=(True, 0)), TE, "window_size"),
    Fault("window_three", dict(window_size=(1, 2, 3)), VE, "window_size"),
    Fault("window_below_minus_one", dict(window_size=(-2, 0)), VE, "window_size"),
    Fault("chunk_float", dict(chunk_size=16.0), TE, "chunk_size"),
    Fault("chunk_str", dict(chunk_size="16"), TE, "chunk_size"),
    Fault("chunk_zero", dict(chunk_size=0), VE, "chunk_size"),
    Fault("chunk_negative", dict(chunk_size=-3), VE, "chunk_size"),
    Fault("scale_str", dict(softmax_scale="0.5"), TE, "softmax_scale"),
    Fault("scale_bool", dict(softmax_scale=True), TE, "softmax_scale"),
    Fault("scale_tensor", dict(softmax_scale=torch.tensor(0.5)), TE, "softmax_scale"),
    Fault("scale_zero", dict(softmax_scale=0.0), VE, "softmax_scale"),
    Fault("scale_negative", dict(softmax_scale=-1.0), VE, "softmax_scale"),
    Fault("scale_nan", dict(softmax_scale=math.nan), VE, "softmax_scale"),
    Fault("scale_inf", dict(softmax_scale=math.inf), VE, "softmax_scale"),
    Fault("scale_int_past_float", dict(softmax_scale=10**400), VE, "softmax_scale"),
    Fault("scale_inf_in_fp32", dict(softmax_scale=1e39), VE, "softmax_scale"),
    Fault("meta_device", dict(device="meta", requires_grad=False), VE, "meta device"),
    Fault("backend_unknown", dict(backend="triton"), VE, "backend"),
    Fault("backend_none", dict(backend=None), TE, "backend"),
    Fault("backend_flash_on_cpu", dict(backend="flash"), VE, "backend"),
    Fault("check_int", dict(check=1), TE, "check"),
    Fault("return_max_logit_int", dict(return_max_logit=1), TE, "return_max_logit"),
    Fault("dtype_int", dict(dtype="int32", requires_grad=False), VE, "dtype"),
    Fault("dtype_mixed", dict(k_dtype="bfloat16"), VE, "dtype"),
    Fault("heads_not_multiple", dict(hq=3, hkv=2), VE, "num_heads"),
    Fault("qk_head_dims_differ", dict(k_dim=6), VE, "head dims"),
    Fault("v_head_dim_zero", dict(dv=0), VE, "head dim"),
    Fault("tokens_qk_differ", dict(k_tokens=3), VE, "token counts"),
    Fault("extra_token_everywhere", dict(extra_tokens=1), VE, "tokens"),
    Fault("sharding_cp_size", dict(cp_size=4), VE, "cp_size"),
    Fault("bshd_q_not_tensor", dict(qkv_format="bshd", q="list"), TE, "q must be a torch.Tensor"),
    Fault("bshd_given_3d", dict(qkv_format="bshd", thd_tensors=True), VE, "4-D"),
    Fault("bshd_seq_not_divisible", dict(qkv_format="bshd", bshd_local=5), VE, "divisible by 2*cp"),
    Fault("sink_shape", dict(sink=(3,)), VE, "softmax_offset"),
    Fault("sink_list", dict(sink=[0.0, 0.0, 0.0, 0.0]), TE, "softmax_offset"),
]

# One rank differs from the others: every rank must still raise the same error.
DIVERGENT = [
    Fault("comm_type", dict(comm_type="all_gather"), ME, "comm_type differs", ranks=(-1,)),
    Fault("a2a_p2p_vs_p2p", dict(comm_type="p2p", cp_group="world"), ME, "comm_type differs", (-1,),
          base=dict(comm_type="a2a+p2p")),
    Fault("a2a_p2p_plain_pair_vs_p2p", dict(comm_type="p2p", cp_group="world"), ME, "comm_type differs", (0,),
          base=dict(comm_type="a2a+p2p", cp_group="plain_pair")),
    Fault("a2a_vs_p2p", dict(comm_type="a2a"), ME, "comm_type differs", (0,)),
    Fault("softmax_scale", dict(softmax_scale=0.5), ME, "softmax_scale differs", (-1,)),
    Fault("sink_one_rank", dict(sink=(4,)), ME, "softmax_offset differs", (-1,)),
    # values (a learned sink out of sync): compared in check mode only (reading them syncs)
    Fault("sink_values", dict(sink=torch.full((4,), 5.0, requires_grad=True)), ME, "softmax_offset differs", (-1,),
          base=dict(sink=(4,), check=True)),
    Fault("causal", dict(causal=False), ME, "causal differs", (0,)),
    Fault("window", dict(window_size=(3, -1)), ME, "window_size differs", (-1,)),
    Fault("chunk", dict(chunk_size=4), ME, "chunk_size differs", (-1,)),
    Fault("dtype", dict(dtype="bfloat16"), ME, "dtype differs", (0,)),
    Fault("q_heads", dict(hq=2), ME, "q differs", (-1,)),
    Fault("kv_heads", dict(hkv=4), ME, "k/v differs", (-1,)),
    Fault("v_head_dim", dict(dv=6), ME, "v differs", (-1,)),
    Fault("backend_flash_one_cpu_rank", dict(backend="flash"), VE, "backend", (-1,)),
    Fault("grad_one_rank", dict(requires_grad=False), ME, "requires_grad differs", (-1,)),
    Fault("cu_seqlens", dict(cu_seqlens=[0, 11, 18, 40]), ME, "cu_seqlens differs", (-1,),
          base=dict(cu_seqlens=[0, 11, 17, 40])),
    Fault("balance", dict(balance="contiguous"), ME, "sharding differs", (-1,)),
    Fault("extra_token", dict(extra_tokens=1), VE, "tokens", (-1,)),
    Fault("sharding_cp_size", dict(cp_size=8), VE, "cp_size", (0,)),
    Fault("cp_group_none", dict(cp_group="none"), VE, "cp_group", (-1,)),
    Fault("check_flag", dict(check=True), ME, "check differs", (0,)),
    Fault("max_logit_one_rank", dict(return_max_logit=True), ME, "return_max_logit differs", (-1,)),
    Fault("thd_vs_bshd", dict(qkv_format="bshd", sharding=None), ME, "qkv_format differs", (-1,)),
    Fault("window_float_one_rank", dict(window_size=(2.7, 0)), TE, "window_size", (-1,)),
    Fault("chunk_float_one_rank", dict(chunk_size=16.0), TE, "chunk_size", (0,)),
    Fault("scale_str_one_rank", dict(softmax_scale="0.5"), TE, "softmax_scale", (-1,)),
    Fault("scale_int_past_float_one_rank", dict(softmax_scale=10**400), VE, "softmax_scale", (-1,)),
    # check mode reads the sink's values for the exchange: a rank whose tensors cannot be read
    Fault("meta_one_rank_check_sink", dict(device="meta"), VE, "meta device", (-1,), base=dict(sink=(4,), check=True)),
    Fault("q_not_tensor_one_rank", dict(q="list"), TE, "q must be a torch.Tensor", (-1,)),
    Fault("cp_group_garbage_one_rank", dict(cp_group="garbage"), TE, "cp_group", (-1,)),
    Fault("bad_on_two_ranks", dict(causal=1), TE, "causal", (0, -1)),
    # validated before the CP group is resolved: the rank still reports on its group's exchange
    Fault("check_int_one_rank", dict(check=1), TE, "check", (0,)),
    Fault("comm_type_unknown_one_rank", dict(comm_type="ring"), VE, "comm_type must be one of", (-1,)),
    Fault("qkv_format_unknown_one_rank", dict(qkv_format="bhsd"), VE, "qkv_format", (0,)),
    Fault("sharding_missing_one_rank", dict(sharding=None), TE, "sharding", (-1,)),
    Fault("sharding_with_bshd_one_rank", dict(qkv_format="bshd", sharding="x"), VE, "sharding", (0,)),
]  # fmt: skip

# Check mode: the first call builds and caches the plan on every rank; then one rank drifts.
DRIFT = [
    Fault("extra_token", dict(extra_tokens=1), VE, "tokens", (-1,)),
    Fault("dtype", dict(dtype="bfloat16"), ME, "dtype differs", (0,)),
    Fault("softmax_scale", dict(softmax_scale=0.25), ME, "softmax_scale differs", (-1,)),
    Fault("grad", dict(requires_grad=False), ME, "requires_grad differs", (-1,)),
    Fault("heads", dict(hq=8, hkv=4), ME, "q differs", (-1,)),
    Fault("window_float", dict(window_size=(2.7, 0)), TE, "window_size", (0,)),
]
DRIFT = [Fault(f.name, f.change, f.expect, f.names, f.ranks, base=dict(check=True), on_call=1) for f in DRIFT]

# Valid but unusual: accepted on every rank.
ACCEPTED = [
    Fault("scale_numpy_float", dict(softmax_scale=np.float32(0.3)), None),
    Fault("scale_int", dict(softmax_scale=1), None),
    Fault("scale_past_fp32_in_fp64", dict(softmax_scale=1e39, dtype="float64"), None),
    Fault("window_list", dict(window_size=[3, -1]), None),
    Fault("chunk_numpy_int", dict(chunk_size=np.int64(5)), None),
    Fault("causal_numpy_bool", dict(causal=np.True_), None),  # was refused as "not a bool" (numpy 2's name)
    Fault("cu_seqlens_numpy_ints", dict(cu_seqlens=list(np.array([0, 11, 17, 40]))), None),
    Fault("cu_seqlens_int32_tensor", dict(cu_seqlens=torch.tensor([0, 3, 3, 20], dtype=torch.int32)), None),
    Fault("scale_none_vs_explicit", dict(softmax_scale=1 / math.sqrt(8)), None, ranks=(-1,)),
    Fault("backend_auto_vs_reference", dict(backend="reference"), None, ranks=(0,)),
    Fault("check_mode_steady", dict(), None, base=dict(check=True), on_call=1),
    Fault("eval_then_train", dict(requires_grad=True), None, base=dict(requires_grad=False), on_call=1),
    Fault("a2a_heads_uneven", dict(comm_type="a2a", hq=3, hkv=1), None),
    Fault("a2a_sink_uneven_heads", dict(comm_type="a2a", hq=6, hkv=3, sink=(6,)), None),
]


def _assert_same_error(results: list[dict], fault: Fault) -> None:
    if fault.expect is None:
        assert all(r["type"] is None for r in results), results
        return
    assert all(r["type"] is not None for r in results), f"some ranks did not raise: {results}"
    assert all(r["expected_type"] for r in results), f"expected {fault.expect.__name__}: {results}"
    assert len({(r["type"], r["msg"]) for r in results}) == 1, f"ranks raised different errors: {results}"
    assert fault.names in results[0]["msg"], f"message does not name the argument ({fault.names!r}): {results}"


@pytest.mark.parametrize("fault", UNIFORM, ids=lambda f: f.name)
def test_uniform_bad_input(fault):
    _assert_same_error(run_on_ranks(2, attempt, fault, timeout=WATCHDOG_S), fault)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("fault", DIVERGENT, ids=lambda f: f.name)
def test_rank_divergent_input(fault, world):
    _assert_same_error(run_on_ranks(world, attempt, fault, timeout=WATCHDOG_S), fault)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("fault", DRIFT, ids=lambda f: f.name)
def test_check_mode_catches_drift_on_cached_plan(fault, world):
    _assert_same_error(run_on_ranks(world, attempt, fault, timeout=WATCHDOG_S), fault)


@pytest.mark.parametrize("fault", ACCEPTED, ids=lambda f: f.name)
def test_unusual_valid_input_accepted(fault):
    _assert_same_error(run_on_ranks(2, attempt, fault, timeout=WATCHDOG_S), fault)


def test_divergent_comm_type_in_sub_world_cp_groups():
    """World 4 as two CP groups of 2 (data parallel 2). In group {0, 1} rank 0 runs a2a+p2p
    (a hierarchical pair that carries its CP group) and rank 1 p2p: both exchange on that CP
    group and raise; group {2, 3} is valid and runs."""
    fault = Fault("sub_world", dict(comm_type="a2a+p2p", cp_group="half_pair"), ME, "comm_type differs", (0,),
                  base=dict(cp_group="half", cp_size=2, cu_seqlens=[0, 9, 20]))  # fmt: skip
    res = run_on_ranks(4, attempt, fault, timeout=WATCHDOG_S)
    _assert_same_error(res[:2], fault)
    assert res[2]["type"] is None and res[3]["type"] is None, res


def test_world_sized_sharding_in_sub_world_cp_groups():
    """World 4 as two CP groups of 2: rank 0 passes its CP group and a sharding for CP 4 (the
    world size). Its error goes to its CP group's exchange, where rank 1 waits, not to the
    world's (it did, and rank 1 waited forever); group {2, 3} runs."""
    fault = Fault("sub_world_cp4", dict(cp_size=4), VE, "cp_size", (0,),
                  base=dict(cp_group="half", cp_size=2, cu_seqlens=[0, 9, 20]))  # fmt: skip
    res = run_on_ranks(4, attempt, fault, timeout=WATCHDOG_S)
    _assert_same_error(res[:2], fault)
    assert res[2]["type"] is None and res[3]["type"] is None, res


def _pair_passed_p2p_first(rank: int, world: int, plain: bool) -> dict:
    """Worker: every rank passes its hierarchical pair as [p2p, a2a] (``plain``: as a plain
    list, which carries no whole group); the data is cut by index with the CP group's rank (as
    Megatron's batch split does), so no split is on record."""
    import megatron_cp_ext as mcx

    with pytest.raises(VE, match="ascending"):  # new_group orders groups by global rank
        mcx.hierarchical_cp_groups(2, [0, 2, 1, 3])
    pair = mcx.hierarchical_cp_groups(2)
    swapped = [pair[1], pair[0]] if plain else mcx.HierarchicalCPGroups(pair[1], pair[0], pair.cp_group)
    sharding = mcx.shard_sequences([0, 13, 13, 14, 59, 66, 68, 96], world)  # 24 tokens on every rank
    idx = torch.as_tensor(sharding.global_index(rank))
    q, k, v = (torch.randn(96, n, 8, generator=torch.Generator().manual_seed(n))[idx] for n in (4, 2, 2))
    try:
        mcx.cp_attention(q, k, v, cp_group=swapped, comm_type="a2a+p2p", sharding=sharding)
    except VE as err:
        return {"type": type(err), "expected_type": True, "msg": str(err)}
    return {"type": None}


@pytest.mark.parametrize("plain", [False, True], ids=["with_cp_group", "plain_list"])
def test_hierarchical_pair_passed_p2p_first(plain):
    """World 4, a2a size 2: a pair passed [p2p, a2a] is a valid layout whose CP ranks 1 and 2
    are the whole group's 2 and 1, so data cut by the CP group's rank ran silently wrong (max
    error 3.3 against dense fp64; 2.4 as a plain list). Refused on every rank: the pair that
    carries its CP group before any collective, the plain list by the consistency exchange."""
    res = run_on_ranks(4, _pair_passed_p2p_first, plain, timeout=WATCHDOG_S)
    words = "not in global-rank order" if plain else "pair makes this process CP rank"
    _assert_same_error(res, Fault("swapped_pair", dict(), VE, words))


def _sub_group_in_a_world_cp(rank: int, world: int) -> dict:
    """Worker: CP is the world (sharding for CP 4); rank 0 passes a group of [0, 1] by mistake."""
    import torch.distributed as dist

    import megatron_cp_ext as mcx
    from megatron_cp_ext.runtime import agreement

    sub = dist.new_group([0, 1])
    sharding = mcx.shard_sequences([0, 11, 12, 30, 36], world)
    q, k, v = (sharding.shard(torch.randn(36, n, 8), rank) for n in (4, 2, 2))
    saved, agreement.ERROR_WAIT_S = agreement.ERROR_WAIT_S, 8.0  # rank 0 tries [0, 1] for 4 s first
    try:
        mcx.cp_attention(q, k, v, cp_group=sub if rank == 0 else dist.group.WORLD, sharding=sharding)
    except VE as err:
        return {"type": type(err), "expected_type": True, "msg": str(err)}
    finally:
        agreement.ERROR_WAIT_S = saved
    return {"type": None}


def test_sub_world_group_in_a_world_sized_cp():
    """The reverse of the case above: the world is the CP group and rank 0's group is wrong.
    Rank 0 tries its group, then the world, where the others wait."""
    res = run_on_ranks(4, _sub_group_in_a_world_cp, timeout=WATCHDOG_S)
    _assert_same_error(res, Fault("sub_group_cp4", dict(), VE, "cp_group has 2 ranks but sharding.cp_size is 4"))


def test_suite_size():
    """The issue asks for at least 60 bad-input cases, rank-divergent ones included."""
    bad = len(UNIFORM) + 2 * len(DIVERGENT) + 2 * len(DRIFT) + 5
    assert bad >= 60 and len(DIVERGENT) >= 20


def _schedule_on_rank0(rank: int, world: int, value: str) -> dict:
    """Rank 0 runs under another ``MEGATRON_CP_EXT_P2P_SCHEDULE`` (set per process)."""
    from megatron_cp_ext import schedules

    before = schedules.P2P_SCHEDULE
    if rank == 0:
        schedules.P2P_SCHEDULE = value
    try:
        return attempt(rank, world, Fault("schedule", {}, VE, "MEGATRON_CP_EXT_P2P_SCHEDULE"))
    finally:
        schedules.P2P_SCHEDULE = before


@pytest.mark.parametrize(("value", "expect"), [("ring", ME), ("bogus", VE)])
def test_p2p_schedule_that_differs_or_is_unknown_on_one_rank(value, expect) -> None:
    """Read per process from the environment: a rank on the ring while its peers run staged would
    hang in the backward, and an unknown name raised on that rank alone; now one error everywhere."""
    fault = Fault("schedule", {}, expect, "MEGATRON_CP_EXT_P2P_SCHEDULE")
    results = run_on_ranks(2, _schedule_on_rank0, value, timeout=WATCHDOG_S)
    for r in results:
        r["expected_type"] = r["type"] == expect.__name__
    _assert_same_error(results, fault)

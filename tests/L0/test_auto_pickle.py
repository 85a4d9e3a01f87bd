"""``comm_type="auto"``'s choice travels with a pickled sharding (a data-loader worker makes it)."""

import pickle

import torch

import megatron_cp_ext as mcx
from megatron_cp_ext.masks import MaskSpec
from megatron_cp_ext.planner import auto
from megatron_cp_ext.planner.profiles import load_profile


def test_choice_survives_pickling(monkeypatch):
    sharding = mcx.shard_sequences([0, 300, 340, 1000], 4)
    kw = dict(
        candidates=("p2p", "all_gather", "a2a"), a2a_size=4, num_heads=8, num_kv_heads=2, head_dim=64,
        v_head_dim=64, dtype=torch.bfloat16, profile=load_profile("h100-nvlink-ib400"),
    )  # fmt: skip
    mask = MaskSpec.make(causal=True, window_size=(-1, -1), chunk_size=None)
    made = auto.choose_comm_type(sharding, mask, **kw)
    copy = pickle.loads(pickle.dumps(sharding))

    def no_pricing(*a, **k):
        raise AssertionError("the unpickled sharding priced the candidates again")

    monkeypatch.setattr(auto, "inspect_plan", no_pricing)
    monkeypatch.setattr(auto, "estimate_times", no_pricing)
    assert auto.choose_comm_type(copy, mask, **kw) == made

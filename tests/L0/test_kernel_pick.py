"""The local kernel pick (``backends/pick.py``): a pure function of the call's host-known shape,
the device class and the table; respects what each kernel can express; falls back when a
candidate is missing; honours the overrides; reads back what the GPU suite writes. CUDA
candidates are simulated on the CPU by monkeypatching their availability and kernels."""

import dataclasses
import itertools
import json
import logging

import pytest
import torch

from megatron_cp_ext.backends import backend_name, get_backend, pick, reference

ALL = frozenset(pick.KERNELS)
EMPTY = {"devices": {}}
CUDNN_EVERYWHERE = {"devices": {"H100": {"rules": [{"kernel": "cudnn"}]}}}


def _shape(**kw) -> pick.CallShape:
    base = dict(dtype="bf16", d=128, dv=128, mask="none", gqa=4, tokens=4096, max_seqlen=2048)
    return pick.CallShape(**{**base, **kw})


def _grid():
    for dtype, mask, (d, dv), gqa, tokens in itertools.product(
        ("bf16", "fp16", "fp32", "fp64"), ("causal", "none", "window"), ((128, 128), (192, 128), (64, 64)),
        (1, 4), (1, 1024, 131072),
    ):  # fmt: skip
        yield _shape(dtype=dtype, mask=mask, d=d, dv=dv, gqa=gqa, tokens=tokens)


def test_device_class_from_name():
    assert pick.device_class_of("NVIDIA H100 80GB HBM3", (9, 0)) == "H100"
    assert pick.device_class_of("NVIDIA H200", (9, 0)) == "H200"
    assert pick.device_class_of("NVIDIA GH200 480GB", (9, 0)) == "GH200"
    assert pick.device_class_of("NVIDIA A100-SXM4-80GB", (8, 0)) == "A100"
    assert pick.device_class_of("Tesla V100-SXM2-16GB", (7, 0)) == "sm70"
    assert pick.device_class(torch.device("cpu")) == "cpu"


def test_default_order_is_todays_choice():
    s = _shape()
    assert pick.pick("H100", s, ALL, EMPTY) == "flash_attn"
    assert pick.pick("H100", s, ALL - {"flash_attn"}, EMPTY) == "aten_flash"
    assert pick.pick("cpu", s, {"reference"}, EMPTY) == "reference"
    assert pick.pick("cpu", _shape(dtype="fp64"), {"reference"}, CUDNN_EVERYWHERE) == "reference"
    # a class with no entry in a measured table: the default order too
    assert pick.pick("A100", s, ALL, CUDNN_EVERYWHERE) == "flash_attn"


def test_cudnn_only_where_it_can_express_the_call():
    shapes = [*_grid(), _shape(d=320, dv=320), _shape(d=264, dv=128), _shape(d=128, dv=12)]
    picked = {s: pick.pick("H100", s, ALL, CUDNN_EVERYWHERE) for s in shapes}
    for s, name in picked.items():
        expressible = s.dtype in ("bf16", "fp16") and s.d % 8 == 0 and s.dv % 8 == 0 and max(s.d, s.dv) <= 256
        assert (name == "cudnn") == expressible, (s, name)
        assert name != "reference"  # auto on CUDA never silently runs the slow exact kernel
    assert sum(n == "cudnn" for n in picked.values()) == 2 * 3 * 3 * 2 * 3  # dtypes x masks x dims x gqa x tokens


def test_deterministic_and_memoised():
    a = [pick.pick("H100", s, ALL, CUDNN_EVERYWHERE) for s in _grid()]
    b = [pick.pick("H100", s, set(ALL), json.loads(json.dumps(CUDNN_EVERYWHERE))) for s in _grid()]
    assert a == b
    q = torch.empty(1000, 8, 64, device="meta")
    kv = torch.empty(1000, 2, 64, device="meta")
    s1 = pick.call_shape(q, kv, kv, 700, True, (-1, 0))
    s2 = pick.call_shape(q[:600], kv, kv, 513, True, (-1, 0))
    assert s1 == s2 == _shape(dtype="fp32", d=64, dv=64, mask="causal", gqa=4, tokens=512, max_seqlen=512)
    assert pick.call_shape(q, kv, kv, 9, False, (-1, -1)).mask == "none"
    assert pick.call_shape(q, kv, kv, 9, True, (8, 0)).mask == "window"
    assert pick.call_shape(q, kv, kv, 9, False, (3, 5)).mask == "window"


def test_fallback_when_unavailable(monkeypatch):
    table = {"devices": {"H100": {"rules": [{"mask": "none", "kernel": "cudnn"}, {"kernel": "flash_attn"}]}}}
    assert pick.pick("H100", _shape(), ALL, table) == "cudnn"
    assert pick.pick("H100", _shape(), ALL - {"cudnn"}, table) == "flash_attn"
    assert pick.pick("H100", _shape(), {"aten_flash", "reference"}, table) == "aten_flash"
    # nothing can express it (head dim 512): the first available of the default order, as before
    assert pick.pick("H100", _shape(d=512, dv=512), {"aten_flash", "cudnn"}, table) == "aten_flash"


def test_rules_first_match_and_token_ranges():
    rules = [
        {"dtype": "bf16", "mask": "none", "min_tokens": 8192, "kernel": "cudnn"},
        {"dtype": "bf16", "mask": "none", "max_tokens": 8192, "kernel": "aten_flash"},
    ]
    table = {"devices": {"H100": {"rules": rules}}}
    assert pick.pick("H100", _shape(tokens=8192), ALL, table) == "cudnn"
    assert pick.pick("H100", _shape(tokens=4096), ALL, table) == "aten_flash"
    assert pick.pick("H100", _shape(tokens=4096, mask="causal"), ALL, table) == "flash_attn"


def test_same_architecture_fills_what_a_rule_did_not_time():
    """A rule that timed only its own kernel yields to a rule of the same architecture that timed
    that kernel and beat it with a candidate available here; a rule that timed both stands; a
    class without rules takes the widest comparison of its architecture; other architectures
    are untouched."""
    fa2 = {"mask": "none", "kernel": "aten_flash", "compared": ["aten_flash"]}
    both = {"mask": "none", "kernel": "cudnn", "compared": ["aten_flash", "cudnn"]}
    table = {"devices": {"H100": {"rules": [fa2]}, "H200": {"rules": [both]}}}
    name, why = pick.pick_why("H100", _shape(), ALL, table)
    assert name == "cudnn" and why.startswith("table rule for H200, same architecture as H100")
    assert pick.pick("H100", _shape(), ALL - {"cudnn"}, table) == "aten_flash"  # not installed here
    assert pick.pick("H100", _shape(mask="causal"), ALL, table) == "flash_attn"  # no rule matches
    assert pick.pick("H800", _shape(), ALL, table) == pick.pick("sm90", _shape(), ALL, table) == "cudnn"
    assert pick.pick("A100", _shape(), ALL, table) == "flash_attn"
    timed = {"devices": {"H100": {"rules": [{**fa2, "compared": ["aten_flash", "cudnn"]}]}, "H200": {"rules": [both]}}}
    assert pick.pick("H100", _shape(), ALL, timed) == "aten_flash"  # its own measurement of both
    bare = {"devices": {"H100": {"rules": [fa2]}, "H200": {"rules": [{"mask": "none", "kernel": "cudnn"}]}}}
    assert pick.pick("H100", _shape(), ALL, bare) == "aten_flash"  # no evidence against FA2


def test_shipped_table_on_hopper():
    """The shipped table: the H100's rules timed FA2 alone and the H200's timed cuDNN against it,
    so a Hopper with cudnn-frontend runs cuDNN, and one without it PyTorch's flash."""
    table = pick.load_table(pick.TABLE)
    for cls, mask, tokens in itertools.product(("H100", "H200", "H800"), ("causal", "none", "window"), (1024, 1 << 17)):
        s = _shape(mask=mask, tokens=tokens)
        assert pick.pick(cls, s, {"aten_flash", "cudnn"}, table) == "cudnn", (cls, s)
        assert pick.pick(cls, s, {"aten_flash"}, table) == "aten_flash", (cls, s)


def _fake_cuda(monkeypatch, log: list) -> None:
    """Every CUDA candidate 'available', each running the reference and logging its name."""
    for name in ("flash_attn", "aten_flash", "cudnn"):
        k = pick.KERNELS[name]

        def fwd(*a, _n=name):
            log.append((_n, "fwd"))
            return reference.attn_fwd(*a)

        def bwd(*a, _n=name):
            log.append((_n, "bwd"))
            return reference.attn_bwd(*a)

        monkeypatch.setitem(pick.KERNELS, name, dataclasses.replace(k, fwd=fwd, bwd=bwd, available=lambda d: True))
    monkeypatch.setattr(pick, "device_class", lambda device: "H100")


def _call(p, causal: bool, window: tuple[int, int]) -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(12, h, 16, generator=g, dtype=torch.bfloat16) for h in (4, 2, 2))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    args = (cu, cu, 7, 7, causal, window, 0.25)
    out, lse = p.attn_fwd(q, k, v, *args)
    want, want_lse = reference.attn_fwd(q, k, v, *args)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    p.attn_bwd(torch.ones_like(out), q, k, v, out, lse, *args)


def test_picker_routes_each_call(monkeypatch):
    log: list = []
    _fake_cuda(monkeypatch, log)
    monkeypatch.delenv("MCX_KERNEL", raising=False)
    p = pick.Picker(torch.device("cpu"), table=CUDNN_EVERYWHERE)
    assert backend_name(p) == "flash" and p.max_logit is reference.max_logit
    _call(p, False, (-1, -1))
    _call(p, True, (-1, 0))
    _call(p, True, (3, 0))
    assert log == [("cudnn", "fwd"), ("cudnn", "bwd")] * 3
    # a candidate that cannot express a call: the next one runs it
    log.clear()
    k = pick.KERNELS["cudnn"]
    monkeypatch.setitem(pick.KERNELS, "cudnn", dataclasses.replace(k, supports=lambda s: s.mask == "none"))
    p = pick.Picker(torch.device("cpu"), table=CUDNN_EVERYWHERE)
    _call(p, False, (-1, -1))
    _call(p, True, (-1, 0))
    assert log == [("cudnn", "fwd"), ("cudnn", "bwd"), ("flash_attn", "fwd"), ("flash_attn", "bwd")]
    # override: MCX_KERNEL first, where it can express the call
    log.clear()
    monkeypatch.setenv("MCX_KERNEL", "aten_flash")
    p = pick.Picker(torch.device("cpu"), table=CUDNN_EVERYWHERE)
    _call(p, False, (-1, -1))
    assert log == [("aten_flash", "fwd"), ("aten_flash", "bwd")]
    monkeypatch.setenv("MCX_KERNEL", "cudnn")
    log.clear()
    _call(pick.Picker(torch.device("cpu"), table=EMPTY), True, (-1, 0))
    assert log == [("flash_attn", "fwd"), ("flash_attn", "bwd")]
    monkeypatch.setenv("MCX_KERNEL", "triton")
    with pytest.raises(ValueError, match="MCX_KERNEL"):
        pick.Picker(torch.device("cpu"), table=EMPTY)


def test_backend_argument_still_overrides():
    assert get_backend(torch.device("cpu")) is reference
    assert get_backend(torch.device("cpu"), "reference") is reference
    assert backend_name(reference) == "reference"


def test_suite_entry_round_trip(tmp_path, monkeypatch):
    rows = []
    for tokens, fast in ((16384, "aten_flash"), (131072, "cudnn")):
        for kernel in ("aten_flash", "cudnn"):
            t = 1.0 if kernel == fast else 2.0
            rows.append(dict(dtype="bf16", d=128, dv=128, gqa=4, mask="none", tokens=tokens, kernel=kernel, seconds=t))
        rows.append(dict(dtype="bf16", d=128, dv=128, gqa=4, mask="causal", tokens=tokens, kernel="aten_flash",
                         seconds=1.0))  # fmt: skip
    entry = pick.entry_from_measurements(rows, "test")
    path = str(tmp_path / "table.json")
    pick.write_entry("H100", entry, path)
    pick.write_entry("cpu", pick.entry_from_measurements([], "empty"), path)
    monkeypatch.setenv("MCX_KERNEL_TABLE", path)
    table = pick.load_table()
    assert set(table["devices"]) == {"H100", "cpu"} and table["devices"]["H100"] == entry
    assert {tuple(r["compared"]) for r in entry["rules"] if r["mask"] == "none"} == {("aten_flash", "cudnn")}
    assert {tuple(r["compared"]) for r in entry["rules"] if r["mask"] == "causal"} == {("aten_flash",)}
    picks = {t: pick.pick("H100", _shape(tokens=t), ALL - {"flash_attn"}, table) for t in (1024, 16384, 32768, 1 << 20)}
    assert picks == {1024: "aten_flash", 16384: "aten_flash", 32768: "cudnn", 1 << 20: "cudnn"}
    with open(path, "w") as f:
        json.dump({"devices": {"H100": {"rules": [{"kernel": "fa9"}]}}}, f)
    with pytest.raises(ValueError, match="unknown kernel"):
        pick.load_table(path)


def test_pick_is_logged_once_with_its_reason(monkeypatch, caplog):
    log: list = []
    _fake_cuda(monkeypatch, log)
    monkeypatch.delenv("MCX_KERNEL", raising=False)
    p = pick.Picker(torch.device("cpu"), table=CUDNN_EVERYWHERE)
    with caplog.at_level(logging.INFO, logger="megatron_cp_ext.kernels"):
        for _ in range(3):
            _call(p, False, (-1, -1))
    said = [r.getMessage() for r in caplog.records if "local attention kernel" in r.getMessage()]
    assert len(said) == 1 and "cudnn (table rule for H100)" in said[0], said
    name, why = pick.pick_why("H100", _shape(d=320, dv=320), ALL, CUDNN_EVERYWHERE)
    assert name == "flash_attn" and "cudnn (table rule for H100) cannot express the call" in why
    name, why = pick.pick_why("H100", _shape(), ALL - {"cudnn"}, CUDNN_EVERYWHERE)
    assert name == "flash_attn" and "cudnn (table rule for H100) not available" in why

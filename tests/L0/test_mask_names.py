"""Megatron AttnMaskType names -> cp_attention flags."""

import enum

import pytest

import megatron_cp_ext as mcx
from megatron_cp_ext.masks.names import MASK_NAMES


class FakeAttnMaskType(enum.Enum):
    """Same member names as Megatron's enum, so the test does not need Megatron."""

    padding = 1
    causal = 2
    no_mask = 3
    padding_causal = 4
    arbitrary = 5
    causal_bottom_right = 6


@pytest.mark.parametrize(
    "name, causal",
    [("causal", True), ("no_mask", False), ("padding", False), ("padding_causal", True), ("causal_bottom_right", True)],
)
def test_names_and_enum_members(name, causal):
    assert mcx.mask_flags(name) == {"causal": causal}
    assert mcx.mask_flags(FakeAttnMaskType[name]) == {"causal": causal}


def test_megatron_enum_when_installed():
    enums = pytest.importorskip("megatron.core.transformer.enums")
    for member in enums.AttnMaskType:
        if member.name in MASK_NAMES:
            assert mcx.mask_flags(member) == mcx.mask_flags(member.name)


def test_unknown_names_list_the_valid_ones():
    for bad in ("arbitrary", FakeAttnMaskType.arbitrary, "causal_top_left"):
        with pytest.raises(ValueError, match="valid: causal, no_mask, padding, padding_causal, causal_bottom_right"):
            mcx.mask_flags(bad)
    with pytest.raises(ValueError, match="attn_mask_type"):
        mcx.mask_flags(3)


def test_padding_needs_thd():
    assert mcx.mask_flags("causal", qkv_format="sbhd") == {"causal": True}
    for name in ("padding", "padding_causal"):
        with pytest.raises(ValueError, match="qkv_format='thd'"):
            mcx.mask_flags(name, qkv_format="bshd")


def test_bottom_right_causal_needs_equal_lengths():
    cu = [0, 5, 12]
    assert mcx.mask_flags("causal_bottom_right", cu_seqlens_q=cu, cu_seqlens_kv=list(cu)) == {"causal": True}
    with pytest.raises(ValueError, match="different query and key lengths"):
        mcx.mask_flags("causal_bottom_right", cu_seqlens_q=cu, cu_seqlens_kv=[0, 7, 12])


def test_a_right_window_under_a_causal_mask_warns_and_is_ignored():
    """As TransformerEngine does: ``(left, right > 0)`` with a causal mask is ``(left, 0)``,
    said in a warning; ``(left, 0)`` and ``(left, -1)`` say nothing."""
    import warnings

    from megatron_cp_ext.masks import MaskSpec

    with pytest.warns(UserWarning, match=r"right window is ignored \(the mask is \(4, 0\)\)"):
        spec = MaskSpec.make(causal=True, window_size=(4, 4))
    assert (spec.left, spec.right) == (4, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        MaskSpec.make(causal=True, window_size=(4, 0))
        MaskSpec.make(causal=True, window_size=(4, -1))
        MaskSpec.make(causal=False, window_size=(4, 4))

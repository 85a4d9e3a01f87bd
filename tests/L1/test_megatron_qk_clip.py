"""QK-clip (MuonClip) through Megatron's own code: a GPTModel with ``qk_clip=True`` runs two
micro-batches at CP 2/4 and at CP 1 (a twin with the same weights on the whole batch), then
megatron-core's ``optimizer.qk_clip.clip_qk`` reads ``current_max_attn_logits``, clips the q/k
weights and resets the attribute. CP must log the same max logit and clip to the same weights."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_cp_ext.testing.pool import run_on_ranks  # noqa: E402

THRESHOLD = 1.0  # low enough that random weights get clipped (eta < 1)


def _config(cp: int, comm: str, mla: bool, **extra):
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    base = dict(
        num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, context_parallel_size=cp,
        cp_comm_type=comm, hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
        qk_clip=True, qk_clip_threshold=THRESHOLD, qk_clip_alpha=0.5, init_method_std=0.2,
    )  # fmt: skip
    if mla:
        mla_fields = dict(q_lora_rank=16, kv_lora_rank=12, qk_head_dim=8, qk_pos_emb_head_dim=8, v_head_dim=6)
        return MLATransformerConfig(**base, **mla_fields, rotary_base=10000, **extra)
    return TransformerConfig(**base, num_query_groups=2, **extra)


def _twin_pgs():
    from megatron.core.process_groups_config import ProcessGroupCollection

    pgs = ProcessGroupCollection.use_mpu_process_groups()
    pgs.cp = None  # the twin runs alone: CP size 1 through the same code path
    return pgs


def qk_clip_case(rank: int, world: int, fmt: str, comm: str, mla: bool, hcp) -> dict:
    """Worker: max logits, logged value and clipped weights of the CP model vs its CP-1 twin."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer.qk_clip import clip_qk

    from megatron_cp_ext.megatron import cp_layer_spec, install_cp_rope
    from megatron_cp_ext.testing.megatron import setup_parallel_state, token_batches

    setup_parallel_state(world, hcp)
    group = parallel_state.get_context_parallel_group()
    extra = {"hierarchical_context_parallel_sizes": list(hcp)} if comm == "a2a+p2p" else {}

    def gpt(config, pg_collection=None):
        torch.manual_seed(0)
        kw = {"pg_collection": pg_collection} if pg_collection is not None else {}
        m = GPTModel(config, cp_layer_spec(config), vocab_size=64, max_sequence_length=256, **kw)
        install_cp_rope(m)
        return m

    model, ref = gpt(_config(world, comm, mla, **extra)), gpt(_config(1, comm, mla), _twin_pgs())
    ref.load_state_dict(model.state_dict())
    before = {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    full, local, _ = token_batches(rank, world, group, fmt, lengths=[9, 1, 14, 5, 11], shape=(16, 2), vocab=64)
    for shift in (0, 7):  # two micro-batches: the attribute keeps their running max
        for m, batch in ((model, local), (ref, full)):
            tokens = (batch["tokens"] + shift) % 64
            with torch.no_grad():
                m(tokens, batch["position_ids"], None, packed_seq_params=batch["packed_seq_params"])
    cores = [[layer.self_attention.core_attention for layer in m.decoder.layers] for m in (model, ref)]
    max_cp, max_ref = ([c.current_max_attn_logits.clone() for c in cs] for cs in cores)
    wrap = lambda m: SimpleNamespace(module=SimpleNamespace(module=m))  # noqa: E731 - DDP(Float16Module(model))
    logged_cp, logged_ref = clip_qk([wrap(model)]), clip_qk([wrap(ref)])
    after_cp, after_ref = model.state_dict(), ref.state_dict()
    return {
        "max_cp": max_cp,
        "max_ref": max_ref,
        "logged": (logged_cp, logged_ref),
        "reset": all(c.current_max_attn_logits is None for cs in cores for c in cs),
        "weights": max((after_cp[k] - after_ref[k]).abs().max().item() for k in before),
        "clipped": sorted(k for k in before if not torch.equal(before[k], after_cp[k])),
    }


CASES = [
    (2, "thd", "p2p", False),
    (4, "thd", "a2a", False),
    (4, "sbhd", "a2a+p2p", False),
    (2, "thd", "all_gather", True),
    (4, "thd", "p2p", True),
]


@pytest.mark.parametrize("world,fmt,comm,mla", CASES)
def test_qk_clip_at_cp_matches_cp1(world: int, fmt: str, comm: str, mla: bool) -> None:
    results = run_on_ranks(world, qk_clip_case, fmt, comm, mla, (2, world // 2))
    for r in results:
        for m_cp, m_ref in zip(r["max_cp"], r["max_ref"]):
            assert m_cp.shape == (4,) and m_cp.dtype == torch.float32
            torch.testing.assert_close(m_cp, m_ref, rtol=1e-5, atol=1e-5)
        assert max(m.max().item() for m in r["max_ref"]) > THRESHOLD, "the case must actually clip"
        assert r["logged"][0] == pytest.approx(r["logged"][1], rel=1e-5)
        assert r["reset"], "clip_qk resets current_max_attn_logits"
        assert r["clipped"], "no weight was clipped"
        assert r["weights"] < 1e-5, r["weights"]
        torch.testing.assert_close(r["max_cp"], results[0]["max_cp"], rtol=0, atol=0)  # same on every rank

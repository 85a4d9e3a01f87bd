"""``comm_type="auto"``: the comm type the cost model predicts fastest for this micro-batch.

The choice is a pure function of the (global) sharding, the mask, the head shapes, the group
sizes and the profile, so every rank computes the same answer without communicating; it is
cached on the sharding in its own attribute, which — unlike the plans — is pickled with it:
a data-loader worker can call :func:`choose_comm_type` ahead of the step and the training
process finds the answer. The profile is :func:`set_auto_profile`'s, else the
``MCX_PLAN_PROFILE`` environment variable (a name or a file; set it identically on every
rank), else ``h100-nvlink-ib400`` on CUDA and ``cpu-gloo`` on CPU.

Pricing: with a ``flash`` profile the candidates are priced together from one shared geometry
(:mod:`.estimate`: 5-25 ms at 128K tokens on 16 ranks with either built-in balance, where
building every rank's plan for every candidate took about half a second); with the ``reference`` kernel (CPU), or
``exact=True``, from every rank's exact plan (:func:`inspect_plan` and :func:`.cost.predict`).
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch

from .. import attention, schedules
from ..inspect import inspect_plan
from ..masks import MaskSpec
from ..runtime.groups import CPGroups, cp_groups
from ..sharding import CPSharding
from .cost import predict
from .estimate import estimate_times
from .profiles import HardwareProfile, load_profile

__all__ = ["choose_comm_type", "set_auto_profile", "auto_profile", "resolve"]

logger = logging.getLogger("megatron_cp_ext.auto")
_PROFILE: list[HardwareProfile | None] = [None]
_LOGGED: set[tuple] = set()
LAST: list[tuple[str, dict[str, float]] | None] = [None]
"""The latest choice made in this process and its predicted seconds (for tests and logs)."""


def set_auto_profile(spec: str | HardwareProfile | None) -> None:
    """Profile ``auto`` predicts with (a name, a JSON/TOML file, a profile, or None: default)."""
    _PROFILE[0] = None if spec is None else load_profile(spec)


def auto_profile(device: torch.device) -> HardwareProfile:
    if _PROFILE[0] is not None:
        return _PROFILE[0]
    env = os.environ.get("MCX_PLAN_PROFILE")
    if env:
        return load_profile(env)
    return load_profile("h100-nvlink-ib400" if device.type == "cuda" else "cpu-gloo")


def _choices(sharding: CPSharding) -> dict:
    """The sharding's auto choices (an instance attribute: survives pickling, plans do not)."""
    return sharding.__dict__.setdefault("_auto_choices", {})


def choose_comm_type(
    sharding: CPSharding,
    mask: MaskSpec,
    *,
    candidates: tuple[str, ...],
    a2a_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    v_head_dim: int,
    dtype: torch.dtype,
    profile: HardwareProfile,
    backward: bool = True,
    exact: bool = False,
) -> tuple[str, dict[str, float]]:
    """The candidate with the lowest predicted layer time (forward, plus backward if
    ``backward``; ties go to the earlier candidate) and every candidate's predicted seconds.

    ``exact``: price every rank's exact plan even with a ``flash`` profile (the shared-geometry
    estimate's reference; about 30x slower)."""
    exact = exact or profile.kernel != "flash" or sharding.cp_size == 1
    key = (
        "auto", mask, candidates, a2a_size, num_heads, num_kv_heads, head_dim, v_head_dim, dtype, profile, backward,
        exact, schedules.P2P_SCHEDULE,
    )  # fmt: skip
    hit = _choices(sharding).get(key)
    if hit is not None:
        LAST[0] = hit
        return hit
    times: dict[str, float] = {}
    if not exact:
        est = estimate_times(
            sharding, mask, candidates, a2a_size=a2a_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
            head_dim=head_dim, v_head_dim=v_head_dim, element_size=torch.empty(0, dtype=dtype).element_size(),
            profile=profile,
        )  # fmt: skip
        times = {ct: est[ct]["forward"] + (est[ct]["backward"] if backward else 0.0) for ct in candidates}
    for ct in candidates if exact else ():
        rep = inspect_plan(
            sharding, ct, causal=mask.causal, window_size=(mask.left, mask.right), chunk_size=mask.chunk,
            a2a_size=a2a_size if ct == "a2a+p2p" else None, num_heads=num_heads, num_kv_heads=num_kv_heads,
            head_dim=head_dim, v_head_dim=v_head_dim, dtype=dtype,
        )  # fmt: skip
        cost = predict(rep, profile)
        times[ct] = cost.total_s if backward else cost.forward_s
    best = min(candidates, key=lambda ct: times[ct])
    _choices(sharding)[key] = LAST[0] = (best, times)
    note = (best, candidates, sharding.cp_size, profile.name)
    level = logging.INFO if note not in _LOGGED else logging.DEBUG
    _LOGGED.add(note)
    shown = ", ".join(f"{ct} {t * 1e3:.3f} ms" for ct, t in times.items())
    logger.log(level, "cp_attention comm_type=auto chose %s on %s (predicted per layer: %s)", best, profile.name, shown)
    return best, times


def resolve(cp_group, groups: CPGroups, sharding: CPSharding, mask: MaskSpec, shapes) -> tuple[str, CPGroups]:
    """``cp_attention(comm_type="auto")``: the candidates the given ``cp_group`` allows (a2a+p2p
    for an ``(a2a, p2p)`` pair; p2p, all_gather, a2a with a whole CP group), the predicted
    fastest of them under :func:`auto_profile`, and the groups it runs on."""
    pair = isinstance(cp_group, (list, tuple))
    whole = getattr(cp_group, "cp_group", None) if pair else cp_group
    flat = ("p2p", "all_gather", "a2a") if whole is not None else ()
    candidates = (("a2a+p2p",) if pair else ()) + flat
    mask = dataclasses.replace(mask, muted=sharding.muted)  # priced as the plans run: padding takes no part
    best, _ = choose_comm_type(
        sharding, mask, candidates=candidates, a2a_size=groups.a2a_size, num_heads=shapes.hq,
        num_kv_heads=shapes.hkv, head_dim=shapes.dqk, v_head_dim=shapes.dv, dtype=shapes.dtype,
        profile=auto_profile(shapes.device),
    )  # fmt: skip
    return best, cp_groups(cp_group if best == "a2a+p2p" else whole, best)


attention.AUTO_CHOOSER[0] = resolve

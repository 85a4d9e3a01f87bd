"""Cost model: predicted per-layer attention time of a plan on a hardware profile.

A pure host function of :class:`~megatron_cp_ext.inspect.PlanReport` (every rank computes
the same from the same plan). Per rank and per step:

* compute = FLOPs of the 128x128 tiles its calls visit (on the ``reference`` kernel of the
  ``cpu-gloo`` profile: of the padded rectangles that backend materialises) (forward ``2 (d + dv)`` per score
  entry and head, backward ``2 (3d + 2dv)``: five matmuls with the recomputed scores) at the
  profile's throughput, plus ``launch_us`` per call;
* comm = ``latency_us`` + bytes over the link the step uses: NVLink between CP ranks of one
  node (``ranks_per_node`` consecutive CP ranks), InfiniBand otherwise; a p2p step takes the
  slower of its send and its receive; a collective (all-gather, a2a all-to-all) its bytes
  over the slowest link of its group;
* overlap: collectives are exposed (they precede the calls); p2p step ``s``'s transfer is
  posted when step ``s - 1``'s compute starts and its compute waits for it (the staged
  schedule: one exchange with every peer, posted with the local stage, step 0, and awaited by
  the joined stage, step 1; in backward the dK/dV partials then go home, exposed).

The layer takes the slowest rank's time (ring steps synchronise neighbours; the model does
not propagate waits between ranks beyond that maximum).

Whole layer: given the model's widths (:class:`LinearShape`), each rank also pays its linear
work — QKV and output projections and the MLP, FLOPs proportional to its tokens — at the
profile's matmul throughput, forward and (twice that) backward. A rank's layer time is its
attention time plus its linear time, so a balance that evens attention but not tokens (or the
reverse) shows up as a slower layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..backends.reference import visited_area
from ..inspect import CallReport, PlanReport, RankReport, StepReport
from .profiles import HardwareProfile

__all__ = [
    "RankCost", "LayerCost", "LinearShape", "predict", "call_area", "call_flops", "linear_flops", "HIDDEN_FRACTION",
]  # fmt: skip

HIDDEN_FRACTION = 0.05
"""Comm counts as hidden when the exposed part is under this fraction of the layer time."""
PHASES = ("forward", "backward")


@dataclass(frozen=True, kw_only=True)
class RankCost:
    """Predicted costs of one rank, per phase (``{"forward": ..., "backward": ...}``)."""

    rank: int
    flops: dict[str, float]
    """FLOPs over the area its kernel visits in all its calls (:func:`call_area`)."""
    compute_s: dict[str, float]
    """Kernel time: FLOPs at the profile's throughput plus the launch cost per call."""
    comm_s: dict[str, float]
    """Sum of its transfers' times (as if nothing overlapped)."""
    time_s: dict[str, float]
    """Its layer time with the overlap rules."""
    work: int
    """Visible (query, key) pairs per head (as ``RankReport.work``)."""
    calls: int
    """Varlen calls per phase."""
    tile_area: int
    """Visited tile entries per head (as ``RankReport.tile_area``)."""
    bytes_sent: dict[str, int]
    bytes_received: dict[str, int]
    tokens: int = 0
    """Tokens the rank holds."""
    linear_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    """Its linear work's time (0 without a :class:`LinearShape`)."""

    def exposed_s(self, phase: str) -> float:
        return max(self.time_s[phase] - self.compute_s[phase], 0.0)

    def layer_s(self, phase: str) -> float:
        """Whole-layer time of the rank: attention plus linear work."""
        return self.time_s[phase] + self.linear_s[phase]


@dataclass(frozen=True, kw_only=True)
class LayerCost:
    """Predicted per-layer time of one plan: the slowest rank per phase."""

    comm_type: str
    profile: str
    ranks: dict[int, RankCost] = field(default_factory=dict)

    def time_s(self, phase: str) -> float:
        return max((r.time_s[phase] for r in self.ranks.values()), default=0.0)

    @property
    def forward_s(self) -> float:
        return self.time_s("forward")

    @property
    def backward_s(self) -> float:
        return self.time_s("backward")

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s

    def layer_time_s(self, phase: str) -> float:
        """Whole-layer time of ``phase``: the slowest rank's attention plus linear work."""
        return max((r.layer_s(phase) for r in self.ranks.values()), default=0.0)

    @property
    def layer_total_s(self) -> float:
        """Whole-layer forward plus backward time (the attention-only total without widths)."""
        return self.layer_time_s("forward") + self.layer_time_s("backward")

    def hidden(self, phase: str = "forward") -> bool:
        """Whether comm hides behind compute on the slowest rank of ``phase``."""
        if not self.ranks:
            return True
        slow = max(self.ranks.values(), key=lambda r: r.time_s[phase])
        return slow.exposed_s(phase) <= HIDDEN_FRACTION * max(slow.time_s[phase], 1e-30)


@dataclass(frozen=True, kw_only=True)
class LinearShape:
    """The token-wise part of a transformer layer, as one CP rank computes it."""

    hidden: int
    """Model hidden size (the projections' input and output width)."""
    ffn: int
    """MLP inner width this rank holds (the model's FFN size divided by the TP size)."""
    gated: bool = False
    """Gated MLP (SwiGLU): three FFN matrices instead of two."""

    def __post_init__(self) -> None:
        for f in ("hidden", "ffn"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{f} must be a positive int, got {v!r}")


def linear_flops(tokens: int, shape: LinearShape, heads: int, kv_heads: int, head_dim: int,
                 v_head_dim: int) -> dict[str, float]:  # fmt: skip
    """FLOPs of a layer's linear work on ``tokens`` tokens: Q, K, V projections (``heads`` query
    and ``kv_heads`` KV heads), the output projection and the MLP; backward twice forward
    (gradients of inputs and of weights)."""
    qkv = shape.hidden * (heads * head_dim + kv_heads * (head_dim + v_head_dim))
    out = heads * v_head_dim * shape.hidden
    mlp = (3 if shape.gated else 2) * shape.hidden * shape.ffn
    fwd = 2.0 * tokens * (qkv + out + mlp)
    return {"forward": fwd, "backward": 2 * fwd}


def call_flops(tile_area: int, heads: int, head_dim: int, v_head_dim: int) -> dict[str, float]:
    """FLOPs of one call over ``tile_area`` entries per head."""
    per = float(tile_area) * heads * 2
    return {"forward": per * (head_dim + v_head_dim), "backward": per * (3 * head_dim + 2 * v_head_dim)}


def call_area(call: CallReport, prof: HardwareProfile) -> int:
    """Score entries per head that ``prof``'s kernel computes for ``call``."""
    if prof.kernel == "flash":
        return call.tile_area
    return visited_area(call.cu_seqlens_q, call.cu_seqlens_k)


def _link_s(a: int, b: int, nbytes: int, prof: HardwareProfile) -> float:
    same = a // prof.ranks_per_node == b // prof.ranks_per_node
    return nbytes / ((prof.intra_gbps if same else prof.inter_gbps) * 1e9)


def step_comm_s(rank: int, st: StepReport, phase: str, prof: HardwareProfile) -> float:
    """Time of one communication of ``rank`` (see the module docstring)."""
    sent, recv = st.bytes_sent[phase], st.bytes_received[phase]
    if not sent and not recv:
        return 0.0
    lat = prof.latency_us * 1e-6
    if st.kind == "ring":
        src, dst = st.peers
        return lat + max(_link_s(rank, dst, sent, prof), _link_s(rank, src, recv, prof))
    # a collective, or the staged exchange with every peer at once: the total over the slowest link
    worst = max((_link_s(rank, p, max(sent, recv), prof) for p in st.peers), default=0.0)
    return lat * max(len(st.peers), 1) + worst


def _rank_cost(rep: PlanReport, r: RankReport, prof: HardwareProfile, linear: LinearShape | None) -> RankCost:
    heads = r.heads or rep.num_heads
    d, dv = rep.head_dim, rep.v_head_dim
    flops = {p: 0.0 for p in PHASES}
    comp: dict[int, dict[str, float]] = {}
    rate = {"forward": prof.fwd_tflops * 1e12, "backward": prof.bwd_tflops * 1e12}
    for c in r.calls:
        f = call_flops(call_area(c, prof), heads, d, dv)
        slot = comp.setdefault(c.step, {p: 0.0 for p in PHASES})
        for p in PHASES:
            flops[p] += f[p]
            slot[p] += f[p] / rate[p] + prof.launch_us * 1e-6
    compute = {p: sum(s[p] for s in comp.values()) for p in PHASES}
    comm = {p: 0.0 for p in PHASES}
    time = {}
    for p in PHASES:
        coll, tail = 0.0, 0.0
        ring: list[tuple[int, float]] = []
        for st in r.steps:
            t = step_comm_s(r.rank, st, p, prof)
            comm[p] += t
            if st.kind == "staged":  # backward: the KV as forward's, the partials home after
                kv = step_comm_s(r.rank, st, "forward", prof) if p == "backward" else t
                ring.append((st.step, kv))
                if t > kv:  # a second exchange: its own latency, the gradient bytes
                    tail += t - kv + prof.latency_us * 1e-6 * len(st.peers)
            elif st.kind == "ring":
                ring.append((st.step, t))
            else:
                coll += t
        kstart, kend, cend = 0.0, comp.get(0, {}).get(p, 0.0), 0.0
        done = {0}
        for s, t in ring:
            cstart = max(cend, kstart)  # posted when the previous step's compute starts
            cend = cstart + t
            kstart = max(kend, cend)
            kend = kstart + comp.get(s, {}).get(p, 0.0)
            done.add(s)
        kend += sum(v[p] for s, v in comp.items() if s not in done)
        time[p] = coll + kend + tail
    lin = dict.fromkeys(PHASES, 0.0)
    if linear is not None:
        # the layer's projections and MLP run on the rank's tokens with all of its heads (a2a
        # only regroups heads for the attention itself)
        f = linear_flops(r.tokens, linear, rep.num_heads, rep.num_kv_heads, d, dv)
        rate_l = (prof.gemm_tflops or prof.fwd_tflops) * 1e12
        lin = {p: f[p] / rate_l for p in PHASES}
    return RankCost(
        rank=r.rank, flops=flops, compute_s=compute, comm_s=comm, time_s=time, work=r.work, calls=len(r.calls),
        tile_area=r.tile_area, bytes_sent=dict(r.bytes_sent), bytes_received=dict(r.bytes_received),
        tokens=r.tokens, linear_s=lin,
    )  # fmt: skip


def predict(report: PlanReport, profile: HardwareProfile, linear: LinearShape | None = None) -> LayerCost:
    """Predicted per-layer forward and backward time of ``report``'s plan on ``profile``;
    with ``linear`` (the model's widths) also each rank's whole-layer time
    (:meth:`LayerCost.layer_time_s`)."""
    if not report.head_dim:
        raise ValueError("report lacks head shapes: build it with inspect_plan")
    out = LayerCost(comm_type=report.comm_type, profile=profile.name)
    for k, r in report.ranks.items():
        out.ranks[k] = _rank_cost(report, r, profile, linear)
    return out

"""Every group a schedule sends over gets one tiny all-reduce on every rank before its first
batch of sends and receives (NCCL creates a group's communicator at its first operation, and a
batch may only be that operation if every rank takes part: a ring step posts nothing on a rank
with nothing to move). Run here with the in-process backend counted as one that needs it."""

import collections
import threading

import pytest
import torch
import torch.distributed as dist

from megatron_cp_ext.runtime import comm
from megatron_cp_ext.testing.cases import AttnCase, check_case, run_case
from megatron_cp_ext.testing.inproc import BACKEND, run_threads

EVENTS: dict = collections.defaultdict(list)
"""Per rank thread: ("start", group) and ("post", group) in the order they ran."""


def _case(rank: int, world: int, case: AttnCase) -> dict:
    run_case(rank, world, case)
    return run_case(rank, world, case)  # a second micro-batch: nothing started again


@pytest.mark.parametrize(
    "comm_type,a2a,schedule", [("p2p", 0, "ring"), ("p2p", 0, "staged"), ("a2a+p2p", 2, "ring")], ids=str
)
def test_each_group_starts_once_before_its_first_batch(monkeypatch, comm_type: str, a2a: int, schedule: str) -> None:
    EVENTS.clear()
    reduce, post = dist.all_reduce, comm.Peers.post

    def all_reduce(t, *a, group=None, **kw):
        if t.numel() == 1 and not t.any():  # the start's zero
            EVENTS[threading.get_ident()].append(("start", group))
        return reduce(t, *a, group=group, **kw)

    def posted(self, sends, recvs):
        EVENTS[threading.get_ident()].append(("post", self.group))
        return post(self, sends, recvs)

    monkeypatch.setattr(comm, "START_BACKENDS", (BACKEND,))
    monkeypatch.setattr(comm._STARTED, "data", {})  # groups of earlier tests
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(comm.Peers, "post", posted)
    # one rank's documents all its own (the 1-token ones): it may post nothing in a ring step
    case = AttnCase(seqlens=(40, 1, 1, 1, 33), comm_type=comm_type, a2a_size=a2a, hkv=2, p2p_schedule=schedule)
    check_case(run_threads(4, _case, case, timeout=120), case)
    assert len(EVENTS) == 4, "every rank ran"
    for rank_events in EVENTS.values():
        starts = [g for kind, g in rank_events if kind == "start"]
        assert len(starts) == len({id(g) for g in starts}), "a group started twice"
        for i, (kind, g) in enumerate(rank_events):
            if kind == "post":
                assert ("start", g) in rank_events[:i], "a batch before its group's start"
        assert any(kind == "post" for kind, _ in rank_events)


def test_a_per_device_backend_config_counts(monkeypatch) -> None:
    """A per-device config (``"cpu:gloo,cuda:nccl"``) starts the group where its messages move
    on NCCL (CUDA tensors), not where they move on gloo (CPU tensors); plain ``"nccl"`` on CUDA
    starts it, plain gloo does not. Each once per group and device type."""

    class Group:  # weakly referable, hashed by identity, as a ProcessGroup
        pass

    seen = []
    monkeypatch.setattr(comm.dist, "all_reduce", lambda t, group=None: seen.append(group))
    monkeypatch.setattr(comm.torch, "zeros", lambda n, device: device)  # no CUDA here: the device it asks for
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    cases = [("cpu:gloo,cuda:nccl", cuda, True), ("cpu:gloo,cuda:nccl", cpu, False), ("nccl", cuda, True),
             ("gloo", cpu, False)]  # fmt: skip
    for backend, device, started in cases:
        group = Group()
        monkeypatch.setattr(comm.dist, "get_backend", lambda g, b=backend: b)
        comm.start_group(group, device)
        comm.start_group(group, device)  # once
        assert seen == ([group] if started else []), (backend, device)
        seen.clear()

"""Per-rank peaks from the allocator's trace (``testing/alloc_trace.py``), on traces written by
hand: the replay must follow one stream, start each phase at its marker, ignore the markers'
own blocks and take frees of blocks allocated before the trace at their size."""

from megatron_cp_ext.testing.alloc_trace import MARKERS, phase_growth


def _ev(action, addr, size, stream=1):
    return {"action": action, "addr": addr, "size": size, "stream": stream}


def test_phases_by_hand():
    trace = [
        _ev("alloc", 1, 100),  # before the forward: not a rise
        _ev("alloc", 2, MARKERS[0]), _ev("free_completed", 2, MARKERS[0]),
        _ev("alloc", 3, 50), _ev("alloc", 4, 30), _ev("alloc", 9, 999, stream=2),  # another rank
        _ev("free_completed", 3, 50), _ev("alloc", 5, 10),  # forward peak: 80
        _ev("alloc", 2, MARKERS[1]), _ev("free_requested", 2, MARKERS[1]), _ev("free_completed", 2, MARKERS[1]),
        _ev("free_completed", 77, 40),  # a block from before the trace: live falls by 40
        _ev("alloc", 6, 60), _ev("alloc", 7, 15),  # backward rise: -40 + 75 = 35
        _ev("free_requested", 6, 60), _ev("alloc", 8, 20),  # not yet returned: still live, 55
        _ev("alloc", 2, MARKERS[2]),
        _ev("alloc", 10, 500),  # after the backward: not counted
    ]  # fmt: skip
    assert phase_growth(trace, 1) == (80, 55)
    assert phase_growth(trace, 2) is None  # no markers on that stream


def test_unfinished_run_has_no_figure():
    trace = [_ev("alloc", 2, MARKERS[0]), _ev("alloc", 3, 50), _ev("alloc", 4, MARKERS[1])]
    assert phase_growth(trace, 1) is None

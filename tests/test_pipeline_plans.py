"""Schedule plans (no processes): coverage, dependencies, memory bound, validation; timeline."""

from __future__ import annotations

import pytest

from hfmeg.errors import LayoutError
from hfmeg.parallel.schedules import plan, validate
from hfmeg.parallel.timeline import Event, bubble_fractions, draw

LAYOUTS = [("gpipe", 4, 1, 6), ("1f1b", 4, 1, 6), ("1f1b", 4, 1, 2), ("interleaved", 4, 2, 8),
           ("interleaved", 2, 3, 4), ("interleaved", 4, 2, 4), ("gpipe", 2, 1, 3)]


def _max_in_flight(steps) -> int:
    live, peak = 0, 0
    for step in steps:
        for a in step:
            live += 1 if a.kind == "F" else -1
            peak = max(peak, live)
    return peak


@pytest.mark.parametrize("schedule,pp,vpp,m", LAYOUTS)
def test_plan_runs_every_action_once_after_its_forward(schedule, pp, vpp, m):
    for rank in range(pp):
        actions = [a for step in plan(schedule, pp, rank, vpp, m) for a in step]
        want = {(k, v, i) for k in "FB" for v in range(vpp) for i in range(m)}
        assert sorted((a.kind, a.chunk, a.microbatch) for a in actions) == sorted(want)
        seen = set()
        for a in actions:
            if a.kind == "B":
                assert ("F", a.chunk, a.microbatch) in seen, (rank, a)
            seen.add((a.kind, a.chunk, a.microbatch))


def test_1f1b_keeps_at_most_pp_minus_rank_microbatches_in_flight():
    pp, m = 4, 12
    for rank in range(pp):
        assert _max_in_flight(plan("1f1b", pp, rank, 1, m)) == pp - rank
        assert _max_in_flight(plan("gpipe", pp, rank, 1, m)) == m
    # Interleaved: the warm-up bound (p - r - 1) * 2 + (v - 1) * p, plus the steady step's forward.
    assert _max_in_flight(plan("interleaved", pp, 0, 2, m)) == (pp - 1) * 2 + pp + 1


def test_forward_only_plan_has_no_backward():
    steps = plan("interleaved", 2, 1, 2, 4, forward_only=True)
    assert all(a.kind == "F" for s in steps for a in s) and len(steps) == 8


@pytest.mark.parametrize("args,msg", [
    (("interleaved", 4, 2, 6), "multiple of pp"),
    (("interleaved", 2, 1, 4), "vpp >= 2"),
    (("1f1b", 2, 2, 4), "use schedule 'interleaved'"),
    (("gpipe", 2, 2, 4), "use schedule 'interleaved'"),
    (("gpipe", 1, 2, 4), "needs pipeline parallelism"),
    (("zero-bubble", 2, 1, 4), "unknown pipeline schedule"),
    (("1f1b", 2, 1, 0), "at least one micro-batch"),
])
def test_invalid_layouts_are_rejected_up_front(args, msg):
    with pytest.raises(LayoutError, match=msg):
        validate(*args)


def test_bubble_fraction_and_picture(tmp_path):
    # Two stages, one forward each of length 1 shifted by 1, then backwards: stage 0 idles 2 of 4 units.
    events = [Event(0, "F", 0, 0, 0.0, 1.0), Event(1, "F", 0, 0, 1.0, 2.0),
              Event(1, "B", 0, 0, 2.0, 3.0), Event(0, "B", 0, 0, 3.0, 4.0)]
    assert bubble_fractions(events) == {0: 1.0, 1: 1.0}
    pytest.importorskip("matplotlib")
    out = draw([("toy", events), ("again", events)], tmp_path / "t.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

"""TimeMerge's shortcuts (release does work only after a change, and takes runs of one
queue; extend queues a message's records at once; touch moves no bound) let out exactly what a merge that
recomputes every time and takes one record at a time lets out, whatever the calls and
the clock do."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st
from ncclwatch.detectors.stream import TimeMerge

INPUTS = [("w", 0), ("w", 1), ("t", 0), ("x", 0)]

step = st.one_of(
    st.tuples(st.just("add"), st.sampled_from(INPUTS), st.integers(0, 50), st.integers(0, 3)),
    st.tuples(st.just("extend"), st.sampled_from(INPUTS),
              st.lists(st.tuples(st.integers(0, 50), st.integers(0, 3)), max_size=5)),
    st.tuples(st.just("expect"), st.sampled_from(INPUTS), st.booleans()),
    st.tuples(st.just("progress"), st.sampled_from(INPUTS), st.booleans()),
    st.tuples(st.just("touch"), st.sampled_from(INPUTS)),
    st.tuples(st.just("tick"), st.sampled_from([0.5, 1.0, 2.5, 3.5, 10.0])),  # max_hold_s is 3
    st.tuples(st.just("release")),
    st.tuples(st.just("drain")),
)


class Recomputing(TimeMerge):
    """The merge as it was: every release recomputes the bounds, and takes the earliest
    head one record at a time (``TimeMerge`` takes runs of one queue)."""

    def release(self) -> list:
        now = self.clock()
        out = []
        for tps in self._groups.values():
            live, stuck = self._bound(tps, now)
            while True:
                heads = [(q[0][0], q[0][1], i) for i, tp in enumerate(tps) if (q := self._queues[tp])]
                if not heads:
                    break
                t, _, i = min(heads)
                if t > live and self.held <= self.max_held:
                    break
                if t > stuck:
                    self.forced += 1
                tp = tps[i]
                q = self._queues[tp]
                out.append(q.popleft()[2])
                self.held -= 1
                if not q and self._behind.get(tp):
                    live = min(live, self._last_t[tp])
                    stuck = min(stuck, self._last_t[tp])
        return out


@settings(max_examples=1500, deadline=None)
@given(st.lists(step, max_size=60), st.integers(1, 6))
# An input behind and empty turns stuck; one emptied by a release later turns stuck too.
@example([("expect", ("t", 0), True), ("add", ("w", 0), 10, 0), ("tick", 3.5), ("release",)], 6)
@example([("expect", ("t", 0), True), ("add", ("w", 0), 10, 0), ("add", ("t", 0), 5, 0), ("tick", 3.5),
          ("release",)], 6)
def test_release_lets_out_what_a_recomputing_merge_lets_out(steps, max_held):
    now = [0.0]
    a = TimeMerge(max_hold_s=3.0, max_held=max_held, clock=lambda: now[0])
    b = Recomputing(max_hold_s=3.0, max_held=max_held, clock=lambda: now[0])
    n = 0
    for s in steps:
        if s[0] == "tick":
            now[0] += s[1]
            continue
        outs = []
        for m in (a, b):
            if s[0] == "add":
                m.add(s[1], 0, s[2], (s[2], n), s[3])
            elif s[0] == "extend" and m is a:
                a.extend(s[1], 0, [(t, rank, (t, n, j)) for j, (t, rank) in enumerate(s[2])])
            elif s[0] == "extend":  # the same records one at a time
                for j, (t, rank) in enumerate(s[2]):
                    m.add(s[1], 0, t, (t, n, j), rank)
            elif s[0] == "expect":
                m.expect(s[1], 0, s[2])
            elif s[0] == "progress":
                m.progress(s[1], s[2])
            elif s[0] == "touch":
                m.touch(s[1])
            else:
                outs.append(getattr(m, s[0])())
        n += 1
        if s[0] in ("add", "extend", "expect", "progress", "touch"):
            outs = [a.release(), b.release()]
        assert outs[0] == outs[1], (s, outs)
        assert a.held == b.held and a.forced == b.forced

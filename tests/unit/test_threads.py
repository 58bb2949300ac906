"""The adaptive thread count (rakv/util/threads.py): its rules on made-up step times (a fake clock,
no timing asserted), and exactness: the ids at 1 and 2 threads, and with the count switched in the
middle of a request, equal target-only decoding (q8 and fp32, tiny GPT-2 and Llama)."""

from __future__ import annotations

import pytest
import torch

from rakv.config import RakvConfig, Sampling
from rakv.drafts.model import ModelDraft
from rakv.engine import Engine
from rakv.load.numerics import set_numerics
from rakv.records import RequestEnd, Round
from rakv.util import threads as T
from rakv.util.threads import Threads
from tests.tiny import make_pair

QUIET, STALL = 5.0, 200.0       # ms of a made-up 2-thread step, quiet and beside a busy core
ONE = 8.0                        # ms of a 1-thread step


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def run(th: Threads, clock: Clock, ms_of, n: int, rows: int = 1) -> list[int]:
    """``n`` steps, each taking ``ms_of(count)``; the counts they ran at."""
    counts = []
    for _ in range(n):
        c = th.count()
        counts.append(c)
        ms = ms_of(c)
        clock.t += ms / 1e3
        th.step(ms, rows)
    return counts


def unknown():
    return None                  # no look at the machine (not Linux): probes run on time alone


def quiet(c):
    return QUIET if c == 2 else ONE


def busy(c):
    return STALL if c == 2 else ONE


@pytest.mark.fast
def test_rules_are_named_with_their_thresholds():
    assert T.stalled(2.01 * QUIET, QUIET) and not T.stalled(1.9 * QUIET, QUIET)
    assert T.more_pay(0.6 * ONE, ONE) and not T.more_pay(0.9 * ONE, ONE)


@pytest.mark.fast
def test_a_quiet_machine_keeps_every_thread():
    clock = Clock()
    th = Threads(2, clock=clock, others=unknown, cores=2)
    counts = run(th, clock, quiet, 3000)
    assert th.now == 2 and th.switches == 0
    assert counts.count(1) < 0.02 * len(counts)         # the probes of one thread are a few steps


@pytest.mark.fast
def test_a_busy_core_drops_to_one_thread_and_probes_back_seldom():
    clock = Clock()
    th = Threads(2, clock=clock, others=unknown, cores=2)
    run(th, clock, quiet, 20)
    counts = run(th, clock, busy, 40)
    assert counts[:T.SLOW_STREAK] == [2] * T.SLOW_STREAK and th.now == 1 and th.switches == 1
    assert counts[T.SLOW_STREAK:].count(2) == 0
    start = clock.t
    counts = run(th, clock, busy, 8000)                 # ~64 s beside the co-tenant
    assert th.now == 1
    stalls = counts.count(2)
    assert 1 <= stalls <= (clock.t - start) / T.PROBE_S  # each probe ends at its first stalled step, waits grow
    assert th._wait == T.PROBE_MAX_S


@pytest.mark.fast
def test_the_full_count_comes_back_when_the_co_tenant_leaves():
    clock = Clock()
    th = Threads(2, clock=clock, others=unknown, cores=2)
    run(th, clock, quiet, 20)
    run(th, clock, busy, 400)
    assert th.now == 1
    run(th, clock, quiet, int(T.PROBE_MAX_S * 1e3 / ONE) + 10)
    assert th.now == 2 and th.switches == 2


@pytest.mark.fast
def test_a_co_tenant_from_the_start_is_found_by_the_first_probe():
    """No quiet step to compare with: the probe of one thread after the first steps finds it faster."""
    clock = Clock()
    th = Threads(2, clock=clock, others=unknown, cores=2)
    counts = run(th, clock, busy, 40)
    assert th.now == 1 and counts.index(1) <= T.WARM_STEPS


@pytest.mark.fast
def test_steps_compare_only_with_steps_of_as_many_rows():
    """A verify of 9 rows costs more than a decode step: it is no stall."""
    clock = Clock()
    th = Threads(2, clock=clock, others=unknown, cores=2)
    for i in range(200):
        rows = 9 if i % 3 == 0 else 1
        ms = (4 if rows == 9 else 1) * quiet(th.count())
        clock.t += ms / 1e3
        th.step(ms, rows)
    assert th.now == 2 and th.switches == 0


@pytest.mark.fast
def test_no_probe_of_more_threads_while_another_process_keeps_a_core_busy():
    """The machine's load says the other core is taken: no stalled probe steps at all; it frees: back."""
    clock = Clock()
    others = [0.0]
    th = Threads(2, clock=clock, others=lambda: others[0], cores=2)
    run(th, clock, quiet, 20)
    others[0] = 1.0
    run(th, clock, busy, 20)
    assert th.now == 1
    assert run(th, clock, busy, 8000).count(2) == 0
    others[0] = 0.1
    run(th, clock, quiet, int(2 * T.PROBE_S * 1e3 / ONE))
    assert th.now == 2


@pytest.mark.fast
def test_a_busy_machine_starts_at_one_thread():
    """A co-tenant there before the first step (the meter's first look spans the model's load)
    costs no stalled step."""
    clock = Clock()
    th = Threads(2, clock=clock, others=lambda: 1.0, cores=2)
    assert run(th, clock, busy, 400).count(2) == 0 and th.switches == 1
    th = Threads(2, clock=clock, others=lambda: 0.05, cores=2)
    counts = run(th, clock, quiet, int(T.PROBE_S * 1e3 / QUIET) - 5)
    assert counts == [2] * len(counts)                    # a quiet machine seen: no probe before PROBE_S


@pytest.mark.fast
def test_the_meter_counts_other_processes_cores(tmp_path):
    stat = tmp_path / "stat"
    clock, own = Clock(), [0.0]

    def write(busy, idle, iowait):
        stat.write_text(f"cpu  {busy} 0 0 {idle} {iowait} 0 0 0 0 0\ncpu0 1 2 3\n")

    write(1000, 1000, 10)
    meter = T.OthersMeter(str(stat), clock=clock, own=lambda: own[0])
    meter._tick = 100.0
    meter._last = meter._read()
    clock.t += 2.0
    own[0] += 1.0                                         # this process: half a core over 2 s
    write(1000 + 300, 1000 + 90, 20)                      # the machine: 1.5 cores busy
    assert meter() == pytest.approx(1.0)                  # others: 1.5 - 0.5
    clock.t += 0.01
    assert meter() is None                                # too short a look
    assert T.OthersMeter(str(tmp_path / "none"))() is None
    assert T.room_for_more(None, 2, 2) and T.room_for_more(0.3, 2, 2) and not T.room_for_more(0.9, 2, 2)
    assert T.room_for_more(0.9, 16, 2)


@pytest.mark.fast
def test_pinned_never_changes():
    clock = Clock()
    th = Threads(2, pinned=True, clock=clock, others=unknown, cores=2)
    assert run(th, clock, busy, 50) == [2] * 50 and th.state()["adaptive"] is False
    assert Threads(1).pinned                              # one core: nothing to adapt


# ----------------------------------------------------------------------------- exactness
class Alternating(Threads):
    """Switches the count at every step (1, 2, 1, ...): the worst case of a mid-request switch."""

    def __init__(self):
        super().__init__(2)
        self.i = 0

    def count(self) -> int:
        self.i += 1
        return 1 + self.i % 2

    def step(self, ms, rows=1):
        pass


@pytest.fixture
def two_threads():
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(old)


PROMPTS = [list(range(5, 45)), [3, 4, 5] * 6]


def _ids(target, draft, threads, policy: str, sampling=None, switching=False):
    records = []
    cfg = RakvConfig(policy=policy, threads=threads, sampling=sampling or Sampling())
    eng = Engine(target, ModelDraft(draft) if draft is not None else None, cfg, callback=records.append)
    if switching:
        eng.threads = Alternating()
    return [eng.generate(p, 16).output_ids for p in PROMPTS], records


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("numerics", ["q8", "fp32"])
def test_ids_equal_at_one_and_two_threads_and_switching_mid_request(arch, numerics, two_threads):
    target, draft = make_pair(arch, "mostly")
    set_numerics(target, numerics)
    set_numerics(draft, numerics)
    seeded = Sampling(temperature=0.8, top_k=20, seed=7)
    for s in (None, seeded):
        torch.set_num_threads(2)
        want, _ = _ids(target, None, 1, "ar", s)            # target-only at one thread
        for policy, d, threads, switching in [("ar", None, 2, False), ("spec:3", draft, 2, False),
                                              ("ar", None, None, True), ("spec:3", draft, None, True)]:
            torch.set_num_threads(2)
            got, recs = _ids(target, d, threads, policy, s, switching)
            assert got == want, (policy, threads, switching, s)
            if switching:
                ran = {r.threads for r in recs if isinstance(r, Round) and r.kind != "prefill"}
                assert ran == {1, 2}
        assert torch.get_num_threads() == 2                # the engine puts the full count back


def test_records_carry_the_thread_count(two_threads):
    target, _ = make_pair("llama", "mostly")
    recs = []
    eng = Engine(target, None, RakvConfig(policy="ar"), callback=recs.append)
    assert eng.threads.top == 2 and not eng.threads.pinned
    eng.generate(PROMPTS[0], 8)
    end = [r for r in recs if isinstance(r, RequestEnd)][-1]
    assert end.threads in (1, 2) and end.thread_switches == eng.threads.switches
    assert torch.get_num_threads() == 2                    # put back after the request
    assert all(r.threads in (1, 2) for r in recs if isinstance(r, Round) and r.kind != "prefill")
    eng = Engine(target, None, RakvConfig(policy="ar", threads=2))
    assert eng.threads.pinned


def test_a_lane_pool_reports_its_shared_steps(two_threads):
    import threading

    from rakv.engine.batch import LanePool

    target, _ = make_pair("llama", "mostly")
    set_numerics(target, "q8")
    eng = Engine(target, None, RakvConfig(policy="ar"))
    pool = LanePool(eng, 2)
    assert all(e.threads is eng.threads and not e.step_reports for e in pool.lanes)
    out = {}

    def go(i, p):
        with pool.lane() as lane:
            out[i] = lane.generate(p, 12).output_ids

    ts = [threading.Thread(target=go, args=(i, p)) for i, p in enumerate(PROMPTS)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert eng.threads._steps >= 12
    solo = Engine(target, None, RakvConfig(policy="ar", threads=1))
    assert [out[0], out[1]] == [solo.generate(p, 12).output_ids for p in PROMPTS]


def test_a_serial_thread_starts_no_openmp_team_and_leaves_others_alone():
    """serial_here: this thread's torch work runs on it alone (no OpenMP worker threads appear, MKL's
    included), the count other threads see is untouched, and Threads.use() there sets nothing."""
    import os
    import threading

    import torch

    from rakv.util.threads import Threads, is_serial_here, serial_here

    if not os.path.isdir("/proc/self/task"):
        pytest.skip("no /proc: threads cannot be counted")
    before = torch.get_num_threads()
    torch.set_num_threads(max(2, before))    # (as --threads N sets it: MKL's count too)
    x = torch.randn(200_000)
    seen = {}

    def lane():
        with serial_here():
            n0 = len(os.listdir("/proc/self/task"))
            (x * 2).max()
            torch.logsumexp(x, dim=-1)   # exp over a vocabulary: MKL's vector maths, its own team
            seen["extra"] = len(os.listdir("/proc/self/task")) - n0
            seen["count"] = torch.get_num_threads()
            seen["serial"] = is_serial_here()
            seen["use"] = Threads(top=2, pinned=True).use()

    t = threading.Thread(target=lane)
    t.start()
    t.join()
    try:
        assert seen == {"extra": 0, "count": 1, "serial": True, "use": 2}
        assert torch.get_num_threads() == max(2, before) and not is_serial_here()
        with serial_here():              # a lane run on this thread: its count comes back after
            assert torch.get_num_threads() == 1 and is_serial_here()
        assert torch.get_num_threads() == max(2, before) and not is_serial_here()
    finally:
        torch.set_num_threads(before)

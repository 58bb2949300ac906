"""A thread count that adapts to a shared machine (the default when ``--threads`` is not given).

A server's clients, the explorer's GUI thread or a load generator may run on the same cores as the
decode. The kernels' OpenMP team meets at a barrier in every call, many a step, so one of its
threads pushed off its core by a co-tenant stalls the others at each barrier: a 2-thread decode
beside one busy core ran at 0.02x its quiet speed, where one thread kept 0.59x (2-core Xeon VM,
2026-12-07, scripts/cotenant.py). ``Threads`` watches the engine's step times and runs one thread
while more would stall, probing the full count again now and then.

Rules (each a named function below): a step over ``SLOW_FACTOR`` x its count's quiet cost is
*stalled*; ``SLOW_STREAK`` stalled steps in a row drop to one thread; every ``PROBE_S`` seconds the
other count runs ``PROBE_STEPS`` steps and the faster keeps the place (more threads only by a margin,
``KEEP_SHARE``); a probe of more threads whose first step stalls ends at once, and the next probe
waits twice as long (up to ``PROBE_MAX_S``). Steps are compared only with steps of as many rows.
More threads are tried (the first step included) only where other processes left a core to each
(``room_for_more``: /proc/stat's busy time less this process's CPU time, since the previous look;
the first look spans the model's load), so a co-tenant costs no stalled step at all on Linux.

Exact whatever the count: every kernel computes a row's arithmetic in an order that does not depend
on the thread count (rakv/kernels/blockq.c's header; tests/unit/test_threads.py checks ids at 1 and 2
threads and a switch mid-request), so switching changes the time, never the tokens.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from contextlib import contextmanager
from functools import lru_cache

import torch

SLOW_FACTOR = 2.0     # a step over 2x its count's quiet cost is a stall (a co-tenant took a core), not noise
SLOW_STREAK = 4       # stalled steps in a row before dropping: one preempted step is noise
PROBE_S = 3.0         # seconds between probes of the other count: a co-tenant's coming or going is seen soon
PROBE_MAX_S = 24.0    # the longest wait after failed probes: each costs a stalled step
PROBE_STEPS = 4       # steps a probe runs: a median of a few, not one preempted step
KEEP_SHARE = 0.85     # more threads keep their place only below 0.85 of one thread's step: a small gain
                      # is not worth the stalls a co-tenant brings to a team
WINDOW = 16           # recent steps remembered per (count, rows)
WARM_STEPS = 8        # steps at the full count before the first probe of one thread where the machine
                      # could not be seen (not Linux); a median of fewer is the first steps' warm-up
OTHERS_MAX = 0.4      # more threads are tried only where other processes kept at most 0.4 of a core
                      # busy beyond the cores ours leave (/proc/stat less our own CPU time): a busy
                      # core would stall the team
START_S = 0.05        # the shortest look at the machine worth trusting (ticks are 10 ms)


def stalled(ms: float, quiet_ms: float) -> bool:
    """A step far over its quiet cost: a thread of the team lost its core."""
    return ms > SLOW_FACTOR * quiet_ms


def more_pay(more_ms: float, fewer_ms: float) -> bool:
    """More threads are worth keeping: their steps are clearly faster than fewer threads'."""
    return more_ms < KEEP_SHARE * fewer_ms


def room_for_more(others_busy: float | None, cores: int, top: int) -> bool:
    """Room for ``top`` threads: the other processes leave a core to each (unknown: try and see)."""
    return others_busy is None or others_busy <= cores - top + OTHERS_MAX


class OthersMeter:
    """The cores other processes kept busy since the previous call: the machine's busy time
    (Linux /proc/stat) less this process's CPU time. None elsewhere, on the first call or after
    less than ``START_S``."""

    def __init__(self, path: str = "/proc/stat", clock=time.monotonic, own=time.process_time):
        import os

        self.path, self.clock, self.own = path, clock, own
        try:
            self._tick = float(os.sysconf("SC_CLK_TCK"))
        except (AttributeError, ValueError, OSError):
            self._tick = 100.0
        self._last = self._read()

    def _read(self):
        try:
            with open(self.path, encoding="ascii") as f:
                cols = [int(x) for x in f.readline().split()[1:9]]
        except (OSError, ValueError):
            return None
        if len(cols) < 5:
            return None
        busy = (sum(cols) - cols[3] - cols[4]) / self._tick          # all but idle and iowait, seconds
        return busy, self.own(), self.clock()

    def __call__(self) -> float | None:
        now = self._read()
        if now is None or self._last is None or now[2] - self._last[2] < START_S:
            if self._last is None:
                self._last = now
            return None
        last, self._last = self._last, now
        wall = now[2] - last[2]
        return max(0.0, ((now[0] - last[0]) - (now[1] - last[1])) / wall)


_METER: OthersMeter | None = None


_HERE = threading.local()


@contextmanager
def serial_here():
    """Inside it, this thread's torch operations run on it alone, starting no OpenMP team of their
    own: a serving lane's small tensors, while one other thread runs every step's kernels. (libgomp
    keeps a team for each thread that starts a parallel region; with more of its threads than cores
    it stops spinning between regions, and a step's hundreds of regions each wait for a wake-up.)
    On leaving, the thread's count is what it was (a lane run on a thread that goes on computing)."""
    if getattr(_HERE, "serial", False):
        yield
        return
    n = torch.get_num_threads()          # torch's own first-call setting of this thread's count, first
    lib, mkl = _openmp(), _mkl()
    if lib is not None:
        lib.omp_set_num_threads(1)
    mkl_before = mkl.MKL_Set_Num_Threads_Local(1) if mkl is not None else None   # MKL's own (exp, BLAS)
    _HERE.serial = True
    try:
        yield
    finally:
        _HERE.serial = False
        if lib is not None:
            lib.omp_set_num_threads(n)
        if mkl is not None:
            mkl.MKL_Set_Num_Threads_Local(mkl_before)


def is_serial_here() -> bool:
    return getattr(_HERE, "serial", False)


@lru_cache(maxsize=None)
def _openmp():
    """The OpenMP runtime torch loaded (libgomp; None where it is another)."""
    import ctypes
    import os

    try:                                 # (already loaded by torch: never a second copy)
        return ctypes.CDLL("libgomp.so.1", mode=getattr(os, "RTLD_NOLOAD", 0) | ctypes.RTLD_GLOBAL)
    except OSError:
        return None


@lru_cache(maxsize=None)
def _mkl():
    """torch's MKL (inside libtorch_cpu; None where it has none): its vector maths (exp over a
    vocabulary) and BLAS start their own OpenMP teams at MKL's count, not the thread's."""
    import ctypes
    import os

    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        lib = ctypes.CDLL(path, mode=getattr(os, "RTLD_NOLOAD", 0) | ctypes.RTLD_GLOBAL)
        fn = lib.MKL_Set_Num_Threads_Local      # (the C call; the lower-case name takes a pointer)
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
    return lib


def process_meter() -> OthersMeter:
    """One meter for the process, started at import: the first look spans the model's load."""
    global _METER
    if _METER is None:
        _METER = OthersMeter()
    return _METER


process_meter()


class Threads:
    """The thread count of the engine's steps. ``pinned`` (``--threads N``): always ``top``.
    ``use()`` before a step sets torch's count (which the C kernels read at each call); ``step(ms,
    rows)`` after it reports the step; ``rest()`` puts back ``top`` (profiles and fingerprints key on
    it). Shared by an engine's lanes; safe from several threads."""

    def __init__(self, top: int | None = None, pinned: bool = False, clock=time.monotonic, others=None,
                 cores: int | None = None):
        import os

        self.top = max(1, int(top or torch.get_num_threads()))
        self.pinned = pinned or self.top == 1
        self.clock = clock
        self.others = others if others is not None else process_meter()
        self.cores = cores or os.cpu_count() or self.top
        self._started = False
        self.now = self.top
        self.switches = 0
        self._lock = threading.Lock()
        self._recent: dict[tuple[int, int], deque] = {}
        self._streak = 0
        self._steps = 0
        self._probe: int | None = None          # the count being probed
        self._probe_ms: list[tuple[int, float]] = []
        self._wait = PROBE_S
        self._next_probe = None                 # clock time of the next probe (None: after WARM_STEPS)

    # ---- what the engine calls
    def count(self) -> int:
        """The thread count of the next step (the first: one thread where the machine is busy)."""
        if self.pinned:
            return self.top
        if not self._started:
            self._started = True
            with self._lock:
                seen = self.others()
                if not room_for_more(seen, self.cores, self.top):
                    self._switch(1, self.clock())
                elif seen is not None:          # a quiet machine seen: no warm-up probe, the first in PROBE_S
                    self._next_probe = self.clock() + self._wait
        return self._probe or self.now

    def _room(self) -> bool:
        return room_for_more(self.others(), self.cores, self.top)

    def use(self) -> int:
        """Set torch's thread count to this step's; returns it. (On a serial lane thread only returns
        it: the thread that runs the step sets it.)"""
        n = self.count()
        if not is_serial_here() and torch.get_num_threads() != n:
            torch.set_num_threads(n)
        return n

    def rest(self) -> None:
        if not is_serial_here() and torch.get_num_threads() != self.top:
            torch.set_num_threads(self.top)

    def step(self, ms: float, rows: int = 1) -> None:
        """One step of ``rows`` rows took ``ms`` at the count ``use()`` set."""
        if self.pinned or ms <= 0:
            return
        with self._lock:
            self._step(float(ms), int(rows))

    def state(self) -> dict:
        return {"threads": self.count(), "top": self.top,
                "adaptive": not self.pinned, "switches": self.switches}

    # ---- the rules
    def _step(self, ms: float, rows: int) -> None:
        self._steps += 1
        t = self.clock()
        if self._probe is not None:
            self._probe_step(ms, rows, t)
            return
        hist = self._recent.setdefault((self.now, rows), deque(maxlen=WINDOW))
        quiet = min(hist) if len(hist) >= 2 else None
        hist.append(ms)
        if self.now > 1 and quiet is not None and stalled(ms, quiet):
            self._streak += 1
            if self._streak >= SLOW_STREAK:
                top = self.now
                self._switch(1, t)
                self._recent = {key: v for key, v in self._recent.items() if key[0] != top}   # stalled floors
                return
        else:
            self._streak = 0
        if self._next_probe is None:
            if self._steps >= WARM_STEPS:
                self._start_probe(t)
        elif t >= self._next_probe:
            self._start_probe(t)

    def _start_probe(self, t: float) -> None:
        self._next_probe = t + self._wait
        if self.now < self.top and not self._room():
            return                              # no core for each thread: a probe would only stall
        self._probe = 1 if self.now > 1 else self.top
        self._probe_ms = []

    def _probe_step(self, ms: float, rows: int, t: float) -> None:
        probe, cur = self._probe, self.now
        self._probe_ms.append((rows, ms))
        if probe > cur:
            base = self._recent.get((cur, rows))
            if base and stalled(ms, statistics.median(base)):        # more threads stall: end it now
                self._end_probe(None, t)
                return
        comparable = [r for r, _ in self._probe_ms if self._recent.get((cur, r))]
        n = len(self._probe_ms)
        if n < PROBE_STEPS or (not comparable and n < 2 * PROBE_STEPS):
            return                              # a few steps, of rows the current count has run
        winner = None
        if comparable:
            r0 = max(set(comparable), key=comparable.count)
            p_ms = statistics.median(m for r, m in self._probe_ms if r == r0)
            c_ms = statistics.median(self._recent[(cur, r0)])
            if (more_pay(p_ms, c_ms) if probe > cur else not more_pay(c_ms, p_ms)):
                winner = [m for r, m in self._probe_ms if r == r0], r0
        self._end_probe(winner, t)

    def _end_probe(self, winner, t: float) -> None:
        """``winner``: the probe's steps (ms, rows) where the probed count keeps the place, else None."""
        probe = self._probe
        self._probe, self._probe_ms = None, []
        if winner is not None:
            self._switch(probe, t)
            ms, rows = winner
            self._recent[(probe, rows)] = deque(ms, maxlen=WINDOW)
        elif probe > self.now:                  # more threads did not pay: wait longer before the next try
            self._wait = min(PROBE_MAX_S, self._wait * 2)
        self._next_probe = t + self._wait

    def _switch(self, n: int, t: float) -> None:
        """Run ``n`` threads from now; what was learnt of ``n`` before is stale (a co-tenant came or went)."""
        if n != self.now:
            self.switches += 1
        if n < self.top:
            self.others()                       # the next look starts now
        self._recent = {key: v for key, v in self._recent.items() if key[0] != n}
        self.now, self._streak = n, 0
        if n == self.top:
            self._wait = PROBE_S
        self._next_probe = t + self._wait

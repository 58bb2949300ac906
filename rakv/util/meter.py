"""Timings that know how good they are: spread of repeats, CPU share, bounded re-measuring.

A term (say "T_pf@32", the target prefill of 32 tokens) is timed a few times. Two numbers say
whether to trust it:

  spread  (max - min) / median of the repeats
  share   the main thread's CPU time over the wall time. On a quiet machine it is ~1, also with
          several torch threads (the main thread computes or spins through every forward); when
          another process takes the CPU it falls (0.5: we ran half the time we measured).

A noisy term (spread > SPREAD_RETRY or share < SHARE_MIN) is measured again after a short pause,
at most MAX_RETRIES times per term and RETRY_BUDGET times per calibration, keeping the cleanest
attempt. Curves that must rise with length (prefill of n tokens, a step at context c) are checked:
the two ends of a drop are re-measured, and what still falls is made monotone (pool adjacent
violators) and flagged. ``quality()`` sums it up for the profile; ``contended`` says the
measurements were taken while the machine was busy, so they describe the load, not the machine.

``RAKV_CONTENTION_CHECK=0`` (the test suite sets it) keeps the measuring and the monotone curves
but turns off the pauses, the re-measuring and the contended flag, so runs are deterministic.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

from .device import clock
from .paths import env_on

SPREAD_RETRY = 0.25      # re-measure a term whose repeats differ by more than this (relative)
SPREAD_HIGH = 0.5        # after re-measuring: a term this noisy counts against the whole profile
SHARE_MIN = 0.8          # main-thread CPU share below this: another process was taking the CPU
SHARE_QUIET = 0.9        # ... at or above this (and a low spread): the machine is quiet now
MAX_RETRIES = 2          # per term
RETRY_BUDGET = 16        # per calibration (bounds the time a busy machine can add)
RETRY_PAUSE_S = 0.05     # pause before the n-th retry: n * this (lets a burst of load pass)
RETRY_DEADLINE_S = 30.0  # no re-measuring after a calibration has run this long (a busy machine's cap)
MONO_TOL = 0.05          # a curve may dip this much (relative) before it counts as falling

now = clock                     # perf_counter after syncing an asynchronous device in use
cpu_clock = time.thread_time      # the calling (main) thread's CPU time


def check_enabled() -> bool:
    return env_on("RAKV_CONTENTION_CHECK")


@dataclass
class Timing:
    ms: list[float] = field(default_factory=list)        # wall time per repeat
    cpu_ms: list[float] = field(default_factory=list)    # main-thread CPU time per repeat

    @property
    def value(self) -> float:
        return statistics.median(self.ms) if self.ms else 0.0

    @property
    def spread(self) -> float:
        m = self.value
        return (max(self.ms) - min(self.ms)) / m if len(self.ms) > 1 and m > 0 else 0.0

    @property
    def share(self) -> float:
        wall = sum(self.ms)
        return min(1.0, sum(self.cpu_ms) / wall) if wall > 0 else 1.0

    @property
    def noisy(self) -> bool:
        return self.spread > SPREAD_RETRY or self.share < SHARE_MIN

    @property
    def score(self) -> float:
        """Lower is cleaner: spread, plus the CPU lost to other processes (weighted double)."""
        return self.spread + 2.0 * (1.0 - self.share)

    def add(self, wall_s: float, cpu_s: float) -> None:
        self.ms.append(wall_s * 1e3)
        self.cpu_ms.append(cpu_s * 1e3)


class _Judged(Timing):
    """A pooled timing whose spread is given (the median spread of the terms it pools)."""

    def __init__(self, ms, cpu_ms, spread: float):
        super().__init__(ms, cpu_ms)
        self._spread = spread

    @property
    def spread(self) -> float:
        return self._spread


def time_reps(fn: Callable[[], object], reps: int) -> Timing:
    """Time ``fn`` ``reps`` times (the caller warms up first if it needs to)."""
    t = Timing()
    for _ in range(reps):
        t0, c0 = now(), cpu_clock()
        fn()
        t.add(now() - t0, cpu_clock() - c0)
    return t


def pool_adjacent_violators(ys: list[float]) -> list[float]:
    """The closest non-decreasing sequence (least squares), e.g. [5, 3, 4] -> [4, 4, 4]."""
    blocks: list[list[float]] = []          # [mean, count]
    for y in ys:
        blocks.append([y, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, n2 = blocks.pop()
            m1, n1 = blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return [m for m, n in blocks for _ in range(int(n))]


def drops(ys: list[float]) -> list[int]:
    """Indices i where the curve falls from i to i + 1 by more than MONO_TOL."""
    return [i for i in range(len(ys) - 1) if ys[i + 1] < ys[i] * (1 - MONO_TOL)]


class Meter:
    """Collects the timings of one calibration and decides what to re-measure."""

    def __init__(self, check: bool | None = None, pause: Callable[[float], None] = time.sleep,
                 deadline_s: float = RETRY_DEADLINE_S):
        self.check = check_enabled() if check is None else check
        self.pause = pause
        self.terms: dict[str, Timing] = {}
        self.retries: dict[str, int] = {}
        self.budget = RETRY_BUDGET
        self.forced: list[str] = []
        self.notes: list[str] = []                 # reasons found outside the timings (a busy start)
        self.deadline = now() + deadline_s
        self.past_deadline = False

    def may_retry(self) -> bool:
        """Re-measuring is allowed: checking is on, retries are left and the deadline has not passed."""
        if self.check and self.budget > 0 and now() >= self.deadline:
            self.past_deadline = True
        return self.check and self.budget > 0 and not self.past_deadline

    def note(self, reason: str) -> None:
        """A reason this calibration counts as contended, found outside its own timings."""
        self.notes.append(reason)

    def measure(self, term: str, timing: Callable[[], Timing]) -> Timing:
        """Time a term; while noisy (and retries are left) time it again; keep the cleanest."""
        best = timing()
        n = 0
        while best.noisy and n < MAX_RETRIES and self.may_retry():
            n += 1
            self.budget -= 1
            self.pause(RETRY_PAUSE_S * n)
            again = timing()
            if again.score < best.score:
                best = again
        self.terms[term] = best
        if n:
            self.retries[term] = self.retries.get(term, 0) + n
        return best

    def measure_many(self, name: str, fn: Callable[[], tuple[object, dict[str, Timing]]]):
        """Like ``measure`` for a block that times several terms together (interleaved): judged
        by the median spread of its terms and their pooled CPU share; returns fn's result."""
        def judge(ts: dict[str, Timing]) -> Timing:
            pooled = Timing([x for t in ts.values() for x in t.ms], [x for t in ts.values() for x in t.cpu_ms])
            spread = statistics.median(t.spread for t in ts.values()) if ts else 0.0
            return _Judged(pooled.ms, pooled.cpu_ms, spread)

        best, best_ts = fn()
        n = 0
        while judge(best_ts).noisy and n < MAX_RETRIES and self.may_retry():
            n += 1
            self.budget -= 1
            self.pause(RETRY_PAUSE_S * n)
            again, again_ts = fn()
            if judge(again_ts).score < judge(best_ts).score:
                best, best_ts = again, again_ts
        self.terms.update(best_ts)
        if n:
            self.retries[name] = self.retries.get(name, 0) + n
        return best

    def monotone(self, name: str, points: list[list[float]], remeasure: Callable[[int], float]) -> list[list[float]]:
        """Points [[x, ms], ...] sorted by x that must not fall: re-measure the ends of each drop
        (``remeasure(i)`` gives a new ms for point i), then pool what still falls, flagging it."""
        pts = [list(p) for p in sorted(points)]
        for _ in range(MAX_RETRIES):
            bad = drops([y for _, y in pts])
            if not bad or not self.may_retry():
                break
            for i in sorted({j for b in bad for j in (b, b + 1)}):
                pts[i][1] = remeasure(i)
        ys = [y for _, y in pts]
        if drops(ys):
            self.forced.append(name)
        return [[x, y] for (x, _), y in zip(pts, pool_adjacent_violators(ys))]

    def quality(self) -> dict:
        """The profile's ``quality`` section (see the module docstring)."""
        spreads = {k: round(t.spread, 3) for k, t in self.terms.items()}
        wall = sum(sum(t.ms) for t in self.terms.values())
        cpu = sum(sum(t.cpu_ms) for t in self.terms.values())
        share = min(1.0, cpu / wall) if wall > 0 else 1.0
        noisy = [k for k, s in spreads.items() if s > SPREAD_HIGH]
        reasons = list(self.notes)
        if self.past_deadline:
            reasons.append(f"re-measuring stopped after {RETRY_DEADLINE_S:.0f} s")
        if share < SHARE_MIN:
            reasons.append(f"this process got {share:.0%} of the CPU time it measured (another process was busy)")
        if spreads and len(noisy) * 3 > len(spreads):
            reasons.append(f"{len(noisy)} of {len(spreads)} terms varied by more than {SPREAD_HIGH:.0%} between repeats")
        if self.forced:
            reasons.append(f"{', '.join(self.forced)} fell with length even when measured again")
        return {"spread": spreads, "cpu_share": round(share, 3), "retries": sum(self.retries.values()),
                "retried": sorted(self.retries), "monotone_forced": list(self.forced),
                "past_deadline": self.past_deadline,
                "contended": bool(reasons) and self.check, "reasons": reasons if self.check else [],
                "load_per_core": load_per_core(), "checked": self.check}


def load_per_core() -> float | None:
    """The 1-minute load average per core (None where the OS has none, e.g. Windows)."""
    try:
        return round(os.getloadavg()[0] / (os.cpu_count() or 1), 2)
    except (AttributeError, OSError):
        return None


def is_quiet(t: Timing) -> bool:
    """A short probe timing says the machine is quiet now."""
    return t.share >= SHARE_QUIET and t.spread <= SPREAD_RETRY

"""Continuous batching: several requests decode together, one forward per step carrying all their rows.

Each active request runs the engine's own code (lookup, decision, prefill, rounds, end) on its own
*lane*: an ``Engine`` that shares the target, the prefix cache and the learned state with the
others but has its own draft state and controls. Lanes run one at a time (they pass a baton, so the
Python state they share is never touched by two at once) and meet at the target's forward: a lane
that needs a forward hands its rows to the ``Batcher`` and waits; when every active lane waits,
the last one runs them all in one pass (``kernels.segments.forward_segments``: each linear over
every row at once, each request's attention over its own cache) and each lane goes on with its own
logits. A request joins at the next step (its lane takes the baton and adds its rows) and leaves
when done; a long prompt's prefill is fed in chunks, one a step, so the running requests keep
their pace.

Exact by construction: a row computes the same bits in the shared pass as in a forward of its own
request alone (the q8 numerics' rows are computed alone; attention reads only the request's own
cache), and nothing else about a request depends on its neighbours, so its tokens equal its solo
run's. Where a backend cannot run rows of several requests exactly (``segments_ok`` says no: fp32
numerics, the torch path) each request's forward runs on its own inside the step.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field

from ..backends import backend_of, set_backend
from ..config import PREFILL_CHUNK       # prompt tokens a request feeds per step while others decode
from ..decide.learned import BatchView
from ..decoding import cache_len
from ..util.device import clock as now
from ..util.threads import serial_here
from ..kernels.segments import forward_segments, segments_ok


@dataclass
class _Rows:
    """One lane's forward, waiting for the step."""

    backend: object
    tokens: list[int]
    cache: object
    keep: int
    tree: object = None
    rid: int | None = None
    done: threading.Event = field(default_factory=threading.Event)
    logits: object = None
    error: BaseException | None = None


@dataclass
class StepInfo:
    """What one shared step carried: (request id, rows) per forward, its wall ms, whether the rows
    shared one pass."""

    index: int
    rows: list[tuple[int | None, int]]
    ms: float
    shared: bool
    predicted_ms: float | None = None       # what the step's passes were priced at (None: not priced)


class StepRunner:
    """The one thread that runs every shared step: the thread that calls ``drive()`` (``rakv serve``:
    the main thread, which loaded the models) or, without one, a thread of its own.

    Why one: the kernels' OpenMP runtime (libgomp, shared with torch) keeps a team of threads for
    every thread that starts a parallel region, and once it manages more threads than there are
    cores it stops spinning between regions and puts its workers to sleep at every one of a step's
    hundreds. Steps started from whichever lane arrived last (a thread per connection), beside the
    main thread's team, ran a 4-row step of the Qwen 1.5B in 84 ms instead of 59 on the 2-core VM
    (docs/serve.md, "One thread runs the steps")."""

    def __init__(self):
        self._cv = threading.Condition()
        self._job = None
        self._owner: threading.Thread | None = None     # the thread running jobs now
        self._driven = False

    def run(self, fn) -> None:
        """Run ``fn()`` on the step thread and wait for it (``fn`` keeps its own exceptions)."""
        if threading.current_thread() is self._owner:
            fn()
            return
        done = threading.Event()
        failed: list[BaseException] = []
        with self._cv:
            self._cv.wait_for(lambda: self._job is None)
            self._job = (fn, done, failed)
            self._cv.notify_all()
            if not self._driven:
                self._ensure_thread()
        done.wait()
        if failed:
            raise failed[0]

    def drive(self, stop: threading.Event, poll_s: float = 0.25) -> None:
        """Run the steps on this thread until ``stop`` is set (then a thread of its own takes over)."""
        with self._cv:
            self._driven, self._owner = True, threading.current_thread()
        try:
            while not stop.is_set():
                with self._cv:
                    if not self._cv.wait_for(lambda: self._job is not None or stop.is_set(), poll_s):
                        continue
                    if self._job is None:
                        break
                    job, self._job = self._job, None
                    self._cv.notify_all()
                self._do(job)
        finally:
            with self._cv:
                self._driven, self._owner = False, None
                if self._job is not None:
                    self._ensure_thread()

    def _ensure_thread(self) -> None:
        """(under the lock) a thread of its own, unless one runs."""
        if self._owner is None or not self._owner.is_alive():
            self._owner = threading.Thread(target=self._loop, name="rakv-step", daemon=True)
            self._owner.start()

    def _loop(self) -> None:
        me = threading.current_thread()
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._job is not None or self._owner is not me)
                if self._owner is not me:
                    return
                job, self._job = self._job, None
                self._cv.notify_all()
            self._do(job)

    @staticmethod
    def _do(job) -> None:
        fn, done, failed = job
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - raised again in the thread that asked
            failed.append(e)
        finally:
            done.set()


class Batcher:
    """The baton lanes pass and the step where their forwards meet."""

    def __init__(self, on_step=None, on_pass=None):
        self._baton = threading.Lock()
        self._state = threading.Lock()
        self._local = threading.local()
        self._waiting: list[_Rows] = []
        self.live = 0
        self.joining = 0            # lanes waiting for the baton to start: the next step waits for them
        self.steps = 0
        self.on_step = on_step or (lambda info: None)
        self.on_pass = on_pass or (lambda backend, rows, ctx, ms: None)   # one model's forwards of a step
        self.before_step = lambda: None                                    # on the step's thread, first
        self.predict = lambda backend, rows, ctx: None                     # a pass's price before it runs
        self.runner = StepRunner()      # every step runs on one thread (StepRunner: why)
        self.last = None                # a backend whose rows wait while another model's wait too (lockstep)

    # ---- lanes
    def in_lane(self) -> bool:
        return getattr(self._local, "lane", False)

    @contextmanager
    def lane(self, rid_of=None):
        """Run a request's code as a lane: holding the baton except while waiting for a step.
        ``rid_of()``: the request id now (for the step records)."""
        with self._state:
            self.joining += 1
        self._baton.acquire()
        with self._state:
            self.joining -= 1
            self.live += 1
        self._local.lane, self._local.rid_of = True, rid_of
        try:
            with serial_here():       # a lane's own torch work starts no OpenMP team (StepRunner: why)
                yield
        finally:
            self._local.lane = False
            with self._state:
                self.live -= 1
                ready = bool(self._waiting) and len(self._waiting) >= self.live
                subs = self._take() if ready else []
            if subs:
                self._run(subs)
            self._baton.release()

    def _take(self) -> list[_Rows]:
        """The rows this step runs (``lockstep``); the rest stay waiting for a later step."""
        subs, self._waiting = lockstep(self._waiting, self.last)
        return subs

    # ---- the step
    def submit(self, backend, tokens: list[int], cache, keep: int, tree=None):
        """A lane's forward: wait for the step that carries it; its logits [keep or n, V]."""
        rid_of = getattr(self._local, "rid_of", None)
        sub = _Rows(backend, list(tokens), cache, keep, tree, rid_of() if rid_of else None)
        with self._state:
            self._waiting.append(sub)
            ready = len(self._waiting) >= self.live and not self.joining
            subs = self._take() if ready else []
        if subs:                                  # the last lane to arrive runs the step
            self._run(subs)
        if not sub.done.is_set():                 # (another's step, or this one held its rows: lockstep)
            self._baton.release()
            sub.done.wait()
            self._baton.acquire()
        if sub.error is not None:
            raise sub.error
        return sub.logits

    def _run(self, subs: list[_Rows]) -> None:
        """The step, on the step thread (the lane that called holds the baton while it runs)."""
        self.runner.run(lambda: self._run_here(subs))

    def _run_here(self, subs: list[_Rows]) -> None:
        self.before_step()
        t0 = now()
        shared = False
        priced: list[float | None] = []
        try:
            groups: dict[int, list[_Rows]] = {}
            for s in subs:
                groups.setdefault(id(s.backend), []).append(s)
            for group in groups.values():
                ctx = _mean_context(group)
                rows = sum(len(s.tokens) for s in group if s.tree is None)
                priced.append(self.predict(group[0].backend, rows, ctx))
                tg = now()
                shared |= self._run_group(group)
                self.on_pass(group[0].backend, rows, ctx, (now() - tg) * 1e3)
        except BaseException as e:  # noqa: BLE001 - every waiting lane gets the failure
            for s in subs:
                if s.logits is None:
                    s.error = e
        ms = (now() - t0) * 1e3
        self.steps += 1
        pred = None if not priced or None in priced else round(sum(priced), 3)
        info = StepInfo(self.steps, [(s.rid, len(s.tokens)) for s in subs], round(ms, 3), shared, pred)
        for s in subs:
            s.done.set()
        self.on_step(info)

    @staticmethod
    def _run_group(group: list[_Rows]) -> bool:
        """One model's forwards of this step: rows that can share a pass in one call, others alone."""
        be = group[0].backend
        lean = getattr(be, "lean", None)
        together = [s for s in group if s.tree is None and segments_ok(lean, [s.cache])] if len(group) > 1 else []
        if len(together) >= 2:
            outs = forward_segments(lean, [(s.tokens, s.cache, s.keep) for s in together])
            for s, o in zip(together, outs):
                s.logits = o
        for s in group:
            if s.logits is None:
                s.logits = be.forward(s.tokens, s.cache, s.keep, s.tree)
        return len(together) >= 2


def lockstep(waiting: list, last) -> tuple[list, list]:
    """(now, later): while a model draft's rows wait, the target's (``last``) wait for the next
    step: the lanes' rounds fall into step, their draft tokens share the draft's passes and their
    verifies one pass of the target, instead of every step paying a pass of each model. A new
    prompt's chunk never waits (``prompt_chunk``): it is paid once either way, and its request's
    first token comes sooner."""
    if last is None or all(s.backend is last for s in waiting):
        return waiting, []
    held = [s.backend is last and not prompt_chunk(s) for s in waiting]
    return [s for s, h in zip(waiting, held) if not h], [s for s, h in zip(waiting, held) if h]


def prompt_chunk(s) -> bool:
    """Rows of a prompt (several tokens, the last one's logits kept), not a decode step or a verify."""
    return s.tree is None and s.keep == 1 and len(s.tokens) > 1


def _mean_context(group: list[_Rows]) -> float:
    """The rows' mean context (each request's cache length before the step)."""
    lens = []
    for s in group:
        try:
            lens.append(cache_len(s.cache))
        except (AttributeError, TypeError, ValueError):
            pass
    return sum(lens) / len(lens) if lens else 0.0


class BatchedBackend:
    """A model's backend whose forwards, called from a lane, join the batcher's step (called from
    anywhere else: run at once). Everything else is the wrapped backend's."""

    def __init__(self, inner, batcher: Batcher):
        self.inner = inner
        self.batcher = batcher

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward(self, tokens, cache, keep: int = 0, tree=None):
        if not self.batcher.in_lane():
            return self.inner.forward(tokens, cache, keep, tree)
        tokens = list(tokens.view(-1).tolist()) if hasattr(tokens, "view") else list(tokens)
        lean = getattr(self.inner, "lean", None)
        if keep and tree is None and len(tokens) > PREFILL_CHUNK and lean is not None and lean.rows_alone():
            # a prompt in chunks, one a step (rows alone: the same bits as one forward of it all)
            for i in range(0, len(tokens) - PREFILL_CHUNK, PREFILL_CHUNK):
                self.batcher.submit(self.inner, tokens[i:i + PREFILL_CHUNK], cache, 1)
            tokens = tokens[len(tokens) - (len(tokens) - 1) % PREFILL_CHUNK - 1:]
        return self.batcher.submit(self.inner, tokens, cache, keep, tree)

    def prefill(self, ids, cache):
        return self.forward(ids, cache, 1)[-1]

    def step(self, token: int, cache):
        return self.forward([token], cache, 1)[-1]

    def verify(self, tokens, cache):
        return self.forward(tokens, cache, 0)

    def tree(self, tokens, parents, cache):
        """A token tree runs alone (the lane holds the baton: no other forward runs meanwhile)."""
        return self.inner.tree(tokens, parents, cache)


class LanePool:
    """``n`` lanes over one engine: the engine's target (its backend joined to the batcher), prefix
    cache and learned state, each lane its own draft state and controls; request ids from one
    counter, so a request's seed (the call's + its id) is what one engine would give it."""

    def __init__(self, engine, n: int, on_step=None):
        self.base = engine
        self.batcher = Batcher(on_step, self._learn_pass)
        self.lanes = [engine] + [engine.lane() for _ in range(max(1, n) - 1)]
        self.view = BatchView(lockstep=True)     # what each request puts in a step: its k is priced by it
        for e in self.lanes:
            e.planner.batch = self.view
            e.step_reports = False               # a lane's forward waits for the others: the step is timed here
        self.batcher.on_step = self._step_done(self.batcher.on_step)
        self.batcher.before_step = engine.threads.use        # the step's thread count, on its thread
        self.batcher.predict = self._price_pass
        target = engine.target.backend
        self.batcher.last = getattr(target, "inner", target)     # a draft's passes first (lockstep)
        self._free = list(reversed(self.lanes))
        self._cv = threading.Condition()
        self.busy = 0                            # lanes running a request
        self._next_id = engine._next_id
        for lm in {id(m): m for m in (engine.target, getattr(engine.draft, "lm", None)) if m is not None}.values():
            join_batcher(lm, self.batcher)

    def _step_done(self, on_step):
        """The shared step's time to the engine's thread count (rakv.util.threads), then ``on_step``."""
        def done(info: StepInfo) -> None:
            self.view.tick()
            self.base.threads.step(info.ms, sum(n for _, n in info.rows))
            on_step(info)
        return done

    @property
    def size(self) -> int:
        return len(self.lanes)

    def _learn_pass(self, backend, rows: int, ctx: float, ms: float) -> None:
        """A step's pass of the target: its measured ms teaches the batch's W(n) (``BatchView.costs``)
        against the profile's W(n) at the rows' mean context; the draft's passes are priced as its steps."""
        p = self.base.profile
        target = self.base.target.backend
        if p is None or rows < 1 or backend is not getattr(target, "inner", target):
            return
        self.view.costs.observe(rows, p.verify(rows - 1, ctx), ms)

    def _price_pass(self, backend, rows: int, ctx: float) -> float | None:
        """A pass's predicted ms before it runs: the target's W(rows) (the profile's verify of
        rows - 1 drafts at the rows' mean context, times the batch's learned scale); the draft's, its
        step times the same rows-over-one ratio of the target's verify (its own W(n) is not measured)."""
        p = self.base.profile
        if p is None or rows < 1:
            return None
        target = self.base.target.backend
        w = p.verify(rows - 1, ctx)
        if backend is getattr(target, "inner", target):
            return w * self.view.costs.factor(rows)
        t = p.step(ctx)
        return p.draft_step(ctx) * (w / t) if t > 0 and p.d else None

    def stop_all(self) -> None:
        """Every running request ends within its round."""
        for e in self.lanes:
            e.stop()

    @contextmanager
    def lane(self, timeout: float | None = None):
        """A free lane, running as a lane of the batcher (blocks while all are busy; TimeoutError)."""
        with self._cv:
            if not self._cv.wait_for(lambda: self._free, timeout):
                raise TimeoutError("no free lane")
            eng = self._free.pop()
            self.busy += 1
        try:
            with self.batcher.lane(lambda: getattr(eng, "_open_request", None)):
                eng._next_id = self._next_id        # (under the baton: ids in order of arrival)
                self._next_id += 1
                yield eng
        finally:
            with self._cv:
                self._free.append(eng)
                self.busy -= 1
                self._cv.notify()


def join_batcher(lm, batcher: Batcher) -> None:
    """Route ``lm``'s forwards through ``batcher`` (a lane's join its step; any other runs at once)."""
    be = lm.backend if getattr(lm, "backend", None) is not None else backend_of(lm.model)
    if isinstance(be, BatchedBackend):       # (a model one pool at a time: the newest one's)
        be.batcher = batcher
        return
    wrapped = BatchedBackend(be, batcher)
    lm.backend = wrapped
    set_backend(lm.model, wrapped)

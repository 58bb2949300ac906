""""Measure every action": the paper's oracle on one prompt, from the engine's current state.

Every action (r, k) of {0, 1} x K is run ``repeats`` times through ``Engine.generate`` with a fixed
policy (``ar`` / ``kv`` / ``spec:k`` / ``joint:k``: no probes, no re-decisions), and the adaptive
policy itself once per repeat. Before each run the state is put back as it was when the
measurement started:

* the prefix cache (entries, LRU order, hits, statistics) by ``PrefixCache.snapshot/restore``;
* the controller and cost profile (acceptance estimates, online cost refinement, probe state)
  and the gate's acceptance maps (``accept_map``, ``lookup_map``, and those kept for other sampling
  settings) by running on fresh deep copies of them: measuring teaches the controller and the gate
  nothing;
* the request counter, policy and force; the engine's records go to a local collector, so the
  measured runs are not session requests. Only the resulting ``OracleResult`` is emitted through
  the engine's callback (so it is recorded and shown like any other record).

Runs are interleaved (repeat 1 of every action, then repeat 2, ...; each repeat rotates the order)
so that a slow spell of a shared machine spreads over all actions instead of one. The controller's
choice and its predicted costs come from the adaptive run's per-request ``Decision``, i.e. what
the controller decides on this prompt in the original state; beside each action's runs stands the
prediction of that run itself (``predicted_of_run``). Every run must produce the same
tokens (exact decoding); a difference is reported in ``exact`` / ``mismatch``.
"""

from __future__ import annotations

import copy
import statistics
import threading
import time
from dataclasses import asdict

from ..records import ActionMeasure, CacheLookup, Decision, OracleResult, RequestEnd, RequestStart

now = time.perf_counter
ADAPTIVE = "adaptive"
# what the gate learns (``RoundPlanner``): its acceptance maps, those of the other sampling settings, the copy ledgers
GATE_STATE = ("accept_map", "lookup_map", "setting", "_maps", "copy_book")


def policy_of(reuse: int, k: int) -> str:
    """The fixed policy that runs exactly the action (r, k)."""
    if k == 0:
        return "kv" if reuse else "ar"
    return f"{'joint' if reuse else 'spec'}:{k}"


class Oracle:
    """Measure every action on one prompt. ``measure`` runs on the caller's thread (the GUI's
    worker); ``stop`` may be called from any thread and ends the measurement within one round.

    ``progress(done, total, label)`` is called before each run (done = runs finished so far)
    and once at the end."""

    def __init__(self, engine, repeats: int = 3, k_set=None, progress=None):
        if repeats < 1:
            raise ValueError("repeats must be >= 1")
        self.engine = engine
        self.repeats = int(repeats)
        self.k_set = None if k_set is None else tuple(sorted({int(k) for k in k_set}))
        self.progress = progress or (lambda done, total, label: None)
        self._stop = threading.Event()

    def stop(self) -> None:
        self._stop.set()
        self.engine.stop()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    # ------------------------------------------------------------------ the measurement
    def measure(self, prompt, max_new_tokens: int | None = None, prompt_text: str | None = None,
                emit: bool = True) -> OracleResult | None:
        """Run every action; returns the result (also emitted through the engine's callback when
        ``emit``), or None when stopped. Engine errors propagate, with the state restored."""
        eng = self.engine
        t_start = now()
        ks = self.k_set if self.k_set is not None else tuple(eng.k_set)
        if not eng.draft.proposes:
            ks = tuple(k for k in ks if k == 0) or (0,)
        actions = [(r, k) for r in (0, 1) for k in ks]
        jobs: list = list(actions) + ([ADAPTIVE] if eng.controller is not None else [])
        total = len(jobs) * self.repeats
        runs: dict = {j: [] for j in jobs}          # job -> [RequestEnd]
        first: dict = {}                             # job -> records of its first run
        saved = _Saved(eng)
        try:
            done = 0
            for rep in range(self.repeats):
                order = jobs[rep % len(jobs):] + jobs[: rep % len(jobs)]
                for job in order:
                    if self._stop.is_set():
                        return None
                    label = "adaptive" if job == ADAPTIVE else f"r={job[0]}, k={job[1]}"
                    self.progress(done, total, f"{label} (repeat {rep + 1}/{self.repeats})")
                    recs = saved.fresh_run(job, prompt, max_new_tokens, prompt_text)
                    end = next((r for r in reversed(recs) if isinstance(r, RequestEnd)), None)
                    if self._stop.is_set() or end is None or end.stopped == "stop":
                        return None
                    runs[job].append(end)
                    first.setdefault(job, recs)
                    done += 1
            self.progress(total, total, "done")
        finally:
            saved.restore()
            eng._stop.clear()         # a stop() that came between runs must not stop the next request
        result = self._result(actions, runs, first, ks, max_new_tokens, prompt, prompt_text, saved.next_id - 1)
        result.elapsed_ms = round((now() - t_start) * 1e3, 3)
        if emit:
            eng._emit(result)
        return result

    def _result(self, actions, runs, first, ks, max_new_tokens, prompt, prompt_text, after) -> OracleResult:
        eng = self.engine
        dec = next((r for r in first.get(ADAPTIVE, []) if isinstance(r, Decision) and r.round < 0), None)
        cands = {(c["reuse"], c["k"]): c for c in dec.candidates} if dec is not None else {}
        measures = []
        for r, k in actions:
            ms = [e.latency_ms for e in runs[(r, k)]]
            c = cands.get((r, k))
            measures.append(ActionMeasure(
                reuse=r, k=k, predicted_ms=predicted_of_run(first.get((r, k), []), c),
                feasible=True if c is None else bool(c.get("feasible", True)), runs_ms=ms,
                median_ms=round(statistics.median(ms), 3), min_ms=round(min(ms), 3), max_ms=round(max(ms), 3),
                output_tokens=len(runs[(r, k)][0].output_ids)))
        feas = [m for m in measures if m.feasible] or measures
        best = min(feas, key=lambda m: (m.median_ms, m.reuse, m.k))
        choice = dict(dec.action) if dec is not None else {}
        chosen = next((m for m in measures if m.reuse == choice.get("reuse") and m.k == choice.get("k")), None)
        regret = None
        if chosen is not None and best.median_ms > 0:
            regret = round((chosen.median_ms - best.median_ms) / best.median_ms, 5)
        # the target's prefix-cache hit at the measured state: the lookup of an r = 1 run
        look = None
        for job, recs in first.items():
            if job != ADAPTIVE and job[0] == 1:
                look = next((x for x in recs if isinstance(x, CacheLookup) and x.model == "target"), None)
                break
        start = next((x for x in next(iter(first.values())) if isinstance(x, RequestStart)), RequestStart())
        ids = start.prompt_ids
        exact, mismatch = check_exact(runs)
        adaptive = runs.get(ADAPTIVE)
        text = prompt if isinstance(prompt, str) else (prompt_text or "")
        return OracleResult(after_request=after, prompt=text, prompt_ids=list(ids), prompt_tokens=len(ids),
                            templated=bool(getattr(start, "templated", False)),
                            max_new_tokens=int(max_new_tokens if max_new_tokens is not None
                                               else eng.config.max_new_tokens),
                            hit_tokens=look.hit_tokens if look is not None else 0,
                            exact_repeat=bool(look.exact_repeat) if look is not None else False,
                            repeats=self.repeats, k_set=list(ks), actions=[asdict(m) for m in measures],
                            choice=choice, choice_reason=dec.reason if dec is not None else "",
                            alpha=None if dec is None else round(dec.alpha, 5),
                            oracle={"reuse": best.reuse, "k": best.k}, regret=regret,
                            adaptive_ms=round(statistics.median(e.latency_ms for e in adaptive), 3) if adaptive else None,
                            output_tokens=measures[0].output_tokens, exact=exact, mismatch=mismatch)


def predicted_of_run(recs: list, cand: dict | None) -> float | None:
    """The prediction beside an action's measured runs: what the controller predicted for the run
    itself (its fixed policy's Decision: an ungated ``kv`` steps where the adaptive gate would copy),
    else the adaptive decision's candidate. Like is compared with like."""
    own = next((r for r in recs if isinstance(r, Decision) and r.round < 0), None)
    if own is not None and own.candidates and own.candidates[0].get("predicted_ms"):
        return own.candidates[0]["predicted_ms"]
    return None if cand is None else cand["predicted_ms"]


def check_exact(runs: dict) -> tuple[bool, str]:
    """Every run of every job must produce the same token ids; else say where the first differs."""
    ref_job, ref = None, None
    for job, ends in runs.items():
        for i, e in enumerate(ends):
            if ref is None:
                ref_job, ref = job, e.output_ids
                continue
            if e.output_ids != ref:
                j = next((n for n, (a, b) in enumerate(zip(e.output_ids, ref)) if a != b),
                         min(len(e.output_ids), len(ref)))
                name = lambda jb: "adaptive" if jb == ADAPTIVE else f"(r={jb[0]}, k={jb[1]})"  # noqa: E731
                return False, (f"OUTPUT MISMATCH: {name(job)} run {i + 1} differs from {name(ref_job)} at output "
                               f"token {j} ({len(e.output_ids)} vs {len(ref)} tokens)")
    return True, ""


class _Saved:
    """What a measurement must leave as it found: the engine's learned state, cache, controls."""

    def __init__(self, eng):
        self.eng = eng
        self.callback = eng.callback
        self.controller = eng.controller
        self.profile = eng.profile
        self.alpha = eng.alpha
        self.policy = eng.policy
        self.force = eng.force
        self.next_id = eng._next_id
        self.snap = eng.store.snapshot()
        # the gate's tables (the planner's, per sampling setting; one object where two names share it)
        self.gate_holder = getattr(eng, "planner", eng)
        self.gate = {n: getattr(self.gate_holder, n) for n in GATE_STATE if hasattr(self.gate_holder, n)}

    def fresh_run(self, job, prompt, max_new_tokens, prompt_text) -> list:
        """One run of ``job`` from the saved state, on copies of the learned state; its records."""
        eng = self.eng
        eng.store.restore(self.snap)
        if self.controller is not None:
            ctl = copy.deepcopy(self.controller)          # its profile is copied with it
            eng.controller, eng.profile, eng.alpha = ctl, ctl.profile, ctl.alpha
        else:
            eng.profile = copy.deepcopy(self.profile)
            eng.alpha = copy.deepcopy(self.alpha)
        for name, value in copy.deepcopy(self.gate).items():       # one copy: a shared map stays shared
            setattr(self.gate_holder, name, value)
        recs: list = []
        eng.callback = recs.append
        eng._next_id = self.next_id
        eng.set_force(None)
        eng.set_policy(ADAPTIVE if job == ADAPTIVE else policy_of(*job))
        eng.generate(prompt, max_new_tokens, prompt_text)
        return recs

    def restore(self) -> None:
        eng = self.eng
        eng.store.restore(self.snap)
        eng.callback = self.callback
        eng.controller, eng.profile, eng.alpha = self.controller, self.profile, self.alpha
        for name, value in self.gate.items():
            setattr(self.gate_holder, name, value)
        eng._next_id = self.next_id
        with eng._lock:
            eng.policy = self.policy
        if eng.force is None:                 # unless the user set a new one meanwhile
            eng.set_force(self.force)

""""Measure every action" (rakv.decide.oracle): same state for every run, nothing learned, exactness."""

from __future__ import annotations

import copy
import csv
from dataclasses import asdict, fields, is_dataclass

import numpy as np
import pytest
import torch

from rakv.cli import main as cli_main
from rakv.config import RakvConfig
from rakv.drafts.model import ModelDraft
from rakv.engine import Engine
from rakv.decide.oracle import Oracle, check_exact, policy_of
from rakv.prefix_cache import PrefixCache
from rakv.records import (ORACLE_CSV_COLUMNS, OracleResult, Recorder, RequestEnd, oracle_csv_path,
                          read_recording)
from tests.tiny import reference, synthetic_profile

PROMPT = "The quick brown fox jumps over the lazy dog. def add(a, b):"


def engine(calibrated, recs, **kw):
    target, draft, profile = calibrated
    cfg = RakvConfig(k_set=(0, 2, 4), max_new_tokens=12, **kw)
    return Engine(target, ModelDraft(draft), cfg, recs.append, copy.deepcopy(profile))


def plain(x, seen=None):
    """An object graph as plain data (every attribute, deeply), to compare states whole."""
    seen = set() if seen is None else seen
    if isinstance(x, (int, float, str, bool, type(None))):
        return x
    if isinstance(x, np.ndarray):
        return ("ndarray", x.tolist())
    if isinstance(x, torch.Tensor):
        return ("tensor", id(x))                  # shared, never copied: the same object
    if callable(x) and not hasattr(x, "__dict__"):
        return "callable"
    if id(x) in seen:
        return ("seen", type(x).__name__)
    seen.add(id(x))
    if isinstance(x, dict):
        return {repr(k): plain(v, seen) for k, v in x.items()}
    if isinstance(x, (list, tuple, set, frozenset)):
        items = sorted(x, key=repr) if isinstance(x, (set, frozenset)) else x
        return [type(x).__name__] + [plain(v, seen) for v in items]
    if is_dataclass(x):
        return {f.name: plain(getattr(x, f.name), seen) for f in fields(x)}
    if hasattr(x, "__dict__"):
        return {type(x).__name__: {k: plain(v, seen) for k, v in vars(x).items() if not callable(v)}}
    return repr(x)


def store_state(store) -> dict:
    return {"stats": asdict(store.stats), "budget": store.budget, "history": store.history.tokens.tolist(),
            "lru": [(e.key, e.ids.tolist(), e.hits, e.nbytes, [id(k) for k, _ in e.kv]) for e in store.entries()],
            "buckets": sorted((k, b, [id(e) for e in es]) for (k, b), es in store._buckets.items())}


def learned_state(eng) -> dict:
    """Everything a request can teach the engine: the controller (all of it), its profile and alpha,
    the prefix cache (entries, LRU order, hits, statistics, history), the gate's acceptance maps, and
    the request counter and controls."""
    holder = getattr(eng, "planner", eng)        # the gate's tables, per sampling setting
    return {"controller": plain(eng.controller), "profile": asdict(eng.profile), "alpha": plain(eng.alpha),
            "store": store_state(eng.store), "accept_map": plain(eng.accept_map),
            "lookup_map": plain(eng.lookup_map), "maps_shared": eng.accept_map is eng.lookup_map,
            "other_settings": plain({n: getattr(holder, n) for n in ("setting", "_maps") if hasattr(holder, n)}),
            "next_id": eng._next_id, "policy": eng.policy, "force": eng.force, "k_set": eng.k_set}


def test_policy_of_every_action():
    assert [policy_of(r, k) for r in (0, 1) for k in (0, 3)] == ["ar", "spec:3", "kv", "joint:3"]


def test_prefix_cache_snapshot_restore():
    c = PrefixCache(10_000)
    kv = [(torch.zeros(1, 2, 20, 4), torch.zeros(1, 2, 20, 4))]
    c.store("m", list(range(20)), kv, None)
    c.store("m", list(range(100, 120)), kv, None)
    c.lookup("m", list(range(20)))
    snap = c.snapshot()
    before = (asdict(c.stats), [(e.ids.tolist(), e.hits) for e in c.entries()])
    c.lookup("m", list(range(100, 120)))                              # LRU order + hits change
    c.store("m", list(range(200, 220)), kv, None)                     # evicts (budget)
    c.set_budget(0)
    assert len(c) == 0
    c.restore(snap)
    assert (asdict(c.stats), [(e.ids.tolist(), e.hits) for e in c.entries()]) == before
    assert c.budget == 10_000 and c.lookup("m", list(range(20))).q == 20


def test_measure_every_action_leaves_state_and_reports(calibrated):
    recs: list = []
    eng = engine(calibrated, recs)
    first = eng.generate(PROMPT)
    before = learned_state(eng)
    n_recs = len(recs)
    progress = []
    res = Oracle(eng, repeats=2, progress=lambda *a: progress.append(a)).measure(PROMPT)
    # nothing learned, nothing stored, no request consumed; the result is the only record emitted
    assert learned_state(eng) == before
    assert len(recs) == n_recs + 1 and recs[-1] is res and isinstance(res, OracleResult)
    # every action of {0, 1} x K, R runs each, with the controller's predictions
    assert [(a["reuse"], a["k"]) for a in res.actions] == [(r, k) for r in (0, 1) for k in (0, 2, 4)]
    assert all(len(a["runs_ms"]) == 2 and a["min_ms"] <= a["median_ms"] <= a["max_ms"] for a in res.actions)
    assert all(a["predicted_ms"] is not None and a["feasible"] for a in res.actions)
    assert res.repeats == 2 and res.k_set == [0, 2, 4] and res.after_request == first.request_id
    # the measured state: the prompt was just run, so r = 1 is an exact repeat
    assert res.exact_repeat and res.hit_tokens == res.prompt_tokens
    # exact: every run gave the target's greedy output
    assert res.exact and res.mismatch == ""
    assert res.output_tokens == len(first.output_ids)
    assert (first.output_ids, first.stopped) == reference(calibrated[0], res.prompt_ids, 12)
    # the controller's choice is what it decides from this state; oracle = argmin of medians
    d = eng.controller.decide(eng._situation(res.prompt_ids, 12, eng.store.budget, True, True, True), (0, 2, 4))
    assert res.choice == {"reuse": d.reuse, "k": d.k} and res.choice_reason == "argmin"
    best = min(res.actions, key=lambda a: a["median_ms"])
    assert res.oracle == {"reuse": best["reuse"], "k": best["k"]}
    ch = next(a for a in res.actions if (a["reuse"], a["k"]) == (d.reuse, d.k))
    assert res.regret == pytest.approx((ch["median_ms"] - best["median_ms"]) / best["median_ms"], abs=1e-4)
    assert res.regret >= 0 and res.adaptive_ms > 0
    # like with like: the adaptive choice copies this exact repeat (gate), priced as its copy rounds;
    # beside the measured kv runs (no gate: plain steps) stands the kv run's own prediction
    kv_adaptive = next(c for c in d.candidates if (c.reuse, c.k) == (1, 0))
    kv = next(a for a in res.actions if (a["reuse"], a["k"]) == (1, 0))
    assert d.copy and kv["predicted_ms"] > kv_adaptive.predicted_ms
    # progress: one call per run (7 jobs x 2), then done
    assert progress[-1] == (14, 14, "done") and len(progress) == 15
    # the engine still works as before: the next request is request 1, an exact repeat
    nxt = eng.generate(PROMPT)
    assert nxt.request_id == first.request_id + 1 and nxt.exact_repeat and nxt.output_ids == first.output_ids


def test_measuring_a_partial_hit_changes_no_learned_state(calibrated):
    """A partial hit: every action really runs (prefill from the boundary, drafting rounds, the
    adaptive run's gate), each from the saved state; afterwards the whole learned state is as it
    was, the gate's maps included, and the request it measured teaches the engine when it runs."""
    target, draft, _ = calibrated
    ids = target.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    other = ids[:18] + [7, 8, 9]                  # shares 18 tokens (and the bucket) with PROMPT
    eng = Engine(target, ModelDraft(draft), RakvConfig(k_set=(0, 2, 4), max_new_tokens=12, policy="adaptive:gate"),
                 profile=synthetic_profile(d=0.3, alpha0=0.7))      # drafting pays: the gate runs
    for p in (ids, ids[:18] + [11]):             # learn something first (maps, alpha, profile, store)
        eng.generate(p)
    before = learned_state(eng)
    res = Oracle(eng, repeats=1).measure(other)
    assert res.hit_tokens == 18 and not res.exact_repeat and res.exact
    assert res.choice["k"] > 0 and all(a["runs_ms"] for a in res.actions)
    assert learned_state(eng) == before
    # not a vacuous check: the same request run for real changes the maps (and the rest)
    eng.generate(other)
    after = learned_state(eng)
    assert after["accept_map"] != before["accept_map"] and after["controller"] != before["controller"]
    assert after["store"] != before["store"]
    # measuring at another sampling setting switches to that setting's tables in every run: the
    # engine's own (greedy) tables stay current and no other setting's are kept
    from rakv.config import Sampling

    eng.set_sampling(Sampling(temperature=0.8, seed=3))
    before = learned_state(eng)
    assert Oracle(eng, repeats=1).measure(other).exact
    assert learned_state(eng) == before and eng.planner.setting == "greedy" and not eng.planner._maps


def test_infeasible_actions_are_measured_but_not_the_oracle(calibrated):
    recs: list = []
    eng = engine(calibrated, recs, budget_mib=0.0)
    res = Oracle(eng, repeats=1).measure(PROMPT)
    r1 = [a for a in res.actions if a["reuse"] == 1]
    assert r1 and not any(a["feasible"] for a in r1) and all(a["runs_ms"] for a in r1)
    assert res.oracle["reuse"] == 0 and res.choice["reuse"] == 0
    assert not res.exact_repeat and res.hit_tokens == 0


def test_stop_returns_none_and_restores(calibrated):
    recs: list = []
    eng = engine(calibrated, recs)
    eng.generate(PROMPT)
    before = learned_state(eng)
    o = Oracle(eng, repeats=3)
    o.progress = lambda done, total, label: o.stop() if done == 3 else None
    assert o.measure(PROMPT) is None
    assert learned_state(eng) == before
    assert not any(isinstance(r, OracleResult) for r in recs)


def test_engine_error_restores_state(calibrated):
    recs: list = []
    eng = engine(calibrated, recs)
    before = learned_state(eng)
    with pytest.raises(ValueError):
        Oracle(eng, repeats=1).measure("   ")
    assert learned_state(eng) == before and eng.callback == recs.append


def test_mismatch_is_reported():
    a = RequestEnd(output_ids=[1, 2, 3])
    b = RequestEnd(output_ids=[1, 2, 4])
    assert check_exact({(0, 0): [a, a], (1, 2): [a]}) == (True, "")
    ok, msg = check_exact({(0, 0): [a], (1, 2): [a, b]})
    assert not ok and "MISMATCH" in msg and "(r=1, k=2) run 2" in msg and "token 2" in msg


def test_recorded_and_exported(calibrated, tmp_path, capsys):
    rec_path = tmp_path / "s.jsonl"
    rec = Recorder(rec_path)
    target, draft, profile = calibrated
    eng = Engine(target, ModelDraft(draft), RakvConfig(k_set=(0, 2), max_new_tokens=8), rec,
                 copy.deepcopy(profile))
    eng.header()
    eng.generate(PROMPT)
    res = Oracle(eng, repeats=2).measure(PROMPT)
    rec.close()
    back = read_recording(rec_path)
    assert [type(r).__name__ for r in back].count("OracleResult") == 1
    assert asdict([r for r in back if isinstance(r, OracleResult)][0]) == asdict(res)
    out = tmp_path / "t.csv"
    assert cli_main(["replay", str(rec_path), "--csv", str(out)]) == 0
    oc = oracle_csv_path(out)
    assert oc.name == "t.oracle.csv"
    rows = list(csv.DictReader(open(oc, newline="")))
    assert list(rows[0]) == [c for c, _ in ORACLE_CSV_COLUMNS] and len(rows) == 4
    assert sum(int(r["oracle"]) for r in rows) == 1 and sum(int(r["chosen"]) for r in rows) == 1
    assert all(len(r["runs_ms"].split(";")) == 2 for r in rows)
    other = tmp_path / "elsewhere.csv"
    assert cli_main(["replay", str(rec_path), "--csv", str(out), "--oracle-csv", str(other)]) == 0
    assert len(list(csv.DictReader(open(other, newline="")))) == 4
    before = rec_path.read_bytes()
    assert cli_main(["replay", str(rec_path), "--csv", str(out), "--oracle-csv", str(rec_path)]) == 2
    assert rec_path.read_bytes() == before                     # an input is never overwritten

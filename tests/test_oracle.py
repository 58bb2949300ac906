""""Measure every action" (rakv.oracle): same state for every run, nothing learned, exactness."""

from __future__ import annotations

import copy
import csv
from dataclasses import asdict

import pytest
import torch

from rakv.cli import main as cli_main
from rakv.config import RakvConfig
from rakv.costs import calibrate
from rakv.drafts import ModelDraft
from rakv.engine import Engine
from rakv.oracle import Oracle, check_exact, policy_of
from rakv.prefix_cache import PrefixCache
from rakv.records import (ORACLE_CSV_COLUMNS, OracleResult, Recorder, RequestEnd, oracle_csv_path,
                          read_recording)
from tests.tiny import make_pair, oracle as greedy

PROMPT = "The quick brown fox jumps over the lazy dog. def add(a, b):"


@pytest.fixture(scope="module")
def pair():
    target, draft = make_pair("llama", "mostly")
    profile = calibrate(target, ModelDraft(draft), quick=True)
    return target, draft, profile


def engine(pair, recs, **kw):
    target, draft, profile = pair
    cfg = RakvConfig(k_set=(0, 2, 4), max_new_tokens=12, **kw)
    return Engine(target, ModelDraft(draft), cfg, recs.append, copy.deepcopy(profile))


def learned_state(eng) -> dict:
    ctl = eng.controller
    scalars = lambda o: {k: v for k, v in vars(o).items()  # noqa: E731
                         if isinstance(v, (int, float, str, bool, tuple, type(None)))}
    return {"profile": asdict(eng.profile), "alpha": scalars(ctl.alpha), "controller": scalars(ctl),
            "store": (asdict(eng.store.stats), [(e.key, e.ids.tolist(), e.hits) for e in eng.store.entries()]),
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


def test_measure_every_action_leaves_state_and_reports(pair):
    recs: list = []
    eng = engine(pair, recs)
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
    assert first.output_ids == greedy(pair[0].model, res.prompt_ids, 12)[: len(first.output_ids)]
    # the controller's choice is what it decides from this state; oracle = argmin of medians
    d = eng.controller.decide(eng._situation(res.prompt_ids, 12, eng.store.budget, True, True, True), (0, 2, 4))
    assert res.choice == {"reuse": d.reuse, "k": d.k} and res.choice_reason == "argmin"
    best = min(res.actions, key=lambda a: a["median_ms"])
    assert res.oracle == {"reuse": best["reuse"], "k": best["k"]}
    ch = next(a for a in res.actions if (a["reuse"], a["k"]) == (d.reuse, d.k))
    assert res.regret == pytest.approx((ch["median_ms"] - best["median_ms"]) / best["median_ms"], abs=1e-4)
    assert res.regret >= 0 and res.adaptive_ms > 0
    # progress: one call per run (7 jobs x 2), then done
    assert progress[-1] == (14, 14, "done") and len(progress) == 15
    # the engine still works as before: the next request is request 1, an exact repeat
    nxt = eng.generate(PROMPT)
    assert nxt.request_id == first.request_id + 1 and nxt.exact_repeat and nxt.output_ids == first.output_ids


def test_infeasible_actions_are_measured_but_not_the_oracle(pair):
    recs: list = []
    eng = engine(pair, recs, budget_mib=0.0)
    res = Oracle(eng, repeats=1).measure(PROMPT)
    r1 = [a for a in res.actions if a["reuse"] == 1]
    assert r1 and not any(a["feasible"] for a in r1) and all(a["runs_ms"] for a in r1)
    assert res.oracle["reuse"] == 0 and res.choice["reuse"] == 0
    assert not res.exact_repeat and res.hit_tokens == 0


def test_stop_returns_none_and_restores(pair):
    recs: list = []
    eng = engine(pair, recs)
    eng.generate(PROMPT)
    before = learned_state(eng)
    o = Oracle(eng, repeats=3)
    o.progress = lambda done, total, label: o.stop() if done == 3 else None
    assert o.measure(PROMPT) is None
    assert learned_state(eng) == before
    assert not any(isinstance(r, OracleResult) for r in recs)


def test_engine_error_restores_state(pair):
    recs: list = []
    eng = engine(pair, recs)
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


def test_recorded_and_exported(pair, tmp_path, capsys):
    rec_path = tmp_path / "s.jsonl"
    rec = Recorder(rec_path)
    target, draft, profile = pair
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

"""Controller metrics against the repeated-measurement oracle, on synthetic rows with known answers;
the machine's regime; the summary's paper table and its de-noising label."""

from __future__ import annotations

import csv
import json
import random

import pytest

from rakv.bench import metrics as M
from rakv.bench import report as R
from rakv.decide.profile import CostProfile
from rakv.decide.regime import cpu_flags, decode_crossover, describe, regime

POLICY = {(0, 0): "ar", (1, 0): "kv"}
AD = "adaptive:request"


def name(a):
    return POLICY.get(a) or (f"spec:{a[1]}" if a[0] == 0 else f"joint:{a[1]}")


def row(rep, index, policy, lat, workload="w", k=0, alpha=None, out=8):
    return dict(rep=rep, cell=f"{workload}/P32/N8", index=index, workload=workload, kind="unrelated", policy=policy,
                latency_ms=float(lat), match=1, rounds=1, mean_accept_len=1.0, hit_tokens=0, ttft_ms=1.0,
                tokens_per_s=out / lat * 1e3, alpha_req=alpha, prompt_tokens=32, gen=8, output_tokens=out, k=k,
                reuse=0, bucket=32, order=0, context_id=index, exact_repeat=0, drafted=0, accepted=0, mean_k=k,
                predicted_ms=None, first_diff=None, stopped="max_new_tokens")


def build(requests, workload="w"):
    """requests: list of (measured {action: [latency per repeat]}, [chosen per repeat], [own latency per
    repeat]); predictions = the medians (so MAPE 0, Spearman 1). Returns (rows, cands)."""
    rows, cands = [], []
    for i, (meas, chosen, own) in enumerate(requests):
        for rep, (ch, o) in enumerate(zip(chosen, own)):
            for a, xs in meas.items():
                rows.append(row(rep, i, name(a), xs[rep], workload, k=a[1], alpha=0.5 if a[1] else None))
            rows.append(row(rep, i, AD, o, workload, k=ch[1]))
            for a, xs in meas.items():
                cands.append(dict(rep=rep, cell=f"{workload}/P32/N8", index=i, policy=AD, reuse=a[0], k=a[1],
                                  predicted_ms=sorted(xs)[len(xs) // 2], feasible=1, chosen=int(a == ch)))
    return rows, cands


# request 0: ar is the oracle (median 100, range 98-102); kv is 1 ms behind, within that spread;
# drafting is far behind. Request 1: joint:2 is the oracle (119, range 118-125); spec:2 is 1 ms behind.
REQ0 = ({(0, 0): [100, 102, 98], (1, 0): [101, 99, 103], (0, 2): [150, 148, 152], (1, 2): [149, 151, 150]},
        [(1, 0), (0, 0), (1, 2)], [101, 100, 150])
REQ1 = ({(0, 0): [200, 210, 190], (1, 0): [205, 195, 215], (0, 2): [120, 121, 119], (1, 2): [119, 125, 118]},
        [(0, 2), (0, 2), (0, 2)], [121, 120, 122])


@pytest.mark.fast
def test_oracle_is_the_median_of_repeats_with_its_spread():
    rows, _ = build([REQ0])
    s = M.action_spreads(rows)[("w/P32/N8", 0)]
    assert s[(0, 0)] == M.Spread(100, 98, 102, 99, 101, 3)
    assert M.measured_actions(rows)[("w/P32/N8", 0)][(1, 2)] == 150
    assert M.min_repeats(rows) == 3


def test_strict_vs_within_spread_accuracy():
    rows, cands = build([REQ0, REQ1])
    q = M.controller_quality(cands, rows, AD)
    assert q["decisions"] == 6 and q["requests"] == 2 and q["denoised"] and q["repeats"] == 3
    # strict: only rep 1 of request 0 picked the oracle
    assert q["action_acc"] == pytest.approx(1 / 6)
    # within spread: kv (101 <= 102) and spec:2 on request 1 (120 <= 125) count too; joint:2 on request 0 does not
    assert q["action_acc_spread"] == pytest.approx(5 / 6)
    assert q["k_acc"] == pytest.approx(5 / 6) and q["k_acc_spread"] == pytest.approx(5 / 6)
    assert q["spec_acc"] == pytest.approx(5 / 6)
    assert q["mape"] == 0 and q["spearman"] == pytest.approx(1.0)
    assert q["consistency"] == pytest.approx(0.5)           # request 1: the same choice every repeat
    # action regret: request 0 (1/100 + 0 + 50/100) / 3, request 1 1/119; own: median own vs oracle median
    assert q["regret"] == pytest.approx(((0.01 + 0 + 0.5) / 3 + 1 / 119) / 2)
    assert q["realized"] == pytest.approx(((101 - 100) / 100 + (121 - 119) / 119) / 2)
    lo, hi = q["regret_ci"]
    assert lo <= q["regret"] <= hi


def test_within_spread_is_the_oracles_own_range():
    o = M.Spread(100, 98, 102, 99, 101, 3)
    assert M.indistinguishable(M.Spread(102, 101, 110, 101, 105, 3), o)
    assert not M.indistinguishable(M.Spread(102.5, 90, 110, 95, 105, 3), o)      # overlapping range is not enough
    assert not M.indistinguishable(None, o)
    one = M.Spread(100, 100, 100, 100, 100, 1)
    assert M.indistinguishable(M.Spread(100, 100, 100, 100, 100, 1), one)           # a tie
    assert not M.indistinguishable(M.Spread(100.1, 100.1, 100.1, 100.1, 100.1, 1), one)


def test_binary_k_accuracy_is_the_papers_question():
    """Choosing k=4 when k=2 is best is a wrong k but the right binary answer (speculate); choosing
    k=0 there is wrong on both."""
    meas = {(0, 0): [200, 200, 200], (0, 2): [100, 101, 99], (0, 4): [130, 131, 129]}
    rows, cands = build([(meas, [(0, 4), (0, 4), (0, 0)], [130, 130, 200])])
    q = M.controller_quality(cands, rows, AD)
    assert q["k_acc"] == 0 and q["k_acc_spread"] == 0
    assert q["spec_acc"] == pytest.approx(2 / 3)
    # within spread, the binary question asks whether the best action of the chosen class is as good
    # as the oracle: speculating (best: k=2) is, not speculating is not
    assert q["spec_acc_spread"] == pytest.approx(2 / 3)


def test_regret_bootstrap_ci_contains_the_true_value():
    rng = random.Random(7)
    true = 0.05
    reqs = []
    for _ in range(80):
        base = rng.uniform(80, 300)
        reg = rng.expovariate(1 / true)                                      # per-request regret, mean 0.05
        meas = {(0, 0): [base * (1 + rng.gauss(0, 0.005)) for _ in range(3)],
                (1, 0): [base * 1.5 for _ in range(3)]}
        reqs.append((meas, [(0, 0)] * 3, [M.median(meas[(0, 0)]) * (1 + reg)] * 3))
    rows, cands = build(reqs)
    q = M.controller_quality(cands, rows, AD)
    lo, hi = q["realized_ci"]
    assert lo < true < hi and lo < q["realized"] < hi and hi - lo < 0.05
    assert q["regret"] == 0 and q["regret_ci"] == (0.0, 0.0) and q["action_acc"] == 1
    assert M.bootstrap_ci([0.1, 0.3], seed=1) == M.bootstrap_ci([0.1, 0.3], seed=1)   # seeded


def test_held_out_regret_is_not_faked_by_ties():
    """Seven actions that cost the same but for noise: a controller that always takes one of them
    shows a positive plain regret (the minimum of noisy medians is biased low), but a held-out
    regret near 0; a truly worse choice shows in both. The measurements' own Spearman ceiling is
    low where nothing separates the actions and high where they differ."""
    rng = random.Random(3)
    acts = [(0, 0), (1, 0), (0, 2), (1, 1), (1, 2), (1, 4), (1, 8)]
    ties, worse = [], []
    for _ in range(60):
        base = rng.uniform(100, 300)
        meas = {a: [base * (1 + rng.gauss(0, 0.03)) for _ in range(3)] for a in acts}
        ties.append((meas, [(1, 0)] * 3, meas[(1, 0)]))
        spread = {a: [base * (1 + 0.2 * i) * (1 + rng.gauss(0, 0.03)) for _ in range(3)] for i, a in enumerate(acts)}
        worse.append((spread, [(0, 2)] * 3, spread[(0, 2)]))          # 40% behind the oracle (0, 0)
    q = M.controller_quality(*reversed(build(ties)), AD)
    assert q["regret"] > 0.015                     # biased: the oracle is a minimum over noise
    lo, hi = q["regret_ho_ci"]
    assert lo < 0 < hi and abs(q["regret_ho"]) < 0.01
    assert abs(q["realized_ho"] - q["regret_ho"]) < 1e-9     # own executions = the chosen action's here
    assert abs(q["spearman_ceiling"]) < 0.3
    assert abs(q["best_fixed_regret_ho"]) < 0.01
    q = M.controller_quality(*reversed(build(worse)), AD)
    assert q["regret_ho"] == pytest.approx(0.4, abs=0.03) and q["regret"] == pytest.approx(0.4, abs=0.03)
    assert q["spearman_ceiling"] > 0.9
    assert q["best_fixed_action"] == (0, 0) and abs(q["best_fixed_regret_ho"]) < 0.01


def test_single_repeat_is_labelled_not_denoised(tmp_path):
    rows, cands = build([({(0, 0): [100], (1, 0): [90], (0, 2): [50]}, [(0, 2)], [55])])
    q = M.controller_quality(cands, rows, AD)
    assert not q["denoised"] and q["repeats"] == 1
    assert q["action_acc"] == 1 and q["realized"] == pytest.approx(0.1)
    text = write(tmp_path, rows, cands)
    assert "Oracle not de-noised" in text and "not de-noised (1)" in text
    assert "(not de-noised)" in text.split("Next to the paper's controller")[1]


def write(tmp, rows, cands, meta=None):
    from rakv.bench.runner import CAND_COLUMNS, EXEC_COLUMNS

    for fn, cols, data in (("executions.csv", EXEC_COLUMNS, rows), ("candidates.csv", CAND_COLUMNS, cands)):
        with open(tmp / fn, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
            w.writeheader()
            w.writerows([{k: ("" if v is None else v) for k, v in r.items()} for r in data])
    (tmp / "meta.json").write_text(json.dumps(meta or {"repeats": 1}))
    return R.write_summary(tmp).read_text()


def test_summary_renders_the_papers_table_per_regime(tmp_path):
    # workload "prose": k = 0 is best (no-pay); workload "copy": joint:4 is best (pays)
    rows, cands = [], []
    for wl, fast in (("prose", (1, 0)), ("copy", (1, 4))):
        reqs = []
        for i in range(3):
            meas = {a: [100.0 + i + j for j in range(3)] for a in ((0, 0), (1, 0), (0, 4), (1, 4))}
            meas[fast] = [60.0 + i + j for j in range(3)]
            reqs.append((meas, [fast] * 3, [61.0 + i] * 3))
        r, c = build(reqs, wl)
        rows += r
        cands += c
    reg = regime(CostProfile(t=[[128, 10.0]], d=[[128, 4.0]], V={"4": 14.0}, alpha0=0.6),
                 cpuinfo="flags\t: fpu sse4_2 avx avx2 fma avx512f avx512_vnni amx_tile\n")
    text = write(tmp_path, rows, cands, {"repeats": 3, "regime": reg})
    paper = text.split("Next to the paper's controller")[1].split("## Acceptance crossover")[0]
    for cell in ("paper (RAKV-ASD", "+0.45%", "-64%", "83.3%", "| 100% |", "32.1%", "0.780", "0.32%", "3,600 / 0",
                 "no-pay: prose", "pays: copy", "all workloads", "latency vs joint:4", "speculate or not",
                 "within spread"):
        assert cell in paper, cell
    assert "(not de-noised)" not in paper and "Oracle de-noised" in text
    assert "avx512_vnni amx_tile" in text and "t = 10.00 ms" in text and "V(k)/t = 4: 1.40" in text
    assert "prose alpha" in text and "does not pay (best kv)" in text and "copy alpha 0.500, pays (best joint:4)" in text
    best = text.split("Adaptive against the best fixed policy")[1]
    assert "| prose | no | kv" in best and "| copy | yes | joint:4" in best
    both = R.compare_md([tmp_path, tmp_path])        # runs side by side (python -m rakv.bench.report A B)
    assert "run 2" in both and both.count("no-pay: prose") == 2 and "83.3%" in both and "avx512_vnni" in both


@pytest.mark.fast
def test_regime_states_whether_speculation_can_pay():
    info = "processor\t: 0\nflags\t\t: fpu sse sse4_2 avx f16c avx2 fma\n"
    assert cpu_flags(info) == ["sse4_2", "avx", "avx2", "fma", "f16c"]
    assert cpu_flags("Features\t: fp asimd sve\n") == ["asimd", "sve"]
    # a slow draft (d/t = 0.6) and verify(2) = 2 steps: k=2 costs (1.2 + 2) / 3 = 1.07 t per token at alpha = 1
    slow = CostProfile(t=[[128, 80.0]], d=[[128, 48.0]], V={"1": 130.0, "2": 160.0}, alpha0=0.7, alpha_learned=0.4)
    r = regime(slow, cpuinfo=info)
    assert r["d_over_t"] == 0.6 and r["V_over_t"] == {"1": 1.625, "2": 2.0} and r["t_ms"] == 80.0
    assert not r["can_pay"] and r["alpha_star_decode"] == {"1": None, "2": None}
    assert r["alpha0"] == 0.7 and r["alpha_learned"] == 0.4 and r["isa"][:3] == ["sse4_2", "avx", "avx2"]
    assert any("cannot pay" in x for x in describe(r)) and not r["contended"]
    slow.quality = {"contended": True}
    assert "contended" in describe(regime(slow, cpuinfo=info))[-1]
    fast = CostProfile(t=[[128, 10.0]], d=[[128, 2.0]], V={"4": 12.0}, alpha0=0.6)
    r = regime(fast, cpuinfo="")
    assert r["can_pay"] and r["isa"] == []
    a = r["alpha_star_decode"]["4"]           # (4*2 + 12) / E_4(a) = 10  <=>  E_4(a) = 2
    assert (1 - a ** 5) / (1 - a) == pytest.approx(2.0, abs=1e-3)
    assert decode_crossover(10.0, 0.0, 9.0, 1) == 0.0
    # V(12), V(16) (measured for n-gram lookups only) are listed, but no drafting policy has that k
    lk = CostProfile(t=[[128, 10.0]], d=[[128, 2.0]], V={str(k): 10.0 + k for k in list(range(1, 9)) + [12, 16]})
    r = regime(lk, cpuinfo="")
    assert set(r["V_over_t"]) >= {"12", "16"} and set(r["alpha_star_decode"]) == {str(k) for k in range(1, 9)}


def test_a_one_token_request_is_left_out_of_the_accuracies():
    """A request whose output is one token runs no decoding round: every action is the same work, so
    the oracle there is whichever measured fastest by chance and no choice counts as right or wrong."""
    rows, cands = build([REQ0, REQ1])
    one = ({(0, 0): [50, 52, 51], (1, 0): [51, 50, 53], (0, 2): [49, 50, 48], (1, 2): [52, 51, 50]},
           [(1, 0), (1, 0), (1, 0)], [51, 51, 51])
    r1, c1 = build([one])
    for r in r1:
        r["index"], r["output_tokens"] = 2, 1
    for c in c1:
        c["index"] = 2
    q = M.controller_quality(cands + c1, rows + r1, AD)
    assert q["decisions"] == 9 and q["k_free"] == 3
    assert q["action_acc_spread"] == pytest.approx(5 / 6) and q["spec_acc"] == pytest.approx(5 / 6)


# ----------------------------------------------------------------------------- accept length with gate copies
def test_accept_len_counts_gate_copies_per_round(tmp_path):
    """accept len = 1 + (accepted + lookup_accepted) / rounds: a k = 0 execution whose gate copied 10
    tokens in 5 rounds made 3 tokens a round, not 1; the draft's own accepted tokens count as before;
    peers (no rounds) are left out; a row without counts keeps its mean_accept_len."""
    copies = {**row(0, 0, "adaptive:gate", 100), "rounds": 5, "accepted": 0, "drafted": 0,
              "lookup_drafted": 12, "lookup_accepted": 10, "mean_accept_len": 3.0}
    drafts = {**row(0, 1, "adaptive:gate", 100), "rounds": 4, "accepted": 4, "drafted": 8,
              "lookup_drafted": 0, "lookup_accepted": 0, "mean_accept_len": 2.0}
    both = {**row(0, 2, "adaptive:gate", 100), "rounds": 4, "accepted": 2, "lookup_accepted": 6}
    peer = {**row(0, 0, "hf:lookup", 100), "rounds": None, "accepted": None, "mean_accept_len": None}
    old = {k: v for k, v in row(0, 0, "kv", 100).items() if k != "accepted"} | {"rounds": 2, "mean_accept_len": 1.5}
    assert M.accept_len(copies) == 3.0 and M.accept_len(drafts) == 2.0 and M.accept_len(both) == 3.0
    assert M.accept_len(peer) is None and M.accept_len(old) == 1.5
    # an executions.csv written before copies were counted in mean_accept_len: the counts decide
    assert M.accept_len({**copies, "mean_accept_len": 1.0}) == 3.0
    t = {p["policy"]: p for p in M.policy_table([copies, drafts, both, peer, old])}
    assert t["adaptive:gate"]["accept_len"] == pytest.approx((3.0 + 2.0 + 3.0) / 3)
    assert t["hf:lookup"]["accept_len"] is None and t["kv"]["accept_len"] == 1.5
    # the copy columns are numbers when read back (an empty cell: no count)
    path = tmp_path / "executions.csv"
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(copies))
        w.writeheader()
        w.writerow(copies)
        w.writerow({**copies, "index": 3, "lookup_drafted": "", "lookup_accepted": ""})
    back = M.load_csv(path)
    assert back[0]["lookup_accepted"] == 10 and back[1]["lookup_accepted"] is None
    assert M.accept_len(back[0]) == 3.0 and M.accept_len(back[1]) == 1.0


def test_bench_rows_count_k0_copies_like_the_timing_csv():
    """Real records (the tiny pair, the model draft priced out so every request is k = 0, a repeat
    that copies its earlier output): the executions row's lookup columns and mean_accept_len agree
    with the timing CSV's copied / copies_accepted / mean_accept_len and with the rounds themselves."""
    from rakv.bench.runner import Arm, make_slots, run_engine
    from rakv.workloads import Request
    from rakv.config import RakvConfig
    from rakv.records import Round, request_rows
    from rakv.session import Session
    from tests.tiny import make_pair, synthetic_profile

    target, draft = make_pair("llama", "mostly")
    from rakv.drafts.model import ModelDraft

    (slot,) = make_slots([Arm("adaptive:gate", policy="adaptive:gate")],
                         Session(RakvConfig(k_set=(0, 2, 4)), target, ModelDraft(draft),
                                 synthetic_profile(d=5.0, alpha0=0.2)), learned={})
    recs = []
    collect = slot.engine.callback
    slot.engine.callback = lambda r: (recs.append(r), collect(r))
    ids = tuple([3, 4, 5, 6] * 6)
    req = Request(0, "w", "repeat", len(ids), 40, ids, "c0")
    run_engine(slot, req)
    row, _ = run_engine(slot, req)            # the repeat copies from the history
    looked = [r for r in slot.collector.rounds if r.draft_source == "lookup"]
    assert row["k"] == 0 and row["accepted"] == 0 and row["lookup_accepted"] == sum(r.accepted for r in looked) > 0
    assert all(r.k == 0 for r in looked if r.drafted)
    assert row["mean_accept_len"] == pytest.approx(1 + row["lookup_accepted"] / row["rounds"], abs=1e-4)
    assert row["mean_accept_len"] > 1.0
    csv_row = request_rows(recs)[-1]
    assert (csv_row["copied"], csv_row["copies_accepted"]) == (row["lookup_drafted"], row["lookup_accepted"])
    assert csv_row["mean_accept_len"] == row["mean_accept_len"]
    assert M.accept_len(row) == pytest.approx(row["mean_accept_len"], abs=1e-4)
    assert sum(isinstance(r, Round) for r in recs) > 0

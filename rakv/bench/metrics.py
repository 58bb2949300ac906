"""Metrics over the executions CSV (definitions are repeated in summary.md).

Accept length of an execution (``accept_len``): tokens per decoding round after the first token,
1 + (accepted + lookup_accepted) / rounds. ``accepted`` is the draft's own accepted tokens
(``RequestEnd.accepted``) and ``lookup_accepted`` the n-gram copies the confidence gate verified and
the target accepted, k = 0 rounds included (``rakv generate --json``: ``copies_accepted``): a k = 0
round that copies 5 tokens yields 6 tokens for its forward, as the explorer counts it. The summary's
*accept len* is its mean over the executions that ran rounds (computed from the counts, so an
executions.csv written before copies were counted in ``mean_accept_len`` gives the same figure).

Speedup of policy P vs a reference policy R: for every request (repeat, stream, index) that both
ran, latency_R / latency_P; the median of these paired ratios (> 1: P is faster).

Controller quality of an adaptive arm, per request, over the actions A = {(r, k)} that were both
predicted (feasible candidates of its per-request decision) and measured (the fixed policies
ar = (0,0), kv = (1,0), spec:k = (0,k), joint:k = (1,k) on the same request):
  oracle        argmin over A of the measured latency
  action acc.   share of requests where the chosen (r, k) == oracle
  k acc.        share where the chosen k == the oracle's k
  MAPE          mean over requests and a in A of |predicted(a) - measured(a)| / measured(a)
  MAPE full N   the same over the requests whose ar output ran to max_new_tokens (the controller
                predicts N tokens; an early EOS makes every action cheaper than predicted)
  Spearman      Spearman rank correlation of predicted vs measured over A, mean over requests
  regret        (measured(chosen) - measured(oracle)) / measured(oracle), mean over requests
  realized      (the adaptive arm's own latency - measured(oracle)) / measured(oracle), mean
                (per-round control can beat every fixed action: it can be negative)
  held-out      both regrets again with the oracle picked and judged on separate executions: for
                each repeat i, the oracle is the argmin of the other repeats' medians, and chosen,
                own and oracle are all read in repeat i (a minimum over noisy medians is biased
                low, so the plain regret of even a perfect controller is > 0 where actions tie)
  Spearman ceiling  the same rank correlation of one repeat's measurements against the other
                repeats' medians: how well the measurements rank the actions themselves
  best fixed    the held-out action regret of the single action that does best when taken on
                every request: the mark for a per-request choice made before seeing the request's
                acceptance
"""

from __future__ import annotations

import csv
import math
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

NUMERIC = {"rep", "index", "bucket", "gen", "prompt_tokens", "order", "latency_ms", "ttft_ms", "tokens_per_s",
           "output_tokens", "drafted", "accepted", "rounds", "mean_accept_len", "alpha_req", "hit_tokens",
           "exact_repeat", "reuse", "k", "mean_k", "predicted_ms", "match", "first_diff", "feasible", "chosen",
           "explore_ms", "cpu_share", "alpha_decided", "turn", "previous_tokens",
           "kept_tokens", "decode_tps", "peer_prompt_tokens", "peer_wall_ms", "text_match",
           "lookup_drafted", "lookup_accepted"}
REFS = ("ar", "kv", "joint:4")
MIN_REPEATS = 3          # executions of every action per request for a de-noised oracle


QUIET_SHARE = 0.8    # an execution whose main thread got less CPU than this share of its wall time was contended


def quiet_rows(rows: list[dict]) -> tuple[list[dict], int]:
    """Rows of the request positions (repeat, stream, index) where every execution had the CPU
    (cpu_share >= QUIET_SHARE; rows without the column count as quiet), and how many were dropped."""
    bad = {key(r) for r in rows if isinstance(r.get("cpu_share"), (int, float)) and r["cpu_share"] < QUIET_SHARE}
    return [r for r in rows if key(r) not in bad], len(bad)


def load_csv(path: Path) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as f:
        return [{k: _num(v) if k in NUMERIC else v for k, v in r.items()} for r in csv.DictReader(f)]


def _num(v: str):
    if v is None or v == "":
        return None
    try:
        x = float(v)
    except ValueError:
        return v
    return int(x) if x.is_integer() and "." not in v else x


def key(r: dict) -> tuple:
    return (r["rep"], r["cell"], r["index"])


def median(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def quantile(xs, q: float) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    i = q * (len(xs) - 1)
    lo, hi = math.floor(i), math.ceil(i)
    return xs[lo] + (xs[hi] - xs[lo]) * (i - lo)


def policies_in(rows: list[dict]) -> list[str]:
    seen = []
    for r in rows:
        if r["policy"] not in seen:
            seen.append(r["policy"])
    return seen


def latency_by_key(rows: list[dict], policy: str) -> dict:
    return {key(r): r["latency_ms"] for r in rows if r["policy"] == policy}


def paired_speedup(rows: list[dict], policy: str, ref: str) -> float | None:
    a, b = latency_by_key(rows, policy), latency_by_key(rows, ref)
    return median(b[k] / a[k] for k in a if k in b and a[k])


def accept_len(r: dict) -> float | None:
    """An execution's accept length, 1 + (accepted + lookup_accepted) / rounds (gate copies counted);
    None without rounds (peers). A row without an ``accepted`` count keeps its ``mean_accept_len``."""
    rounds = r.get("rounds")
    if not isinstance(rounds, (int, float)) or rounds <= 0:
        return None
    acc = r.get("accepted")
    if not isinstance(acc, (int, float)):
        v = r.get("mean_accept_len")
        return float(v) if isinstance(v, (int, float)) else None
    copies = r.get("lookup_accepted")
    return 1 + (acc + (copies if isinstance(copies, (int, float)) else 0)) / rounds


def policy_table(rows: list[dict]) -> list[dict]:
    """One row per policy: latency / throughput medians, acceptance, reuse, exactness, speedups."""
    out = []
    refs = [r for r in REFS if any(x["policy"] == r for x in rows)]
    for p in policies_in(rows):
        rs = [r for r in rows if r["policy"] == p]
        mal = [v for v in (accept_len(r) for r in rs) if v is not None]
        t = dict(policy=p, n=len(rs), latency_ms=median(r["latency_ms"] for r in rs),
                 p90_ms=quantile([r["latency_ms"] for r in rs], 0.9), ttft_ms=median(r["ttft_ms"] for r in rs),
                 tokens_per_s=median(r["tokens_per_s"] for r in rs),
                 accept_len=statistics.fmean(mal) if mal else None,
                 hit_rate=sum(1 for r in rs if r["hit_tokens"]) / len(rs),
                 mismatches=sum(1 for r in rs if not r["match"]))
        for ref in refs:
            t[f"vs_{ref}"] = paired_speedup(rows, p, ref)
        out.append(t)
    return out


# ----------------------------------------------------------------------------- controller quality
def spearman(x: list[float], y: list[float]) -> float | None:
    if len(x) < 2:
        return None
    rx, ry = _ranks(x), _ranks(y)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sx = math.sqrt(sum((a - mx) ** 2 for a in rx))
    sy = math.sqrt(sum((b - my) ** 2 for b in ry))
    return sxy / (sx * sy) if sx and sy else None


def _ranks(v: list[float]) -> list[float]:
    order = sorted(range(len(v)), key=lambda i: v[i])
    r = [0.0] * len(v)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
            j += 1
        for t in range(i, j + 1):
            r[order[t]] = (i + j) / 2
        i = j + 1
    return r


def request_key(r: dict) -> tuple:
    """The same request across repeats: its stream and position (every repeat replays the stream
    with fresh engines, so a fixed policy meets it in the same cache state)."""
    return (r["cell"], r["index"])


@dataclass(frozen=True)
class Spread:
    """Repeated measurements of one action on one request: median, min-max, IQR, count."""

    median: float
    lo: float
    hi: float
    q1: float
    q3: float
    n: int


def spread(xs) -> Spread | None:
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    return Spread(statistics.median(xs), min(xs), max(xs), quantile(xs, 0.25), quantile(xs, 0.75), len(xs))


def indistinguishable(a: Spread | None, oracle: Spread) -> bool:
    """The choice counts as right "within the measured spread" when its median cost is no worse
    than the oracle's slowest repeat (median(a) <= max(oracle)): a gap the oracle's own repeats
    already show is noise, not a wrong decision. With one execution per action it is a tie."""
    return a is not None and a.median <= oracle.hi


def by_repeat(rows: list[dict]) -> dict:
    """request key -> {(r, k): {repeat: latency}} from the fixed engine policies."""
    out: dict = defaultdict(lambda: defaultdict(dict))
    for r in rows:
        a = fixed_action(r["policy"])
        if a is not None and r["latency_ms"] is not None:
            out[request_key(r)][a][r["rep"]] = r["latency_ms"]
    return out


def measured_samples(rows: list[dict]) -> dict:
    """request key -> {(r, k): [latency of every repeat]} from the fixed engine policies."""
    return {rk: {a: list(by_rep.values()) for a, by_rep in acts.items()} for rk, acts in by_repeat(rows).items()}


def action_spreads(rows: list[dict]) -> dict:
    """request key -> {(r, k): Spread over the repeats} (the oracle's measurements)."""
    return {rk: {a: spread(xs) for a, xs in acts.items()} for rk, acts in measured_samples(rows).items()}


def measured_actions(rows: list[dict]) -> dict:
    """request key -> {(r, k): median measured latency over the repeats} from the fixed policies."""
    return {rk: {a: s.median for a, s in acts.items()} for rk, acts in action_spreads(rows).items()}


def fixed_action(name: str) -> tuple[int, int] | None:
    if name == "ar":
        return (0, 0)
    if name == "kv":
        return (1, 0)
    for prefix, r in (("spec:", 0), ("joint:", 1)):
        if name.startswith(prefix):
            return (r, int(name[len(prefix):]))
    return None


def min_repeats(rows: list[dict]) -> int:
    """The fewest executions of any fixed action on any request (the oracle's de-noising depth)."""
    ns = [len(xs) for acts in measured_samples(rows).values() for xs in acts.values()]
    return min(ns) if ns else 0


def _best_of(S: dict, A: list, pick) -> Spread | None:
    """The lowest-median measured action among those of A that ``pick`` selects."""
    sel = [S[a] for a in A if pick(a)]
    return min(sel, key=lambda s: s.median) if sel else None


def per_request_quality(cands: list[dict], rows: list[dict], policy: str) -> list[dict]:
    """For each decision of an adaptive arm (one per request and repeat): chosen, oracle, and
    predicted vs measured (median over repeats) over A = feasible candidates that were measured."""
    S_all = action_spreads(rows)
    own = latency_by_key(rows, policy)
    pred: dict = defaultdict(dict)
    chosen: dict = {}
    for c in cands:
        if c["policy"] != policy:
            continue
        kk, a = (c["rep"], c["cell"], c["index"]), (c["reuse"], c["k"])
        if c["feasible"]:
            pred[kk][a] = c["predicted_ms"]
        if c["chosen"]:
            chosen[kk] = a
    out = []
    for kk, p in pred.items():
        rk = kk[1:]
        S = S_all.get(rk, {})
        A = sorted(a for a in p if a in S)
        if len(A) < 2 or kk not in chosen:
            continue
        oracle = min(A, key=lambda a: S[a].median)
        ch, so = chosen[kk], S[oracle]
        sc = S.get(ch)
        same_k = _best_of(S, A, lambda a: a[1] == ch[1])
        same_spec = _best_of(S, A, lambda a: (a[1] > 0) == (ch[1] > 0))
        out.append(dict(
            key=kk, request=rk, actions=A, pred=[p[a] for a in A], meas=[S[a].median for a in A],
            spreads=[S[a] for a in A], chosen=ch, oracle=oracle, chosen_meas=None if sc is None else sc.median,
            oracle_meas=so.median, oracle_spread=so, own=own.get(kk),
            action_ok=ch == oracle, action_ok_spread=indistinguishable(sc, so),
            k_ok=ch[1] == oracle[1], k_ok_spread=indistinguishable(same_k, so),
            spec_ok=(ch[1] > 0) == (oracle[1] > 0), spec_ok_spread=indistinguishable(same_spec, so)))
    return out


def held_out(q: list[dict], rows: list[dict]) -> dict:
    """Regrets with the oracle chosen on the other repeats and judged on this one (see the module
    docstring), and the measurements' own Spearman ceiling; per request means, bootstrap CIs."""
    R = by_repeat(rows)
    reg: dict = defaultdict(list)
    own: dict = defaultdict(list)
    fixed: dict = defaultdict(lambda: defaultdict(list))     # action -> request -> its held-out regrets
    ceil = []
    for x in q:
        rep = x["key"][0]
        L = R.get(x["request"], {})
        A = [a for a in x["actions"] if rep in L.get(a, {}) and len(L[a]) > 1]
        if len(A) < 2:
            continue
        rest = {a: statistics.median(v for j, v in L[a].items() if j != rep) for a in A}
        o = min(A, key=rest.get)
        lo = L[o][rep]
        if x["chosen"] in A:
            reg[x["request"]].append((L[x["chosen"]][rep] - lo) / lo)
        for a in A:
            fixed[a][x["request"]].append((L[a][rep] - lo) / lo)
        if x["own"] is not None:         # the arm's own execution in this repeat
            own[x["request"]].append((x["own"] - lo) / lo)
        s = spearman([L[a][rep] for a in A], [rest[a] for a in A])
        if s is not None:
            ceil.append(s)
    rg = [statistics.fmean(v) for v in reg.values()]
    ow = [statistics.fmean(v) for v in own.values()]
    # the one action taken on every request that the regret was measured on, at its best: what a
    # per-request controller that cannot foresee a request's acceptance has to beat
    per_a = {a: [statistics.fmean(v[rq]) for rq in reg if rq in v] for a, v in fixed.items()}
    per_a = {a: statistics.fmean(v) for a, v in per_a.items() if v and len(v) == len(reg)}
    best_a = min(per_a, key=per_a.get) if per_a else None
    return dict(regret_ho=statistics.fmean(rg) if rg else None, regret_ho_ci=bootstrap_ci(rg),
                best_fixed_action=best_a, best_fixed_regret_ho=per_a.get(best_a),
                realized_ho=statistics.fmean(ow) if ow else None, realized_ho_ci=bootstrap_ci(ow),
                spearman_ceiling=statistics.fmean(ceil) if ceil else None)


def _ape(x: dict) -> float | None:
    """A decision's mean absolute percentage error over its measured actions."""
    e = [abs(p - m) / m for p, m in zip(x["pred"], x["meas"]) if m]
    return statistics.fmean(e) if e else None


_CI_OF = {        # the per-decision value behind each metric that gets a confidence interval
    "spec_acc": lambda x: float(x["spec_ok"]), "k_acc": lambda x: float(x["k_ok"]),
    "action_acc": lambda x: float(x["action_ok"]), "mape": _ape,
    "spearman": lambda x: spearman(x["pred"], x["meas"]),
}


def request_means(q: list[dict], value) -> list[float]:
    """``value`` of each decision, averaged within its request (its repeats): a request is the unit
    a confidence interval resamples, since its repeats' decisions are not independent."""
    by: dict = defaultdict(list)
    for x in q:
        v = value(x)
        if v is not None:
            by[x["request"]].append(v)
    return [statistics.fmean(v) for v in by.values()]


def bootstrap_ci(values: list[float], n: int = 2000, seed: int = 0, level: float = 0.95,
                 stat: str = "mean") -> tuple | None:
    """Percentile bootstrap CI of the mean, or the median (``stat``), resampling ``values`` with
    replacement (seeded)."""
    import numpy as np

    v = np.asarray([x for x in values if x is not None], dtype=float)
    if v.size == 0:
        return None
    if v.size == 1:
        return (float(v[0]), float(v[0]))
    rng = np.random.default_rng(seed)
    draws = v[rng.integers(0, v.size, size=(n, v.size))]
    stats = np.median(draws, axis=1) if stat == "median" else draws.mean(axis=1)
    a = (1 - level) / 2
    return float(np.quantile(stats, a)), float(np.quantile(stats, 1 - a))


def _by_request(q: list[dict]) -> dict:
    g: dict = defaultdict(list)
    for x in q:
        g[x["request"]].append(x)
    return g


def k_free_requests(rows: list[dict]) -> set:
    """Requests whose output is one token: no decoding round runs, so every action does the same
    work (prefill and the first token) and no choice of k can be right or wrong there."""
    outs: dict = defaultdict(set)
    for r in rows:
        if fixed_action(r["policy"]) is not None and r.get("output_tokens") is not None:
            outs[request_key(r)].add(int(r["output_tokens"]))
    return {rk for rk, n in outs.items() if max(n) <= 1}


def controller_quality(cands: list[dict], rows: list[dict], policy: str) -> dict | None:
    """Decision metrics of one adaptive arm against the repeated-measurement oracle.

    Accuracies are shares of decisions (one per request and repeat), leaving out the requests with
    a one-token output (``k_free_requests``: every action runs the same computation). Regrets are
    means over requests, with bootstrap 95% CIs over requests: ``realized`` takes the arm's own latency
    (median of its executions of the request), ``regret`` (action regret) the fixed policy's
    median for the chosen action; both relative to the oracle's median."""
    q = per_request_quality(cands, rows, policy)
    if not q:
        return None
    ape = [abs(p - m) / m for x in q for p, m in zip(x["pred"], x["meas"]) if m]
    full = {request_key(r) for r in rows if r["policy"] == "ar" and r["output_tokens"] == r["gen"]}
    ape_full = [abs(p - m) / m for x in q if x["request"] in full for p, m in zip(x["pred"], x["meas"]) if m]
    rho = [s for s in (spearman(x["pred"], x["meas"]) for x in q) if s is not None]
    reqs = _by_request(q)
    reg, reg_ms, real, same = [], [], [], []
    for xs in reqs.values():
        o = xs[0]["oracle_meas"]
        r = [(x["chosen_meas"] - x["oracle_meas"]) / x["oracle_meas"] for x in xs if x["chosen_meas"] is not None]
        if r:
            reg.append(statistics.fmean(r))
            reg_ms.append(statistics.fmean(x["chosen_meas"] - x["oracle_meas"] for x in xs
                                           if x["chosen_meas"] is not None))
        own = median(x["own"] for x in xs)
        if own is not None and o:
            real.append((own - o) / o)
        same.append(len({x["chosen"] for x in xs}) == 1)
    noise = [(x["oracle_spread"].hi - x["oracle_spread"].lo) / x["oracle_spread"].median for x in q
             if x["oracle_spread"].median]
    free = k_free_requests(rows)
    judged = [x for x in q if x["request"] not in free] or q
    acc = lambda f: statistics.fmean(bool(x[f]) for x in judged)   # noqa: E731
    reps = min(x["oracle_spread"].n for x in q)
    return dict(policy=policy, requests=len(reqs), decisions=len(q), k_free=len(q) - len(judged),
                actions=len(q[0]["actions"]),
                repeats=reps, denoised=reps >= MIN_REPEATS,
                action_acc=acc("action_ok"), action_acc_spread=acc("action_ok_spread"),
                k_acc=acc("k_ok"), k_acc_spread=acc("k_ok_spread"),
                spec_acc=acc("spec_ok"), spec_acc_spread=acc("spec_ok_spread"),
                mape=statistics.fmean(ape) if ape else None,
                mape_full=statistics.fmean(ape_full) if ape_full else None,
                spearman=statistics.fmean(rho) if rho else None,
                **{f"{name}_ci": bootstrap_ci(request_means(judged if name.endswith("acc") else q, f))
                   for name, f in _CI_OF.items()},
                regret=statistics.fmean(reg) if reg else None, regret_ci=bootstrap_ci(reg),
                regret_ms=statistics.fmean(reg_ms) if reg_ms else None,
                realized=statistics.fmean(real) if real else None, realized_ci=bootstrap_ci(real),
                consistency=statistics.fmean(same) if same else None,
                oracle_noise=median(noise),
                chosen_counts=_counts(x["chosen"] for x in q), oracle_counts=_counts(x["oracle"] for x in q),
                **held_out(q, rows))


def _counts(actions) -> str:
    c: dict = defaultdict(int)
    for a in actions:
        c[a] += 1
    return ", ".join(f"({r},{k}): {n}" for (r, k), n in sorted(c.items()))


# ----------------------------------------------------------------------------- acceptance crossover
def speedup_points(rows: list[dict]) -> dict[int, list[tuple[float, float]]]:
    """k -> [(alpha of the request, latency_ar / latency_spec:k)] for the no-reuse spec:k arms, one
    point per request: medians over its repeats (de-noised; greedy output, hence alpha, is the
    same in every repeat)."""
    ar = {rk: s.median for rk, acts in action_spreads(rows).items() for a, s in acts.items() if a == (0, 0)}
    lat: dict = defaultdict(list)
    alpha: dict = defaultdict(list)
    for r in rows:
        a = fixed_action(r["policy"])
        if a and a[0] == 0 and a[1] > 0 and r["alpha_req"] is not None and r["latency_ms"]:
            lat[(a[1], request_key(r))].append(r["latency_ms"])
            alpha[(a[1], request_key(r))].append(r["alpha_req"])
    out: dict = defaultdict(list)
    for (k, rk), xs in lat.items():
        if rk in ar:
            out[k].append((median(alpha[(k, rk)]), ar[rk] / median(xs)))
    return dict(sorted(out.items()))


def empirical_crossover(points: list[tuple[float, float]]) -> float | None:
    """The alpha threshold that best separates speedup > 1 from speedup <= 1 (fewest errors)."""
    if len(points) < 3:
        return None
    pts = sorted(points)
    best, best_err = None, None
    for i in range(len(pts) + 1):
        thr = pts[i][0] if i < len(pts) else pts[-1][0] + 1e-9
        err = sum(1 for a, s in pts if (a >= thr) != (s > 1.0))
        if best_err is None or err < best_err:
            best, best_err = thr, err
    return None if best is None or best > 1.0 else best


def predicted_crossover(profile, ks, P: float, N: float, draft_model: bool) -> dict[int, float | None]:
    """alpha*(k) from the cost model at a typical request (no reuse)."""
    from rakv.decide.controller import Controller, Situation

    ctl = Controller(profile, tuple(sorted({0, *ks})))
    s = Situation(P=int(P), N=int(N), has_draft=True, draft_model=draft_model)
    return {k: ctl.request_alpha_star(s, 0, k) for k in ks}


# ----------------------------------------------------------------------------- regimes
def workload_alpha(rows: list[dict]) -> dict[str, float | None]:
    """workload -> mean per-request acceptance alpha over the fixed drafting policies' executions
    (spec:k and joint:k), the measured alpha of the workload on this pair."""
    out: dict = {}
    for w in sorted({r["workload"] for r in rows}):
        xs = [r["alpha_req"] for r in rows if r["workload"] == w and r["alpha_req"] is not None
              and (fixed_action(r["policy"]) or (0, 0))[1] > 0]
        out[w] = statistics.fmean(xs) if xs else None
    return out


def best_fixed(rows: list[dict]) -> str | None:
    """The fixed policy with the lowest total latency over ``rows`` (what serving them costs)."""
    tot: dict = defaultdict(float)
    for r in rows:
        if fixed_action(r["policy"]) is not None and r["latency_ms"] is not None:
            tot[r["policy"]] += r["latency_ms"]
    return min(tot, key=lambda p: tot[p]) if tot else None


def speculation_pays(rows: list[dict]) -> dict[str, bool | None]:
    """workload -> does speculation pay there (the best fixed policy by total latency has k > 0)?"""
    out = {}
    for w in sorted({r["workload"] for r in rows}):
        b = best_fixed([r for r in rows if r["workload"] == w])
        out[w] = None if b is None else fixed_action(b)[1] > 0
    return out


def total_vs(rows: list[dict], policy: str, ref: str) -> dict | None:
    """Total latency and throughput of ``policy`` against ``ref`` over the executions both ran
    (same request and repeat): latency = sum(policy) / sum(ref) - 1 (< 0: policy is faster);
    throughput = (tokens / s of policy) / (tokens / s of ref) - 1 (> 0: policy is faster)."""
    a = {key(r): r for r in rows if r["policy"] == policy}
    b = {key(r): r for r in rows if r["policy"] == ref}
    ks = [k for k in a if k in b]
    if not ks:
        return None
    la, lb = sum(a[k]["latency_ms"] for k in ks), sum(b[k]["latency_ms"] for k in ks)
    na, nb = sum(a[k]["output_tokens"] or 0 for k in ks), sum(b[k]["output_tokens"] or 0 for k in ks)
    tp = (na / la) / (nb / lb) - 1 if la and lb and nb else None
    return dict(latency=la / lb - 1 if lb else None, throughput=tp, n=len(ks))

"""Metrics over the executions CSV (definitions are repeated in summary.md).

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
"""

from __future__ import annotations

import csv
import math
import statistics
from collections import defaultdict
from pathlib import Path

NUMERIC = {"rep", "index", "bucket", "gen", "prompt_tokens", "order", "latency_ms", "ttft_ms", "tokens_per_s",
           "output_tokens", "drafted", "accepted", "rounds", "mean_accept_len", "alpha_req", "hit_tokens",
           "exact_repeat", "reuse", "k", "mean_k", "predicted_ms", "match", "first_diff", "feasible", "chosen"}
REFS = ("ar", "kv", "joint:4")


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


def policy_table(rows: list[dict]) -> list[dict]:
    """One row per policy: latency / throughput medians, acceptance, reuse, exactness, speedups."""
    out = []
    refs = [r for r in REFS if any(x["policy"] == r for x in rows)]
    for p in policies_in(rows):
        rs = [r for r in rows if r["policy"] == p]
        mal = [r["mean_accept_len"] for r in rs if r["rounds"]]
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


def measured_actions(rows: list[dict]) -> dict:
    """request key -> {(r, k): measured latency} from the fixed engine policies."""
    out: dict = defaultdict(dict)
    for r in rows:
        a = fixed_action(r["policy"])
        if a is not None:
            out[key(r)][a] = r["latency_ms"]
    return out


def fixed_action(name: str) -> tuple[int, int] | None:
    if name == "ar":
        return (0, 0)
    if name == "kv":
        return (1, 0)
    for prefix, r in (("spec:", 0), ("joint:", 1)):
        if name.startswith(prefix):
            return (r, int(name[len(prefix):]))
    return None


def per_request_quality(cands: list[dict], rows: list[dict], policy: str) -> list[dict]:
    """For each request of an adaptive arm: chosen, oracle, and predicted vs measured over A."""
    meas = measured_actions(rows)
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
        m = meas.get(kk, {})
        A = sorted(a for a in p if a in m)
        if len(A) < 2 or kk not in chosen:
            continue
        oracle = min(A, key=lambda a: m[a])
        ch = chosen[kk]
        out.append(dict(key=kk, actions=A, pred=[p[a] for a in A], meas=[m[a] for a in A], chosen=ch,
                        oracle=oracle, chosen_meas=m.get(ch), oracle_meas=m[oracle], own=own.get(kk)))
    return out


def controller_quality(cands: list[dict], rows: list[dict], policy: str) -> dict | None:
    q = per_request_quality(cands, rows, policy)
    if not q:
        return None
    ape = [abs(p - m) / m for x in q for p, m in zip(x["pred"], x["meas"]) if m]
    full = {key(r) for r in rows if r["policy"] == "ar" and r["output_tokens"] == r["gen"]}
    ape_full = [abs(p - m) / m for x in q if x["key"] in full for p, m in zip(x["pred"], x["meas"]) if m]
    rho = [s for s in (spearman(x["pred"], x["meas"]) for x in q) if s is not None]
    reg = [(x["chosen_meas"] - x["oracle_meas"]) / x["oracle_meas"] for x in q if x["chosen_meas"] is not None]
    real = [(x["own"] - x["oracle_meas"]) / x["oracle_meas"] for x in q if x["own"] is not None]
    return dict(policy=policy, requests=len(q), actions=len(q[0]["actions"]),
                action_acc=statistics.fmean(x["chosen"] == x["oracle"] for x in q),
                k_acc=statistics.fmean(x["chosen"][1] == x["oracle"][1] for x in q),
                mape=statistics.fmean(ape) if ape else None,
                mape_full=statistics.fmean(ape_full) if ape_full else None,
                spearman=statistics.fmean(rho) if rho else None,
                regret=statistics.fmean(reg) if reg else None,
                regret_ms=statistics.fmean(x["chosen_meas"] - x["oracle_meas"] for x in q if x["chosen_meas"] is not None)
                if reg else None,
                realized=statistics.fmean(real) if real else None,
                chosen_counts=_counts(x["chosen"] for x in q), oracle_counts=_counts(x["oracle"] for x in q))


def _counts(actions) -> str:
    c: dict = defaultdict(int)
    for a in actions:
        c[a] += 1
    return ", ".join(f"({r},{k}): {n}" for (r, k), n in sorted(c.items()))


# ----------------------------------------------------------------------------- acceptance crossover
def speedup_points(rows: list[dict]) -> dict[int, list[tuple[float, float]]]:
    """k -> [(alpha of the request, latency_ar / latency_spec:k)] for the no-reuse spec:k arms."""
    ar = latency_by_key(rows, "ar")
    out: dict = defaultdict(list)
    for r in rows:
        a = fixed_action(r["policy"])
        if a and a[0] == 0 and a[1] > 0 and r["alpha_req"] is not None and key(r) in ar and r["latency_ms"]:
            out[a[1]].append((r["alpha_req"], ar[key(r)] / r["latency_ms"]))
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
    from rakv.controller import Controller, Situation

    ctl = Controller(profile, tuple(sorted({0, *ks})))
    s = Situation(P=int(P), N=int(N), has_draft=True, draft_model=draft_model)
    return {k: ctl.alpha_star(s, 0, k) for k in ks}

"""What-if for the per-request decision rules, on recorded bench runs: each decision of
adaptive:nogate is taken again from its recorded candidate predictions (candidates.csv) under rule
variants (the spec margin; the near-tie rule, since dropped, that preferred the smaller of
drafting k predicted within 2%) and scored against the fixed policies' measurements, plainly and
held out (rakv.bench.metrics). The controller's state is not replayed (another choice would have
taught it another alpha), so this ranks rules; a rerun of the bench confirms a change.

    python scripts/replay_rules.py out/s9b-int8 out/s8-grid-int8 ...
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

from rakv.bench import metrics as M
from rakv.decide.policy import REUSE_TIE

VARIANTS = {                        # name -> (near-tie share for the smaller k, spec margin)
    "old: k tie 2%, margin 5%": (0.02, 0.05),
    "no k tie, margin 5%": (0.0, 0.05),
    "k tie 2%, no margin": (0.02, 0.0),
    "no k tie, no margin": (0.0, 0.0),
    "k tie 2%, margin 2%": (0.02, 0.02),
    "now: no k tie, margin 2%": (0.0, 0.02),
}


def reuse_tie(best: dict, pool: list[dict]) -> dict:
    """r = 1 takes a REUSE_TIE near-tie with an r = 0 choice, among ``pool``."""
    if best["reuse"] == 1:
        return best
    alt = [c for c in pool if c["reuse"] == 1 and c["predicted_ms"] <= best["predicted_ms"] * (1 + REUSE_TIE)]
    return min(alt, key=lambda c: c["predicted_ms"]) if alt else best


def decide(cands: list[dict], k_tie: float, margin: float) -> tuple[int, int]:
    """The controller's per-request rule (rakv.decide.controller.Controller.decide) on recorded predictions."""
    feas = [c for c in cands if c["feasible"]]
    cost = lambda c: c["predicted_ms"]  # noqa: E731
    best = reuse_tie(min(feas, key=cost), feas)
    if best["k"] > 0 and k_tie > 0:
        near = [c for c in feas if c["reuse"] == best["reuse"] and c["k"] > 0 and cost(c) <= cost(best) * (1 + k_tie)]
        best = min(near, key=lambda c: (c["k"], cost(c)))
    plain = [c for c in feas if c["k"] == 0]
    if best["k"] > 0 and plain:
        b0 = min(plain, key=cost)
        best = best if cost(best) < cost(b0) * (1 - margin) else b0
        best = reuse_tie(best, plain)      # the reuse near-tie holds after the margin too 
    return best["reuse"], best["k"]


def replay(d: Path, policy: str, k_tie: float, margin: float) -> dict | None:
    rows, cands = M.load_csv(d / "executions.csv"), M.load_csv(d / "candidates.csv")
    by: dict = defaultdict(list)
    for c in cands:
        if c["policy"] == policy:
            by[(c["rep"], c["cell"], c["index"])].append(c)
    new, same = [], 0
    for cs in by.values():
        a = decide(cs, k_tie, margin)
        same += a == next(((c["reuse"], c["k"]) for c in cs if c["chosen"]), None)
        new += [dict(c, policy="replay", chosen=int((c["reuse"], c["k"]) == a)) for c in cs]
    own = [dict(r, policy="replay") for r in rows if r["policy"] == policy]
    q = M.controller_quality(new, rows + own, "replay")
    if q is not None:
        q["same"] = same / len(by)
    return q


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+", help="bench output directories (executions.csv + candidates.csv)")
    ap.add_argument("--policy", default="adaptive:nogate")
    a = ap.parse_args()
    print("| run | rule | action regret | held-out | speculate? | same choice as recorded |")
    print("|---|---|---|---|---|---|")
    for run in a.runs:
        for name, (k_tie, margin) in VARIANTS.items():
            q = replay(Path(run), a.policy, k_tie, margin)
            if q is None:
                continue
            print(f"| {Path(run).name} | {name} | {q['regret'] * 100:.2f}% | {q['regret_ho'] * 100:.2f}% | "
                  f"{q['spec_acc'] * 100:.1f}% | {q['same'] * 100:.0f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How well does each acceptance estimate predict a request's next round? From recordings.

    python scripts/acceptance_ahead.py RECORD.jsonl [RECORD.jsonl ...]

Reads every model-drafted round (drafted > 0, a draft model's: not n-gram copies) of every request
in the recordings (``rakv serve --record`` / ``rakv generate --record``), in order, and scores each
estimate by the log-likelihood it gave the round's outcome before seeing it (the geometric model the
decision uses: ``accepted = j`` of ``drafted = k`` has probability alpha^j (1 - alpha), or alpha^k
when all k were accepted), per round; higher is better. Estimates, each starting a request at the
recordings' pooled rate (a stand-in for the request-level rate ``alpha_req``, in-sample):

- "ewma LAM": the round EWMA the controller keeps (``learned.AlphaEWMA``; the engine's LAM is 0.3),
- "so far + P": the request's own trials so far plus P pseudo-trials at the pooled rate
  (``Acceptance.alpha_ahead``, P = AHEAD_PRIOR),
- "constant": the pooled rate, never updated.

The gap between them says whether acceptance within a request moves faster than its noise.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rakv.decide.learned import AHEAD_PRIOR, AlphaEWMA  # noqa: E402
from rakv.util.acceptance import trials  # noqa: E402


def requests_of(paths: list[str]) -> list[list[tuple[int, int]]]:
    """Each request's model-drafted rounds, (drafted, accepted), in order."""
    seqs = []
    for path in paths:
        by = defaultdict(list)
        model = True
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                if r.get("type") == "header":
                    model = bool((r.get("draft") or {}).get("has_model", True))
                if not model or r.get("type") != "round" or r.get("kind") == "prefill" or not r.get("drafted"):
                    continue
                if r.get("draft_source") == "lookup":
                    continue                      # (an n-gram copy: its acceptance is not the draft's)
                by[r["request_id"]].append((int(r["drafted"]), int(r["accepted"])))
        seqs += list(by.values())
    return seqs


def loglik(a: float, k: int, j: int) -> float:
    a = min(max(a, 0.02), 0.995)
    return j * math.log(a) + (math.log(1 - a) if j < k else 0.0)


def score(seqs, pooled: float, estimate) -> float:
    """Mean log-likelihood per round of ``estimate(state) -> alpha``, state updated by each round."""
    total, n = 0.0, 0
    for s in seqs:
        st = estimate.start(pooled)
        for k, j in s:
            total += loglik(estimate.value(st), k, j)
            n += 1
            st = estimate.update(st, k, j)
    return total / max(1, n)


class Ewma:
    """The controller's round EWMA itself (``learned.AlphaEWMA``) at weight ``lam``."""

    def __init__(self, lam: float):
        self.lam, self.name = lam, f"ewma {lam}"

    def start(self, a):
        return AlphaEWMA(a, self.lam)

    def value(self, st):
        return st.value

    def update(self, st, k, j):
        st.update(j, k)
        return st


class SoFar:
    def __init__(self, prior: float):
        self.P, self.name = prior, f"so far + {prior:g}"

    def start(self, a):
        return (0.0, 0.0, a)

    def value(self, st):
        return (st[0] + self.P * st[2]) / (st[1] + self.P)

    def update(self, st, k, j):
        return (st[0] + j, st[1] + trials(j, k), st[2])


class Constant:
    name = "constant"

    def start(self, a):
        return a

    def value(self, st):
        return st

    def update(self, st, k, j):
        return st


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("records", nargs="+")
    args = ap.parse_args()
    try:
        seqs = requests_of(args.records)
    except (OSError, ValueError, KeyError) as e:
        print(f"acceptance_ahead: cannot read the recordings: {e}", file=sys.stderr)
        return 2
    rounds = sum(map(len, seqs))
    if not rounds:
        print("acceptance_ahead: no model-drafted rounds in these recordings", file=sys.stderr)
        return 2
    acc = sum(j for s in seqs for _, j in s)
    pooled = acc / sum(trials(j, k) for s in seqs for k, j in s)
    print(f"{len(seqs)} requests, {rounds} model-drafted rounds, pooled acceptance {pooled:.3f}")
    print("| estimate | log-likelihood per round |\n|---|---|")
    for est in [Ewma(0.5), Ewma(0.3), Ewma(0.1), Ewma(0.05), SoFar(10), SoFar(AHEAD_PRIOR), SoFar(80), Constant()]:
        print(f"| {est.name} | {score(seqs, pooled, est):.4f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

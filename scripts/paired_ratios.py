"""Paired latency ratios of a bench run, with bootstrap confidence intervals.

    python scripts/paired_ratios.py out/s7-layers6 kv joint:0 adaptive:nogate adaptive:gate

For every request position (repeat, cell, index) of ``executions.csv``: latency(BASE) / latency(ARM)
(> 1: ARM is faster), the median over positions with a 95% bootstrap interval (2,000 resamples),
overall and per workload, beside the total-latency ratio. An A/A arm (``joint:0`` against ``kv``:
the same action) shows what noise alone gives on this machine in the same run.
"""

from __future__ import annotations

import csv
import random
import statistics as st
import sys
from collections import Counter, defaultdict
from pathlib import Path


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    run, base, arms = Path(argv[0]), argv[1], argv[2:]
    rows = list(csv.DictReader(open(run / "executions.csv")))
    by = defaultdict(dict)
    for r in rows:
        by[(r["rep"], r["cell"], r["index"])][r["policy"]] = r
    total = Counter()
    for r in rows:
        total[(r["workload"], r["policy"])] += float(r["latency_ms"]) / 1e3
    workloads = (None,) + tuple(sorted({r["workload"] for r in rows}))
    print(f"| arm | workload | n | paired median {base}/arm [95% CI] | total {base} s | total arm s | total ratio |")
    print("|---|---|---|---|---|---|---|")
    for a in arms:
        for w in workloads:
            xs = [float(v[base]["latency_ms"]) / float(v[a]["latency_ms"]) for v in by.values()
                  if a in v and base in v and (w is None or v[a]["workload"] == w)]
            if not xs:
                continue
            rng = random.Random(0)
            bs = sorted(st.median(rng.choices(xs, k=len(xs))) for _ in range(2000))

            def tot(p):
                return sum(x for (ww, pp), x in total.items() if pp == p and (w is None or ww == w))
            print(f"| {a} | {w or 'all'} | {len(xs)} | {st.median(xs):.3f} [{bs[50]:.3f}, {bs[1950]:.3f}] | "
                  f"{tot(base):.1f} | {tot(a):.1f} | {tot(base) / tot(a):.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

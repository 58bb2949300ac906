"""Total latency per stream of a bench run against the best fixed policy of that stream.

    python scripts/stream_totals.py out/s8-grid-int8 [adaptive:nogate adaptive:gate]

A stream is the first part of ``cell`` (chat, wikitext, humaneval, repetitive, mixed, ...): the
mixed streams get their own row here, where the bench summary files mixed requests under their
source workloads. Fixed policies are ar, kv, spec:K and joint:K. Prints a markdown table.
"""

from __future__ import annotations

import csv
import sys
from collections import defaultdict
from pathlib import Path


def is_fixed(policy: str) -> bool:
    return policy in ("ar", "kv") or policy.startswith(("spec:", "joint:"))


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    run, arms = Path(argv[0]), argv[1:] or ["adaptive:nogate", "adaptive:gate"]
    tot: dict = defaultdict(lambda: defaultdict(float))
    for r in csv.DictReader(open(run / "executions.csv")):
        s = float(r["latency_ms"]) / 1e3
        tot[r["cell"].split("/")[0]][r["policy"]] += s
        tot["all"][r["policy"]] += s
    print("| stream | best fixed | " + " | ".join(arms) + " | kv |")
    print("|---|---|" + "---|" * len(arms) + "---|")
    for name in ["all"] + sorted(k for k in tot if k != "all"):
        t = tot[name]
        best, who = min((v, p) for p, v in t.items() if is_fixed(p))
        cells = [f"{t[a]:.1f} s ({t[a] / best:.3f}x)" if a in t else "-" for a in arms]
        print(f"| {name} | {who} {best:.1f} s | " + " | ".join(cells) + f" | {t['kv']:.1f} s ({t['kv'] / best:.3f}x) |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

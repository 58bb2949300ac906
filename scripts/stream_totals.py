"""Total latency per stream of a bench run against the best fixed policy of that stream.

    python scripts/stream_totals.py out/s8-grid-int8 [adaptive:nogate adaptive:gate]

A stream is the first part of ``cell`` (chat, wikitext, humaneval, repetitive, mixed, ...): the
mixed streams get their own row here, where the bench summary files mixed requests under their
source workloads. Fixed policies are ar, kv, spec:K and joint:K. Prints three markdown tables.

The first takes the best fixed policy as the one with the least total over all repeats: the
target's definition, but the minimum of several noisy totals is biased low (it is picked on the
same noise it is then compared with). The second picks it out of sample: for each repeat, the
fixed policy with the least total over the other repeats, timed on that repeat. Its last column,
in-sample best / out-of-sample best, is that selection bias measured (1.000 = none).

The third table times each adaptive execution against the fixed policy that took the same action
(r, k) on the same request in the same repeat: where both did the same work (the same cache hit,
drafted and accepted tokens and rounds), own / same-action is the controller's overhead plus the
noise between two executions of identical work.
"""

from __future__ import annotations

import csv
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rakv.bench.metrics import fixed_action  # noqa: E402


def is_fixed(policy: str) -> bool:
    return fixed_action(policy) is not None


def held_out_best(per_rep: dict) -> tuple[float, list[str]]:
    """per_rep: policy -> {rep: seconds}. Each repeat's fixed policy picked on the other repeats."""
    fixed = [p for p in per_rep if is_fixed(p)]
    reps = sorted(set().union(*(per_rep[p].keys() for p in fixed)))
    if len(reps) < 2:
        return float("nan"), []
    total, picks = 0.0, []
    for i in reps:
        pick = min(fixed, key=lambda p: sum(v for j, v in per_rep[p].items() if j != i))
        total += per_rep[pick].get(i, 0.0)
        picks.append(pick)
    return total, picks


WORK = ("hit_tokens", "drafted", "accepted", "rounds", "output_tokens")


def fixed_policy(reuse: int, k: int) -> str:
    """The fixed policy named for the action (r, k) (``fixed_action``'s inverse; kv, not joint:0)."""
    return ("kv" if reuse else "ar") if k == 0 else (f"joint:{k}" if reuse else f"spec:{k}")


def same_action(rows: list[dict], arms: list[str]) -> dict:
    """(stream, arm) -> [own s, same-action s, executions matched, of them identical work]."""
    by_req: dict = defaultdict(dict)
    for r in rows:
        by_req[(r["cell"], r["index"], r.get("rep") or "0")][r["policy"]] = r
    out: dict = defaultdict(lambda: [0.0, 0.0, 0, 0])
    for pols in by_req.values():
        for arm in arms:
            a = pols.get(arm)
            if a is None or not a.get("k", "").isdigit():
                continue
            f = pols.get(fixed_policy(int(a.get("reuse") or 0), int(a["k"])))
            if f is None:
                continue
            for key in ((a["cell"].split("/")[0], arm), ("all", arm)):
                o = out[key]
                o[0] += float(a["latency_ms"]) / 1e3
                o[1] += float(f["latency_ms"]) / 1e3
                o[2] += 1
                o[3] += all(a.get(w) == f.get(w) for w in WORK)
    return out


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    run, arms = Path(argv[0]), argv[1:] or ["adaptive:nogate", "adaptive:gate"]
    per_rep: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(float)))
    rows = list(csv.DictReader(open(run / "executions.csv")))
    for r in rows:
        s = float(r["latency_ms"]) / 1e3
        for stream in (r["cell"].split("/")[0], "all"):
            per_rep[stream][r["policy"]][int(r.get("rep") or 0)] += s
    names = ["all"] + sorted(k for k in per_rep if k != "all")
    tot = {n: {p: sum(v.values()) for p, v in per_rep[n].items()} for n in names}

    print("| stream | best fixed | " + " | ".join(arms) + " | kv |")
    print("|---|---|" + "---|" * len(arms) + "---|")
    for name in names:
        t = tot[name]
        best, who = min((v, p) for p, v in t.items() if is_fixed(p))
        cells = [f"{t[a]:.1f} s ({t[a] / best:.3f}x)" if a in t else "-" for a in arms]
        print(f"| {name} | {who} {best:.1f} s | " + " | ".join(cells) + f" | {t['kv']:.1f} s ({t['kv'] / best:.3f}x) |")

    print()
    print("| stream | best fixed, out of sample (picks by repeat) | " + " | ".join(arms) + " | in-sample / out-of-sample best |")
    print("|---|---|" + "---|" * len(arms) + "---|")
    for name in names:
        t = tot[name]
        cv, picks = held_out_best(per_rep[name])
        if not picks:
            print(f"| {name} | one repeat only | " + " | ".join("-" for _ in arms) + " | - |")
            continue
        best = min(v for p, v in t.items() if is_fixed(p))
        cells = [f"{t[a]:.1f} s ({t[a] / cv:.3f}x)" if a in t else "-" for a in arms]
        print(f"| {name} | {cv:.1f} s ({', '.join(picks)}) | " + " | ".join(cells) + f" | {best / cv:.3f} |")

    sa = same_action(rows, arms)
    print()
    print("| stream | " + " | ".join(f"{a}: own / same action (identical work)" for a in arms) + " |")
    print("|---|" + "---|" * len(arms))
    for name in names:
        cells = []
        for a in arms:
            o = sa.get((name, a))
            cells.append(f"{o[0]:.1f} / {o[1]:.1f} s = {o[0] / o[1]:.3f}x ({o[3]} of {o[2]})" if o and o[1] else "-")
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

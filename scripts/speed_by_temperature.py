"""Speed against temperature from several ``rakv bench`` runs (one per temperature): per run and
workload, each policy's total latency, the best fixed policy, the adaptive policies against it
(total, and the paired median over requests with a 95% bootstrap interval), the A/A arm (joint:0,
identical work to kv) and the transformers peer. The tables of docs/results.md's sampling section.

    python scripts/speed_by_temperature.py DIR1 DIR2 ...   # a markdown table (--json: the rows)

Each DIR is a bench --out folder (executions.csv, meta.json). ``joint:0`` is left out of the best
fixed policy (it does kv's work: taking the luckier of two identical arms would flatter the best
fixed), and so are the peers (hf:*, llama.cpp) and adaptive policies. The best fixed policy picked
on the same requests it is scored on is the luckiest of several close arms; "cross-fitted" picks
it on one half of the prompts (by index parity) and scores it on the other, both ways: the fixed
policy a user who had tuned on other prompts would run. A transformers peer that
samples (``do_sample=True``) draws its own tokens, so its outputs differ in length: it is compared
in tokens per second, not latency.
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import statistics
import sys
from pathlib import Path

BOOT = 2000


def fixed(policy: str) -> bool:
    return not (policy.startswith(("adaptive", "hf:", "llama")) or policy == "joint:0")


def by_request(rows: list[dict]) -> dict:
    """(rep, cell, index) -> {policy: latency ms}: each request's executions side by side."""
    by: dict = {}
    for r in rows:
        by.setdefault((r["rep"], r["cell"], r["index"]), {})[r["policy"]] = float(r["latency_ms"])
    return by


def paired(rows: list[dict], a: str, b: str) -> tuple[float, float, float]:
    """Median over requests of latency(b) / latency(a), with a 95% bootstrap interval (> 1: a faster)."""
    by = by_request(rows)
    ratios = [v[b] / v[a] for v in by.values() if a in v and b in v and v[a] > 0]
    if not ratios:
        return float("nan"), float("nan"), float("nan")
    rng = random.Random(0)
    boots = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(BOOT))
    return statistics.median(ratios), boots[int(0.025 * BOOT)], boots[int(0.975 * BOOT)]


def tps(rows: list[dict], policy: str) -> float:
    """Tokens per second over a policy's executions (total tokens / total latency)."""
    rs = [r for r in rows if r["policy"] == policy]
    return sum(int(r["output_tokens"]) for r in rs) / (sum(float(r["latency_ms"]) for r in rs) / 1e3)


def crossfit(rs: list[dict], adaptive: str) -> float:
    """Total latency of the best fixed policy chosen on the other half of the prompts (index
    parity, each half scored by the other's pick) over the adaptive policy's on the same requests
    (> 1: adaptive faster)."""
    by = by_request(rs)
    keys = [k for k, v in by.items() if adaptive in v]
    pols = sorted({p for k in keys for p in by[k] if fixed(p) and all(p in by[j] for j in keys)})
    num = den = 0.0
    for half in (0, 1):
        pick = [k for k in keys if int(k[2]) % 2 == half]
        score = [k for k in keys if int(k[2]) % 2 != half]
        if not pick or not score or not pols:
            return float("nan")
        best = min(pols, key=lambda p: sum(by[k][p] for k in pick))
        num += sum(by[k][best] for k in score)
        den += sum(by[k][adaptive] for k in score)
    return num / den


def summarize(d: Path) -> list[dict]:
    meta = json.loads((d / "meta.json").read_text())
    rows = list(csv.DictReader((d / "executions.csv").open()))
    T = (meta.get("settings", {}).get("sampling") or meta.get("sampling") or {}).get("temperature")
    if T is None:
        argv = meta.get("argv") or meta.get("command") or []
        argv = argv.split() if isinstance(argv, str) else argv
        T = float(argv[argv.index("--temperature") + 1]) if "--temperature" in argv else 0.0
    out = []
    for wl in ["all"] + sorted({r["workload"] for r in rows}):
        rs = [r for r in rows if wl == "all" or r["workload"] == wl]
        pols = sorted({r["policy"] for r in rs})
        tot = {p: sum(float(r["latency_ms"]) for r in rs if r["policy"] == p) for p in pols}
        drafted = {p: sum(float(r["accepted"] or 0) for r in rs if r["policy"] == p) /
                   max(1.0, sum(float(r["drafted"] or 0) for r in rs if r["policy"] == p)) for p in pols}
        best = min((p for p in pols if fixed(p)), key=tot.get)
        row = {"dir": d.name, "T": T, "workload": wl, "n": sum(r["policy"] == best for r in rs), "best": best,
               "totals": tot, "alpha": drafted, "mismatches": sum(r["match"] not in ("1", "-1") for r in rs)}
        for p in pols:
            if p.startswith("adaptive"):
                row[p] = {"total": tot[best] / tot[p], "paired": paired(rs, p, best), "crossfit": crossfit(rs, p)}
        if "joint:0" in tot and "kv" in tot:
            row["aa"] = tot["joint:0"] / tot["kv"]
        for p in pols:
            if p.startswith("hf:"):      # sampled with its own generator: other tokens, other lengths
                row[p] = tps(rs, best) / tps(rs, p)
        out.append(row)
    return out


def markdown(rows: list[dict]) -> str:
    ads = sorted({k for r in rows for k in r if k.startswith("adaptive")})
    peers = sorted({k for r in rows for k in r if k.startswith("hf:")})
    head = (["T", "workload", "n", "best fixed (total s)"] +
            [f"{a} against best: total; paired median [95% CI]; cross-fitted" for a in ads] + ["A/A joint:0 / kv"] +
            [f"tokens/s, best fixed over {p}" for p in peers] + ["mismatches"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [f"{r['T']:g}", r["workload"], str(r["n"]), f"{r['best']} ({r['totals'][r['best']] / 1e3:.1f})"]
        for a in ads:
            if a in r:
                m, lo, hi = r[a]["paired"]
                cells.append(f"{r[a]['total']:.3f}; {m:.2f}x [{lo:.2f}, {hi:.2f}]; {r[a]['crossfit']:.3f}")
            else:
                cells.append("-")
        cells.append(f"{r['aa']:.3f}" if "aa" in r else "-")
        cells += [f"{r[p]:.2f}" if p in r else "-" for p in peers]
        cells.append(str(r["mismatches"]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="+")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = [r for d in args.dirs for r in summarize(Path(d))]
    print(json.dumps(rows, indent=1) if args.json else markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Adaptive against the fixed policies as a user runs them: each policy in its own
`rakv generate --prompts-file` call (a fresh process, one engine and one prefix cache per call),
repeated in rotated order; totals of request latency, exploration spent, the actions chosen,
and the outputs compared across policies (they must be identical).

    python scripts/controller_check.py --prompts-file resources/prompts/short-instructions.txt \
        --draft int8 --max-new-tokens 48 --repeats 3 --out out/check-int8.json

The profile is saved back by every adaptive run; a second adaptive run per repeat
(``adaptive#2``) shows whether decisions depend on which runs happened before.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path


def run_policy(args, policy: str) -> dict:
    cmd = [sys.executable, "-m", "rakv", "generate", "--prompts-file", args.prompts_file, "--draft", args.draft,
           "--target", args.target, "--policy", policy, "--max-new-tokens", str(args.max_new_tokens), "--json",
           "--threads", str(args.threads)] + (["--raw"] if args.raw else []) + args.extra
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{policy}: exit {p.returncode}: {p.stderr.strip().splitlines()[-1:]}")
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.strip()]
    return {"policy": policy, "wall_s": time.perf_counter() - t0,
            "total_ms": sum(r["latency_ms"] for r in rows),
            "explore_ms": sum(r.get("explore_ms", 0.0) for r in rows),
            "actions": [(r["action"]["reuse"], r["action"]["k"]) for r in rows],
            "drafted": sum(r["drafted"] for r in rows), "accepted": sum(r["accepted"] for r in rows),
            "outputs": [r["output_ids"] for r in rows], "tokens": sum(len(r["output_ids"]) for r in rows)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts-file", required=True)
    ap.add_argument("--target", default="demo")
    ap.add_argument("--draft", default="int8")
    ap.add_argument("--policies", default="ar,kv,joint:4,adaptive")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--raw", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("extra", nargs="*", help="more rakv generate flags after --")
    args = ap.parse_args()
    pols = args.policies.split(",")
    runs: list[dict] = []
    for rep in range(args.repeats):
        order = pols[rep % len(pols):] + pols[: rep % len(pols)]
        for pol in order:
            r = run_policy(args, pol)
            r["rep"] = rep
            runs.append(r)
            print(f"[check] rep {rep} {pol:<10} {r['total_ms'] / 1e3:7.2f} s  explore {r['explore_ms']:7.1f} ms  "
                  f"actions {r['actions']}", file=sys.stderr)
            if pol == "adaptive":
                r2 = run_policy(args, pol)
                r2.update(rep=rep, policy="adaptive#2")
                runs.append(r2)
                print(f"[check] rep {rep} adaptive#2 {r2['total_ms'] / 1e3:7.2f} s  actions {r2['actions']}",
                      file=sys.stderr)
    ref = next(r["outputs"] for r in runs if r["policy"] == pols[0])
    mismatches = sum(r["outputs"] != ref for r in runs)
    names = pols + (["adaptive#2"] if "adaptive" in pols else [])
    med = {p: statistics.median(r["total_ms"] for r in runs if r["policy"] == p) for p in names}
    best = {p: min(r["total_ms"] for r in runs if r["policy"] == p) for p in names}
    fixed = [p for p in pols if p != "adaptive"]
    bf = min(fixed, key=lambda p: med[p])
    ad = [r for r in runs if r["policy"].startswith("adaptive")]
    summary = {
        "median_total_ms": med, "best_total_ms": best, "best_fixed": bf,
        "adaptive_vs_best_fixed": med.get("adaptive", 0) / med[bf] if "adaptive" in med else None,
        "adaptive_vs_kv": med.get("adaptive", 0) / med["kv"] if "adaptive" in med and "kv" in med else None,
        "explore_share": (sum(r["explore_ms"] for r in ad) / sum(r["total_ms"] for r in ad)) if ad else None,
        "adaptive_actions": [r["actions"] for r in ad],
        "same_decisions_every_run": len({json.dumps(r["actions"]) for r in ad}) <= 1,
        "executions": len(runs), "requests": sum(len(r["outputs"]) for r in runs), "mismatches": mismatches,
        "command": " ".join(sys.argv),
    }
    print("| policy | median total s | best s | vs best fixed |\n|---|---|---|---|")
    for p in names:
        print(f"| {p} | {med[p] / 1e3:.2f} | {best[p] / 1e3:.2f} | {med[p] / med[bf]:.3f} |")
    print(json.dumps({k: v for k, v in summary.items() if k != "adaptive_actions"}, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"summary": summary, "runs": [
            {k: v for k, v in r.items() if k != "outputs"} for r in runs]}, indent=1))
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())

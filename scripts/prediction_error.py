"""The controller's prediction against what the engine then did, per request: the chosen action's
predicted ms beside the measured latency, and its predicted target passes beside the rounds taken,
from the `--json` lines of `rakv generate` (stdin or a file; a `--record` of the run may stand in
for the lines' own copy flag and predicted passes). Ends with the median and mean error, over all
requests and over exact repeats apart (issue 58: the median at most 25%).

    rakv generate --target qwen-coder-1.5b --draft qwen-coder-0.5b --json \\
        --prompts-file prompts.txt --record run.jsonl > run.json
    python scripts/prediction_error.py run.json
    rakv bench --target qwen-coder-1.5b --draft qwen-coder-0.5b --workload code-heldout \
        --policies adaptive --out out/pred && python scripts/prediction_error.py out/pred/executions.csv
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys


def decisions(path: str | None) -> dict:
    """request id -> its per-request Decision (a dict), from a recording."""
    out = {}
    if not path:
        return out
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            if r.get("type") == "decision" and r.get("round", -1) < 0:
                out[r["request_id"]] = r
    return out


def csv_rows(path: str) -> list[dict]:
    """A bench's executions.csv as --json-like rows (the adaptive policies' requests)."""
    import csv

    out = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            if r["policy"].startswith("adaptive") and r["predicted_ms"] not in ("", None):
                out.append({"request_id": f"{r['rep']}/{r['index']}", "predicted_ms": float(r["predicted_ms"]),
                            "latency_ms": float(r["latency_ms"]), "exact_repeat": r["exact_repeat"] in ("1", "True", "true"),
                            "action": {"reuse": r["reuse"], "k": r["k"]}, "rounds": r["rounds"]})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", nargs="?", help="rakv generate --json output (default: stdin), or a bench's "
                    "executions.csv (its adaptive requests)")
    ap.add_argument("--record", help="the run's --record file (copy flag, predicted passes)")
    a = ap.parse_args(argv)
    if a.json and a.json.endswith(".csv"):
        lines = [json.dumps(r) for r in csv_rows(a.json)]
    else:
        lines = open(a.json).read().splitlines() if a.json else sys.stdin.read().splitlines()
    dec = decisions(a.record)
    errs, rep = [], []
    print("req  exact  action   copy  predicted_ms  measured_ms  error  passes(pred/taken)")
    for line in lines:
        if not line.strip():
            continue
        r = json.loads(line)
        pred, meas = r.get("predicted_ms"), r["latency_ms"]
        if pred is None or meas <= 0:
            continue
        e = abs(pred - meas) / meas
        errs.append(e)
        if r["exact_repeat"]:
            rep.append(e)
        d = dec.get(r["request_id"], r)
        pp = d.get("predicted_passes")
        act = f"({r['action']['reuse']},{r['action']['k']})"
        print(f"{r['request_id']!s:>3}  {str(r['exact_repeat']):5}  {act:7}  {str(d.get('copy', '?')):5} "
              f"{pred:12.0f}  {meas:11.0f}  {e:5.0%}  {'?' if pp is None else f'{pp:.0f}'}/{r.get('rounds', '?')}")
    for name, xs in (("all requests", errs), ("exact repeats", rep)):
        if xs:
            print(f"{name}: median error {statistics.median(xs):.0%}, mean {statistics.mean(xs):.0%} ({len(xs)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

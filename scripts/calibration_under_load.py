"""Calibration under load against a quiet calibration, per term.

    python scripts/calibration_under_load.py --draft int8 --out out/cal-load.json

1. quiet: ``rakv calibrate`` on a quiet machine -> profile Q, and once more -> Q2 (the machine's own
   calibration-to-calibration spread, the A/A figure the 15% is read against);
2. loaded: the same while a second torch process keeps every core busy (matrix products on as many
   threads as this machine has cores) -> profile L, which must come out flagged ``contended``;
3. after: the load stopped, an ordinary ``rakv generate`` (one short request) loads L, sees the
   contended flag on a quiet machine and measures again -> the saved profile S. It starts ``--settle``
   seconds after the load stopped: a VM whose cores were both busy for minutes runs slower for a
   while afterwards (the host's CPU accounting), which no CPU-share check can see.
4. quiet again: ``rakv calibrate`` right after S -> Q3, the quiet calibration nearest in time to S.
   This VM's own speed drifts by up to 30% within minutes (docs/history/2026-12-01.md), so S is also
   read against Q3: same machine state, the contention is the only difference left.

Each run uses its own profile folder (RAKV_CACHE, the converted models shared by a link). Printed:
per term (prefill T_pf(n), step t(c), draft D_pf(n), d(c), verify V(k)) the ratios L/Q, S/Q and S/Q3,
and whether S is within 15% of Q3 (step 4) on every term.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LOAD = ("import torch, os\ntorch.set_num_threads(os.cpu_count())\na = torch.randn(1024, 1024)\n"
        "while True:\n    a = (a @ a).clamp_(-1, 1)\n")


def calibrate(cache: Path, args, recalibrate: bool) -> tuple[dict, float]:
    env = dict(os.environ, RAKV_CACHE=str(cache))
    # `rakv calibrate` always measures; an ordinary run (one short request) loads the saved profile
    # and measures again only if it must (here: it was marked contended and the machine is quiet now)
    cmd = [sys.executable, "-m", "rakv"] + (["calibrate"] if recalibrate else
                                            ["generate", "--prompt", "Hi", "--max-new-tokens", "1"]) + [
        "--target", args.target, "--draft", args.draft, "--threads", str(args.threads)]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"calibrate failed: {p.stderr.strip().splitlines()[-1:]}")
    newest = max((cache / "profiles").glob("*.json"), key=lambda f: f.stat().st_mtime)
    prof = json.loads(newest.read_text())
    return prof, time.perf_counter() - t0


def terms(p: dict) -> dict[str, float]:
    out = {}
    for name in ("T_pf", "t", "D_pf", "d"):
        for x, ms in p.get(name) or []:
            out[f"{name}({int(x)})"] = ms
    for k, ms in (p.get("V") or {}).items():
        out[f"V({k})"] = ms
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="demo")
    ap.add_argument("--draft", default="int8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tolerance", type=float, default=0.15)
    ap.add_argument("--out", default=None)
    ap.add_argument("--settle", type=float, default=30.0, help="seconds between the load's end and step 3")
    args = ap.parse_args()
    from rakv.util.paths import cache_dir

    models = cache_dir() / "models"
    root = Path(tempfile.mkdtemp(prefix="rakv-calload-"))
    caches = {}
    for name in ("quiet", "quiet2", "loaded", "quiet3"):
        c = root / name
        (c / "profiles").mkdir(parents=True)
        if models.exists():
            os.symlink(models, c / "models")
        caches[name] = c
    print("[cal] 1/4 quiet calibrations (A/A pair)", file=sys.stderr)
    Q, q_s = calibrate(caches["quiet"], args, True)
    # every later step on the one-row kernel the quiet machine chose (a loaded machine would keep the
    # default without remembering it, and a profile of the other kernel is another machine's)
    os.environ["RAKV_ONE_ROW"] = (Q.get("regime") or {}).get("one_row_kernel") or "plain"
    Q2, _ = calibrate(caches["quiet2"], args, True)
    print("[cal] 2/4 calibration with a second torch process running", file=sys.stderr)
    load = subprocess.Popen([sys.executable, "-c", LOAD])
    try:
        time.sleep(2.0)
        L, l_s = calibrate(caches["loaded"], args, True)
    finally:
        load.kill()
        load.wait()
    time.sleep(args.settle)
    print("[cal] 3/4 an ordinary run after the load stopped", file=sys.stderr)
    S, s_s = calibrate(caches["loaded"], args, False)
    print("[cal] 4/4 quiet calibration right after", file=sys.stderr)
    Q3, _ = calibrate(caches["quiet3"], args, True)
    tq, tq2, tl, ts, tq3 = terms(Q), terms(Q2), terms(L), terms(S), terms(Q3)
    rows = []
    for k in tq:
        if k in tl and k in ts and k in tq2 and k in tq3 and tq[k] > 0 and tq3[k] > 0:
            rows.append({"term": k, "quiet_ms": round(tq[k], 3), "quiet2_ratio": round(tq2[k] / tq[k], 3),
                         "loaded_ratio": round(tl[k] / tq[k], 3), "after_ratio": round(ts[k] / tq[k], 3),
                         "after_vs_quiet3": round(ts[k] / tq3[k], 3)})
    worst_after = max(abs(r["after_ratio"] - 1) for r in rows)
    worst_after3 = max(abs(r["after_vs_quiet3"] - 1) for r in rows)
    worst_aa = max(abs(r["quiet2_ratio"] - 1) for r in rows)
    worst_loaded = max(abs(r["loaded_ratio"] - 1) for r in rows)
    summary = {
        "quiet_s": round(q_s, 1), "loaded_s": round(l_s, 1), "after_s": round(s_s, 1),
        "loaded_contended": bool(L.get("quality", {}).get("contended")),
        "loaded_reasons": L.get("quality", {}).get("reasons", []),
        "after_contended": bool(S.get("quality", {}).get("contended")),
        "after_remeasured": S.get("calibrated_at") != L.get("calibrated_at"),
        "settle_s": args.settle, "one_row_kernel": os.environ["RAKV_ONE_ROW"], "worst_quiet2_dev": round(worst_aa, 3),
        "worst_loaded_dev": round(worst_loaded, 3), "worst_after_dev": round(worst_after, 3),
        "worst_after_vs_quiet3_dev": round(worst_after3, 3),
        "within_of_terms_vs_quiet": sum(abs(r["after_ratio"] - 1) <= args.tolerance for r in rows),
        "within_of_terms_vs_quiet3": sum(abs(r["after_vs_quiet3"] - 1) <= args.tolerance for r in rows),
        "terms": len(rows),
        "after_within_tolerance": worst_after3 <= args.tolerance, "tolerance": args.tolerance,
    }
    print("| term | quiet ms | quiet again / quiet | loaded / quiet | after / quiet | after / quiet right after |\n"
          "|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['term']} | {r['quiet_ms']:.2f} | {r['quiet2_ratio']:.3f} | {r['loaded_ratio']:.3f} | "
              f"{r['after_ratio']:.3f} | {r['after_vs_quiet3']:.3f} |")
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"summary": summary, "terms": rows}, indent=1))
    return 0 if summary["after_within_tolerance"] and summary["loaded_contended"] else 1


if __name__ == "__main__":
    sys.exit(main())

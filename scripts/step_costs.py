"""A model's step t and verify V(k) (k + 1 rows) under each form of the q8 kernel, one process per
form, the forms alternated over rounds (docs/fastpath.md, "q8 numerics").

Forms: ``tiles`` (the default: tiled codes, VNNI), ``amx`` (tiled codes, AMX tiles for 2+ rows where
the CPU allows them: ``RAKV_AMX=1``), ``lanes`` (the lane form: ``RAKV_TILES=0``).
Every form computes the same bits (tests/unit/test_q8.py); the script checks the argmax of each forward
agrees across forms.

    .venv/bin/python scripts/step_costs.py --target qwen-coder-1.5b --forms tiles,amx,lanes --threads 2
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = {"tiles": {}, "amx": {"RAKV_AMX": "1"}, "lanes": {"RAKV_TILES": "0"}}
PROMPT = ("def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n\n"
          "def main():\n    for i in range(10):\n        print(i, fibonacci(i))\n")


def child(a) -> dict:
    import torch

    sys.path.insert(0, str(ROOT))
    from rakv import decoding as dec
    from rakv.load.hub import load_model

    torch.set_num_threads(a.threads)
    lm = load_model(a.target, numerics="q8")
    ids = lm.tokenizer.encode(PROMPT)
    ks = [0] + [int(k) for k in a.ks.split(",")]
    cache = dec.DynamicCache()
    dec.prefill(lm.model, ids[:-max(ks) - 1], cache)
    ms: dict = {k: [] for k in ks}
    top: dict = {}
    for rep in range(a.reps + 1):
        for k in ks:
            toks = ids[-k - 1:]
            t0 = time.perf_counter()
            out = dec.verify(lm.model, toks, cache) if k else dec.decode_one(lm.model, toks[0], cache)
            dt = 1e3 * (time.perf_counter() - t0)
            dec.rollback(cache, k + 1)
            if rep:                        # rep 0: warm-up (the first q8 call of a layer tiles its codes)
                ms[k].append(dt)
            top[k] = out.reshape(-1, out.shape[-1]).argmax(-1).tolist()
    med = {k: statistics.median(v) for k, v in ms.items()}
    return {"ms_median": {k: round(v, 2) for k, v in med.items()},
            "ms_min": {k: round(min(v), 2) for k, v in ms.items()},
            "V/t": {k: round(med[k] / med[0], 3) for k in ks if k}, "argmax": top}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen-coder-1.5b")
    ap.add_argument("--forms", default="tiles,amx,lanes")
    ap.add_argument("--ks", default="1,2,4,8")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a)))
        return 0
    forms = a.forms.split(",")
    runs: dict = {f: [] for f in forms}
    for r in range(a.rounds):
        for f in (forms if r % 2 == 0 else forms[::-1]):
            env = dict(os.environ, **ENV[f])
            out = subprocess.run([sys.executable, __file__, "--child", "--target", a.target, "--ks", a.ks,
                                  "--reps", str(a.reps), "--threads", str(a.threads)], env=env, cwd=ROOT,
                                 capture_output=True, text=True, check=True).stdout
            runs[f].append(json.loads(out.strip().splitlines()[-1]))
            print(f"[step_costs] round {r} {f}: {runs[f][-1]['ms_median']}", file=sys.stderr, flush=True)
    ks = list(runs[forms[0]][0]["ms_median"])
    res = {"target": a.target, "threads": a.threads, "load": [round(x, 2) for x in os.getloadavg()], "forms": {}}
    for f in forms:
        med = {k: round(statistics.median(r["ms_median"][k] for r in runs[f]), 2) for k in ks}
        res["forms"][f] = {"ms": med, "V/t": {k: round(med[k] / med["0"], 3) for k in ks if k != "0"}}
    res["same_argmax"] = all(r["argmax"] == runs[forms[0]][0]["argmax"] for f in forms for r in runs[f])
    print(json.dumps(res, indent=1))
    return 0 if res["same_argmax"] else 1


if __name__ == "__main__":
    sys.exit(main())

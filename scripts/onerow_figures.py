"""`ar` tokens/s on the demo model with the one-row kernel plain (MKL) against packed (oneDNN), interleaved
rounds in one process, and whether the ids agree (docs/fastpath.md).

    python scripts/onerow_figures.py
"""
import json, statistics, sys, time
import torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
from rakv.kernels import fastpath
from rakv.config import RakvConfig
from rakv.engine import Engine
from rakv.load.hub import load_model
torch.set_num_threads(2)
lm = load_model("demo", "float32", None, "cpu", fast=True)
prompts = ["Write a Python function that checks whether a number is prime.",
           "Explain in two sentences what a prefix cache does.",
           "Translate into French: The weather is nice today.",
           "List five fruits, one per line."]
res = {"plain": [], "packed": []}
ids = {}
for r in range(3):
    for kernel in (("plain", "packed") if r % 2 == 0 else ("packed", "plain")):
        fastpath.set_one_row(lm.model, kernel)
        eng = Engine(lm, None, RakvConfig(policy="ar"))
        eng.generate(prompts[0], 4)       # warm-up, excluded
        toks, t0 = 0, time.perf_counter()
        out = []
        for p in prompts:
            e = eng.generate(p, 64); toks += len(e.output_ids); out.append(e.output_ids)
        res[kernel].append(toks / (time.perf_counter() - t0))
        ids.setdefault(kernel, out)
print(json.dumps({"tokens_per_s": {k: [round(x, 2) for x in v] for k, v in res.items()},
                  "median": {k: round(statistics.median(v), 2) for k, v in res.items()},
                  "same_ids": ids["plain"] == ids["packed"]}))

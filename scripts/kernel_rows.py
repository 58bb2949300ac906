"""The block kernel's cost by rows, an older build of ``rakv/kernels/blockq.c`` against the working
tree's, in one process, interleaved (docs/fastpath.md).

Both sources are compiled as the product compiles them (``blockq._build``: ``-O3 -march=native
-ffp-contract=off -fopenmp``) into a temporary folder. On random block codes of the demo model's
layer shapes (hidden 576, intermediate 1536, 49152-entry Q8_0 head; q | k | v and gate | up fused as
the lean forward runs them) each M is timed old, new, old, new, ...; the figures are the min and the
median over the reps, per layer and for one forward's linears (30 layers and the head). Every
output of the new build is compared with the old one's bit for bit.

With ``--steps`` it times whole forwards of the demo model instead (its own codes; both builds
swapped in and out of the same loaded model): a one-token step t at context 128 (``--ctx``: a list),
verifies of k + 1 tokens there (V(k)/t) and a prefill of 20 tokens, each old then new, and compares
the logits (bits, argmax, largest difference).

    .venv/bin/python scripts/kernel_rows.py                       # HEAD against the working tree
    .venv/bin/python scripts/kernel_rows.py --old REV --rows 1,8,32 --reps 9 --threads 2 --json
    .venv/bin/python scripts/kernel_rows.py --steps --reps 15 --threads 2 --ctx 128,512,2000
    .venv/bin/python scripts/kernel_rows.py --steps --target qwen-coder-1.5b --numerics q8 --ks 1,4,8
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from rakv.kernels import blockq  # noqa: E402

LAYERS = 30                       # the demo model's decoder layers
SHAPES = {"qkv": ("q4", 960, 576), "o": ("q4", 576, 576), "gate_up": ("q4", 3072, 576),
          "down": ("q4", 576, 1536), "head": ("q8", 49152, 576)}
SAMPLE_S = 0.002                  # about this long a sample
PER_FORWARD = {"qkv": LAYERS, "o": LAYERS, "gate_up": LAYERS, "down": LAYERS, "head": 1}


def random_codes(kind: str, N: int, K: int, seed: int = 0) -> blockq.BlockWeight:
    """Random codes of a kind (the kernel's speed does not depend on their values)."""
    g = torch.Generator().manual_seed(seed)
    nb = K // blockq.BLK
    d = (torch.rand(N, nb if kind != "q8x" else 2 * nb, generator=g) * 0.01).half().float()
    if kind == "q4":
        qs = torch.randint(0, 256, (N, nb, 16), dtype=torch.uint8, generator=g)
        m = -8 * d
    elif kind == "q8":
        qs = torch.randint(-128, 128, (N, nb, 32), dtype=torch.int8, generator=g)
        m = None
    else:
        qs = torch.randint(0, 256, (N, nb, 32), dtype=torch.uint8, generator=g)
        m = -(torch.rand(N, 2 * nb, generator=g) * 0.3).half().float()
    return blockq.BlockWeight(kind, N, K, qs, d.contiguous(), None if m is None else m.contiguous())


def build(source_text: str, out: Path) -> ctypes.CDLL:
    src = out.with_suffix(".c")
    src.write_text(source_text)
    why = blockq._build(blockq._compiler(), out, source=src)
    if why:
        raise SystemExit(f"build of {src} failed: {why}")
    try:
        return blockq._load(out)
    except AttributeError:                     # an older source without a later entry point
        lib = ctypes.CDLL(str(out))
        for name in ("rakv_linear", "rakv_attend"):
            getattr(lib, name).argtypes = getattr(blockq.library(), name).argtypes
            getattr(lib, name).restype = None
        return lib


class Bound:
    """One layer's codes bound to one library."""

    def __init__(self, lib, b: blockq.BlockWeight):
        self.lib, self.b = lib, b
        self.desc = blockq._LayerDesc(blockq.KIND_CODES[b.kind], b.N, b.K, b.qs.data_ptr(), b.d.data_ptr(),
                                      (b.m if b.m is not None else b.d).data_ptr())

    def __call__(self, x: torch.Tensor, y: torch.Tensor, threads: int) -> None:
        self.lib.rakv_linear(ctypes.byref(self.desc), x.data_ptr(), x.shape[0], y.data_ptr(), None, threads)


def timed(fn, inner: int) -> float:
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - t0) / inner


def use(lib, blocks: list) -> None:
    """Run the model's block-coded layers and its attention on ``lib``."""
    blockq._Lib.handle = lib
    for b in blocks:
        b._fn or b._bind()
        b._fn = lib.rakv_linear


def demo_model(target: str = "demo", numerics: str = "fp32"):
    """A model (default the demo) on the fast path and its block-coded weights (the libraries swap
    under them)."""
    import gc

    from rakv.load.hub import load_model

    lm = load_model(target, "float32", None, "cpu", fast=True, numerics=numerics)
    return lm, [o for o in gc.get_objects() if isinstance(o, blockq.BlockWeight)]


def steps(libs: dict, reps: int, lm, blocks: list, ks=(1, 2, 4, 8, 16), ctx: int = 128,
          prefill_rows: int = 20) -> dict:
    """t, V(k) and T_pf(prefill_rows) of the demo model (``demo_model()``) on each library,
    interleaved: min and median ms, V(k)/t of the mins and of the medians, and whether the logits
    of every forward agree."""
    from rakv import decoding as dec
    from rakv.decide.calibration import calibration_ids

    model = lm.model
    ids = calibration_ids(lm.tokenizer, ctx + max(ks) + 2, lm.vocab_size)
    cache = dec.DynamicCache()
    dec.prefill(model, ids[:ctx], cache)
    keys = [f"V({k})" for k in (0, *ks)] + [f"T_pf({prefill_rows})"]
    t = {v: {key: [] for key in keys} for v in libs}
    logits: dict = {v: {} for v in libs}

    def run(key: str) -> torch.Tensor:
        with torch.inference_mode():
            if key.startswith("T_pf"):
                return dec.prefill(model, ids[:prefill_rows], dec.DynamicCache())
            n = int(key[2:-1]) + 1
            out = dec.forward(model, ids[ctx: ctx + n], cache)
            dec.rollback(cache, n)
            return out

    for v in libs:                     # warm-up, excluded
        use(libs[v], blocks)
        for key in keys:
            run(key)
    for rep in range(reps):
        for v in (list(libs) if rep % 2 == 0 else list(libs)[::-1]):
            use(libs[v], blocks)
            for key in keys:
                t0 = time.perf_counter()
                out = run(key)
                t[v][key].append(1e3 * (time.perf_counter() - t0))
                logits[v].setdefault(key, out.clone())
    use(blockq.library(), blocks)
    res = {"ctx": ctx, "blocks": len(blocks),
           "same_logits": all(torch.equal(logits["old"][k], logits["new"][k]) for k in keys),
           "same_argmax": all(torch.equal(logits["old"][k].argmax(-1), logits["new"][k].argmax(-1)) for k in keys),
           "max_abs_logit_diff": max(float((logits["old"][k] - logits["new"][k]).abs().max()) for k in keys)}
    for v in libs:
        mins = {k: min(x) for k, x in t[v].items()}
        meds = {k: statistics.median(x) for k, x in t[v].items()}
        res[v] = {"min_ms": {k: round(x, 2) for k, x in mins.items()},
                  "med_ms": {k: round(x, 2) for k, x in meds.items()},
                  "V/t_of_mins": {k: round(mins[k] / mins["V(0)"], 3) for k in keys[1:-1]},
                  "V/t_of_medians": {k: round(meds[k] / meds["V(0)"], 3) for k in keys[1:-1]}}
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", default="HEAD", help="git revision of the old source (default HEAD)")
    ap.add_argument("--rows", default="1,2,4,8,9,17,20,32,64")
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", default=",".join(SHAPES))
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--steps", action="store_true", help="whole forwards of the demo model instead")
    ap.add_argument("--target", default="demo", help="--steps: the model (a preset, GGUF or folder)")
    ap.add_argument("--numerics", default="fp32", choices=["fp32", "q8"], help="--steps: its numerics")
    ap.add_argument("--ks", default="1,2,4,8,16", help="--steps: the verify sizes k (k + 1 rows)")
    ap.add_argument("--ctx", default="128", help="--steps: the context lengths the steps run at (comma list)")
    a = ap.parse_args()
    old_src = subprocess.run(["git", "show", f"{a.old}:rakv/kernels/blockq.c"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout
    tmp = Path(tempfile.mkdtemp(prefix="kernel_rows-"))
    libs = {"old": build(old_src, tmp / "old.so"), "new": build(blockq.SOURCE.read_text(), tmp / "new.so")}
    simd = getattr(libs["new"], "rakv_blockq_simd", None)
    if a.steps:
        torch.set_num_threads(a.threads)
        lm, blocks = demo_model(a.target, a.numerics)
        load = os.getloadavg()
        res = {"threads": a.threads, "old": a.old, "simd_new": int(simd()) if simd else None,
               "load_before": [round(x, 2) for x in load],
               "contexts": [steps(libs, a.reps, lm, blocks, ks=tuple(int(k) for k in a.ks.split(",")), ctx=int(c))
                            for c in a.ctx.split(",")],
               "load_after": [round(x, 2) for x in os.getloadavg()]}
        print(json.dumps(res, indent=None if a.json else 1))
        return 0 if all(c["same_argmax"] for c in res["contexts"]) else 1
    names = a.layers.split(",")
    codes = {n: random_codes(*SHAPES[n], seed=i) for i, n in enumerate(names)}
    bound = {v: {n: Bound(lib, codes[n]) for n in names} for v, lib in libs.items()}
    rows = [int(r) for r in a.rows.split(",")]
    torch.manual_seed(0)
    load = os.getloadavg()
    res: dict = {"threads": a.threads, "old": a.old, "load_before": [round(x, 2) for x in load],
                 "simd_new": int(simd()) if simd else None, "rows": {}}
    for M in rows:
        per = {}
        for n in names:
            b = codes[n]
            x = torch.randn(M, b.K)
            ys = {v: torch.empty(M, b.N) for v in libs}
            for v in libs:
                bound[v][n](x, ys[v], a.threads)
            same = torch.equal(ys["old"], ys["new"])
            once = min(timed(lambda: bound["old"][n](x, ys["old"], a.threads), 1) for _ in range(3))
            inner = max(1, int(SAMPLE_S / once))        # short samples: a busy machine spoils fewer
            t = {v: [] for v in libs}
            for rep in range(a.reps):
                for v in (("old", "new") if rep % 2 == 0 else ("new", "old")):
                    f = bound[v][n]
                    t[v].append(timed(lambda: f(x, ys[v], a.threads), inner))
            per[n] = {"same_bits": same, **{f"{v}_min_ms": round(1e3 * min(t[v]), 4) for v in libs},
                      **{f"{v}_med_ms": round(1e3 * statistics.median(t[v]), 4) for v in libs}}
        fwd = {f"{v}_{s}_ms": round(sum(PER_FORWARD[n] * per[n][f"{v}_{s}_ms"] for n in names), 2)
               for v in libs for s in ("min", "med")}
        fwd.update({f"{v}_layers_min_ms": round(sum(PER_FORWARD[n] * per[n][f"{v}_min_ms"] for n in names
                                                    if n != "head"), 2) for v in libs})
        res["rows"][M] = {"layers": per, "forward_linears": fwd, "same_bits": all(p["same_bits"] for p in per.values())}
        if not a.json:
            f = fwd
            print(f"M={M:3d}  forward's linears: old min {f['old_min_ms']:8.2f} med {f['old_med_ms']:8.2f} ms | "
                  f"new min {f['new_min_ms']:8.2f} med {f['new_med_ms']:8.2f} ms | x{f['old_min_ms'] / f['new_min_ms']:.2f}"
                  f"  same bits: {res['rows'][M]['same_bits']}", flush=True)
            print(f"        {LAYERS} layers without the head: old min {f['old_layers_min_ms']:8.2f} ms | new min "
                  f"{f['new_layers_min_ms']:8.2f} ms | x{f['old_layers_min_ms'] / f['new_layers_min_ms']:.2f}", flush=True)
            for n in names:
                p = per[n]
                print(f"        {n:8s} old {p['old_min_ms']:8.3f} / {p['old_med_ms']:8.3f}   new {p['new_min_ms']:8.3f} / "
                      f"{p['new_med_ms']:8.3f}  ms (min / med)", flush=True)
    res["load_after"] = [round(x, 2) for x in os.getloadavg()]
    if a.json:
        print(json.dumps(res))
    else:
        print(f"load average before {res['load_before']}, after {res['load_after']}; threads {a.threads}; "
              f"new build's SIMD path {res['simd_new']}")
    return 0 if all(r["same_bits"] for r in res["rows"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())

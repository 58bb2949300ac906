"""The block kernel's cost by rows, an older build of ``rakv/kernels/blockq.c`` against the working
tree's, in one process, interleaved (docs/fastpath.md).

Both sources are compiled as the product compiles them (``blockq._build``: ``-O3 -march=native
-ffp-contract=off -fopenmp``) into a temporary folder. On random block codes of the demo model's
layer shapes (hidden 576, intermediate 1536, 49152-entry Q8_0 head; q | k | v and gate | up fused as
the lean forward runs them) each M is timed old, new, old, new, ...; the figures are the min and the
median over the reps, per layer and for one forward's linears (30 layers and the head). Every
output of the new build is compared with the old one's bit for bit.

    .venv/bin/python scripts/kernel_rows.py                       # HEAD against the working tree
    .venv/bin/python scripts/kernel_rows.py --old REV --rows 1,8,32 --reps 9 --threads 2 --json
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
    lib = ctypes.CDLL(str(out))                # an older source may lack later entry points
    lib.rakv_linear.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                ctypes.c_void_p, ctypes.c_int]
    lib.rakv_linear.restype = None
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", default="HEAD", help="git revision of the old source (default HEAD)")
    ap.add_argument("--rows", default="1,2,4,8,9,17,20,32,64")
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", default=",".join(SHAPES))
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    old_src = subprocess.run(["git", "show", f"{a.old}:rakv/kernels/blockq.c"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout
    tmp = Path(tempfile.mkdtemp(prefix="kernel_rows-"))
    libs = {"old": build(old_src, tmp / "old.so"), "new": build(blockq.SOURCE.read_text(), tmp / "new.so")}
    simd = getattr(libs["new"], "rakv_blockq_simd", None)
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
        res["rows"][M] = {"layers": per, "forward_linears": fwd, "same_bits": all(p["same_bits"] for p in per.values())}
        if not a.json:
            f = fwd
            print(f"M={M:3d}  forward's linears: old min {f['old_min_ms']:8.2f} med {f['old_med_ms']:8.2f} ms | "
                  f"new min {f['new_min_ms']:8.2f} med {f['new_med_ms']:8.2f} ms | x{f['old_min_ms'] / f['new_min_ms']:.2f}"
                  f"  same bits: {res['rows'][M]['same_bits']}", flush=True)
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

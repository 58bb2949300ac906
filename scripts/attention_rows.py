"""The step's own attention (``rakv_attend``) by rows and context, an older build of
``rakv/kernels/blockq.c`` against the working tree's, in one process, interleaved (docs/fastpath.md#attention).

Both sources are compiled as the product compiles them into a temporary folder. Random queries,
keys and values in the demo model's shapes (9 query heads over 3 KV heads of 64) at each context
and row count; each pair of calls old, new, new, old, ...; the figure is the median us a layer (x30:
a step's 30 layers). Before timing, every (rows, context, window, softcap, head size, threads) case
of a grid is compared old against new for ``rakv_attend`` and ``rakv_attend_tree``: "same bits"
when the two builds compute the same arithmetic (a rework of the order of work), not otherwise
(a change of the exp, say).

    .venv/bin/python scripts/attention_rows.py --old 7a952cc
    .venv/bin/python scripts/attention_rows.py --old HEAD --contexts 128,512,2000 --rows 1,5,9,17
"""
from __future__ import annotations

import argparse
import ctypes
import itertools
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

sys.path.insert(0, str(ROOT / "scripts"))
from kernel_rows import build as build_lib  # noqa: E402

vp, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


def build(source_text: str, out: Path) -> ctypes.CDLL:
    """``kernel_rows.build`` (compiled as the product compiles it), with the tree attention typed too."""
    lib = build_lib(source_text, out)
    lib.rakv_attend.argtypes = [vp, i64, i64, i64, i64, vp, i64, vp, i64, i64, i64, f32, vp, i32, i64, f32]
    lib.rakv_attend_tree.argtypes = lib.rakv_attend.argtypes + [vp, i64, vp]
    lib.rakv_attend.restype = lib.rakv_attend_tree.restype = None
    return lib


def attend(lib, q, n, Hq, D, k, v, Hk, past, window, softcap, threads, tree=None) -> torch.Tensor:
    out = torch.empty(n, Hq * D)
    args = [q.data_ptr(), n, Hq, D, q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), Hk, past,
            0.125, out.data_ptr(), threads, window, softcap]
    if tree is None:
        lib.rakv_attend(*args)
    else:
        path, depth = tree
        lib.rakv_attend_tree(*args, path.data_ptr(), path.stride(0), depth.data_ptr())
    return out


def random_tree(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A random token tree of n rows: row 0 the root, each other row's parent an earlier row."""
    parent = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    paths, depth = [], []
    for i in range(n):
        chain, p = [i], parent[i]
        while p >= 0:
            chain.append(p)
            p = parent[p]
        chain.reverse()
        depth.append(len(chain) - 1)
        paths.append(chain + [0] * (n - len(chain)))
    return torch.tensor(paths, dtype=torch.int64), torch.tensor(depth, dtype=torch.int64)


def same_bits(libs: dict) -> tuple[int, int]:
    """(cases, cases where old and new differ) over a grid of shapes, windows, soft caps, threads."""
    g = torch.Generator().manual_seed(0)
    cases = differ = 0
    for D, (Hq, Hk), n, past, window, softcap, threads in itertools.product(
            (16, 64, 256), ((9, 3), (4, 4)), (1, 3, 9, 17), (0, 17, 40, 129), (0, 7), (0.0, 30.0), (1, 2)):
        q = torch.randn(n, Hq * D, generator=g) * 2
        k, v = torch.randn(Hk, past + n, D, generator=g), torch.randn(Hk, past + n, D, generator=g)
        for tree in (None, random_tree(n, g)):
            a, b = (attend(libs[x], q, n, Hq, D, k, v, Hk, past, window, softcap, threads, tree) for x in ("old", "new"))
            cases += 1
            differ += not torch.equal(a.view(torch.int32), b.view(torch.int32))
    return cases, differ


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", default="HEAD", help="git revision of the old source (default HEAD)")
    ap.add_argument("--contexts", default="128,512,2000")
    ap.add_argument("--rows", default="1,5,9,17")
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    old_src = subprocess.run(["git", "show", f"{a.old}:rakv/kernels/blockq.c"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout
    tmp = Path(tempfile.mkdtemp(prefix="attention_rows-"))
    libs = {"old": build(old_src, tmp / "old.so"), "new": build(blockq.SOURCE.read_text(), tmp / "new.so")}
    cases, differ = same_bits(libs)
    print(f"old = {a.old}, new = the working tree; {cases} cases compared, {differ} with other bits")
    Hq, Hk, D = 9, 3, 64
    g = torch.Generator().manual_seed(1)
    for past in (int(c) for c in a.contexts.split(",")):
        for n in (int(r) for r in a.rows.split(",")):
            q = torch.randn(n, Hq * D, generator=g)
            k, v = torch.randn(Hk, past + n, D, generator=g), torch.randn(Hk, past + n, D, generator=g)
            t = {"old": [], "new": []}
            for rep in range(a.reps):
                for x in (("old", "new") if rep % 2 == 0 else ("new", "old")):
                    t0 = time.perf_counter()
                    attend(libs[x], q, n, Hq, D, k, v, Hk, past, 0, 0.0, a.threads)
                    t[x].append(time.perf_counter() - t0)
            o, w = (1e6 * statistics.median(t[x][a.reps // 5:]) for x in ("old", "new"))
            print(f"context {past:5d}, {n:2d} rows: old {o:7.1f} us, new {w:7.1f} us a layer  x{o / w:.2f}"
                  f"   (30 layers: {o * 0.03:.2f} -> {w * 0.03:.2f} ms)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

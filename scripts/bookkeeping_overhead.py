"""Time outside the forwards, per request: kv against adaptive:nogate on the same engine and draft,
interleaved (the order alternates per request), on the bench's chat prompts. With a draft where
speculation does not pay both take (r = 1, k = 0), so the difference is the controller's own
bookkeeping (decisions, probes' checks, cost refinement) plus any probe.

    python scripts/bookkeeping_overhead.py --draft layers:6 --repeats 2 [--profile]
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import pstats
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft", default="layers:6")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--n-prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--profile", action="store_true", help="cProfile the adaptive arm (rakv functions)")
    a = ap.parse_args()
    from rakv.workloads import chat_prompts
    from rakv.session import get_profile, load
    from rakv.config import RakvConfig
    from rakv.engine import Engine

    cfg = RakvConfig(draft=a.draft, threads=a.threads)
    s0 = load(cfg)
    target, draft = s0.target, s0.draft
    prof = get_profile(target, draft, 8)
    prompts = chat_prompts("chat")[: a.n_prompts]
    arms = ("kv", "adaptive:nogate")
    eng = {p: Engine(target, draft, cfg.with_(policy=p), lambda r: None,
                     copy.deepcopy(prof) if p.startswith("adaptive") else None) for p in arms}
    for e in eng.values():                                    # warm-up, excluded
        e.generate(prompts[0], a.max_new_tokens)
    res = {p: [] for p in arms}
    pr = cProfile.Profile() if a.profile else None
    for rep in range(a.repeats):
        for i, text in enumerate(prompts):
            for p in (arms if (i + rep) % 2 == 0 else arms[::-1]):
                if pr and p != "kv":
                    pr.enable()
                t0 = time.perf_counter()
                end = eng[p].generate(text, a.max_new_tokens)
                ms = (time.perf_counter() - t0) * 1e3
                if pr and p != "kv":
                    pr.disable()
                res[p].append((ms, end.forward_ms, end.bookkeeping_ms, end.action["k"], end.explore_ms))
    for p, xs in res.items():
        tot, fwd = sum(x[0] for x in xs), sum(x[1] for x in xs)
        print(f"{p:16s} n={len(xs)} total {tot:9.1f} ms  forwards {fwd:9.1f}  outside {tot - fwd:7.1f} "
              f"({(tot - fwd) / len(xs):.2f} ms a request; in rounds {sum(x[2] for x in xs):.1f})  "
              f"k={sorted({x[3] for x in xs})} explore {sum(x[4] for x in xs):.1f} ms")
    if pr:
        pstats.Stats(pr).sort_stats("cumtime").print_stats(r"rakv/(engine|controller|costs|drafts|prefix_cache)", 30)
    return 0


if __name__ == "__main__":
    sys.exit(main())

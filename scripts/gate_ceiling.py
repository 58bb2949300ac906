"""How much any in-round stopping rule could gain over a fixed k with the n-gram draft, from the
outputs themselves: the n-gram draft is deterministic given the tokens so far (and the earlier
requests' history), so every round's proposal and how much of it the target accepts follow from
the greedy output alone. With the profile's measured V(j) and t:

  fixed k   each round verifies min(k, proposal) drafts (joint:k, as the engine runs it)
  oracle    perfect foresight: each round verifies the j in 0..lookup_k with the least time to the
            end of the request (a dynamic programme over output positions): a lower bound on every
            gate that stops the same n-gram proposals

Prefill is the same in every arm (kv's measured time to first token, r = 1 everywhere) and is added
to both. The output of one kv run per request gives the ids (all policies emit the same ids).

    RAKV_WIKITEXT=../shared/data/wikitext-2-raw/wiki.test.raw \\
        python scripts/gate_ceiling.py --workload mixed,repetitive,chat --ks 4,8 --out out/ceiling.json
"""

from __future__ import annotations

import argparse
import json
import sys
from types import SimpleNamespace


def proposal_at(seq0: list[int], out: list[int], i: int, N: int, cap: int, sizes, history) -> tuple[list[int], int, int]:
    """The n-gram proposal after out[:i+1] (at most cap tokens, within the budget N), its match
    length, and how many of its tokens the target accepts (the greedy output continues with them)."""
    from rakv.drafts.ngram import ngram_match

    n = len(out)
    prop, m = ngram_match(seq0 + out[: i + 1], min(cap, N - (i + 1) - 1), sizes, history)
    a = 0
    while a < len(prop) and i + 1 + a < n and prop[a] == out[i + 1 + a]:
        a += 1
    return prop, m, min(a, n - i - 2)


def rounds_cost(seq0: list[int], out: list[int], N: int, V, cap: int, sizes, history, oracle: bool) -> tuple[float, int]:
    """(ms, rounds) of the decoding rounds after the first token (out[0] comes from the prefill)."""
    n = len(out)
    # per position i (out[:i+1] emitted): the proposal's accepted length and the verify-length range
    acc, prop_len = [0] * n, [0] * n
    for i in range(n - 1):
        prop, _, acc[i] = proposal_at(seq0, out, i, N, cap, sizes, history)
        prop_len[i] = len(prop)
    ctx = len(seq0)
    if not oracle:
        i, ms, r = 0, 0.0, 0
        while i < n - 1:
            j = prop_len[i]
            ms += V(j, ctx + i + 1)
            i += min(j, acc[i]) + 1
            r += 1
        return ms, r
    best = [0.0] * (n + 1)
    nr = [0] * (n + 1)
    for i in range(n - 2, -1, -1):
        b, br = None, 0
        for j in range(0, prop_len[i] + 1):
            nxt = min(n - 1, i + min(j, acc[i]) + 1)
            c = V(j, ctx + i + 1) + best[nxt]
            if b is None or c < b:
                b, br = c, nr[nxt] + 1
        best[i], nr[i] = b, br
    return best[0], nr[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="mixed")
    ap.add_argument("--ks", default="4,8", help="fixed k to compare (comma list)")
    ap.add_argument("--n-prompts", type=int, default=6)
    ap.add_argument("--buckets", default="32,128")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-history", action="store_true", help="prompt lookup only (no earlier requests)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import os

    import torch

    from rakv.bench import build_streams
    from rakv.session import get_profile, load
    from rakv.config import LOOKUP_K, RakvConfig
    from rakv.engine import Engine
    from rakv.prefix_cache import TokenHistory

    torch.set_num_threads(a.threads)
    args = SimpleNamespace(threads=a.threads, target="demo", dtype="float32", revision=None, draft="ngram",
                           seed=a.seed, prompts=os.environ.get("RAKV_WIKITEXT"), raw=False)
    cfg = RakvConfig(target="demo", draft="ngram")
    s0 = load(cfg.with_(threads=a.threads))
    target, draft = s0.target, s0.draft
    ks = [int(x) for x in a.ks.split(",")]
    prof = get_profile(target, draft, 8)
    s = {"workloads": a.workload.split(","), "gens": [a.max_new_tokens], "n_prompts": a.n_prompts,
         "buckets": [int(x) for x in a.buckets.split(",")]}
    streams = build_streams(s, args, target.tokenizer, target.max_positions)

    def V(j, ctx):
        return prof.step(ctx) if j == 0 else prof.verify(j, ctx)

    res: dict = {"regime": {"t_ms": round(prof.step(128), 3),
                            "V_over_t": {j: round(V(j, 128) / V(0, 128), 3) for j in (1, 2, 4, 8, 12, 16)}},
                 "streams": {}}
    Engine(target, None, cfg.with_(policy="kv")).generate(list(next(iter(streams.values()))[0].ids), 8)  # warm-up
    for name, reqs in streams.items():
        eng = Engine(target, None, cfg.with_(policy="kv"))
        hist = TokenHistory(0 if a.no_history else cfg.history_tokens)
        row = {f"joint:{k}": 0.0 for k in ks} | {"oracle": 0.0, "prefill": 0.0}
        rounds = {f"joint:{k}": 0 for k in ks} | {"oracle": 0}
        for rq in reqs:
            end = eng.generate(list(rq.ids), rq.gen)
            out, seq0 = end.output_ids, list(rq.ids)
            h = hist if len(hist) else None
            row["prefill"] += end.ttft_ms
            for k in ks:
                ms, r = rounds_cost(seq0, out, rq.gen, V, k, cfg.ngram_sizes, h, oracle=False)
                row[f"joint:{k}"] += ms
                rounds[f"joint:{k}"] += r
            ms, r = rounds_cost(seq0, out, rq.gen, V, LOOKUP_K, cfg.ngram_sizes, h, oracle=True)
            row["oracle"] += ms
            rounds["oracle"] += r
            hist.add(seq0 + out)
        res["streams"][name] = {"ms": {x: round(v, 1) for x, v in row.items()}, "rounds": rounds}
        print(name, {x: round(v) for x, v in row.items()}, rounds, file=sys.stderr)
    tot = {x: sum(st["ms"][x] for st in res["streams"].values()) for x in next(iter(res["streams"].values()))["ms"]}
    best = min((tot[f"joint:{k}"], f"joint:{k}") for k in ks)
    res["total_ms"] = {x: round(v, 1) for x, v in tot.items()}
    res["ceiling"] = {"best_fixed": best[1],
                      "rounds_only": round(best[0] / tot["oracle"], 4),
                      "with_prefill": round((best[0] + tot["prefill"]) / (tot["oracle"] + tot["prefill"]), 4)}
    print(json.dumps(res["ceiling"]))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

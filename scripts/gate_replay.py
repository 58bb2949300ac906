"""The confidence gate with the n-gram draft, replayed offline: variants of its stopping rule on the
same proposals. An n-gram proposal is a function of the tokens so far and of the earlier requests'
history, so one kv run per request (its greedy output) fixes every round's proposal and how much of
it the target accepts; each variant's rounds are then priced with the profile's measured V(j) and t
(rounds only: prefill is the same in every arm). Arms:

  joint:8           every round verifies min(8, proposal)
  oracle            each round verifies exactly the tokens that will be accepted (greedy foresight)
  gate              the engine's rule before ``lookup_top`` (lookups up to lookup_k): per-token confidence from the match length, the pooled
                    per-bin map learned online, the best expected tokens per ms (best_verify_length)
  gate, no trust    the same without the request's own trust in its copies (the earlier gate)

  joint:K           every round verifies min(K, proposal)
  gate N            the gate with lookups cut to N tokens (``lookup_top``'s cap)
  gate, rate        the length with the most E_j - lam C_j at the stream's rate so far (Dinkelbach)
  gate, odds        a request's trust scales the odds of a copy, never making it certain
  gate, miss        ... or divides its chance of a miss when above 1
  gate, priorA      the pooled map starting from acceptance A alone (not the calibration's counts)

With ``--temperature T`` the outputs are seeded samples (the same under every policy, so they fix
acceptance as a greedy output does). Ratios are joint:8's time over the arm's (above 1: faster
than joint:8). Seed 0 is the bench's stream; seed 7 is held out.

    RAKV_WIKITEXT=../shared/data/wikitext-2-raw/wiki.test.raw \\
        python scripts/gate_replay.py --seeds 0,7 --out out/gate_replay.json
    python scripts/gate_replay.py --seeds 0,7 --n-prompts 20 --workload repetitive,chat-heldout \\
        --temperature 0.3 --arms "joint:2;gate 8;gate"
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from types import SimpleNamespace


def outputs(seeds, n_prompts, gen, workloads, sampling=None):
    """{seed:stream: [(prompt ids, output, max new tokens)]} from one kv run per stream (greedy, or
    seeded sampling: the output is the same under every policy, so it fixes acceptance too)."""
    import torch

    from rakv.bench import build_streams
    from rakv.session import load
    from rakv.config import RakvConfig
    from rakv.engine import Engine

    torch.set_num_threads(2)
    cfg = RakvConfig(target="demo", draft="ngram", sampling=sampling)
    target = None
    out = {}
    for seed in seeds:
        args = SimpleNamespace(threads=2, target="demo", dtype="float32", revision=None, draft="ngram", seed=seed,
                               prompts=os.environ.get("RAKV_WIKITEXT"), raw=False)
        if target is None:
            target = load(cfg.with_(threads=2)).target
        s = {"workloads": workloads, "gens": [gen], "n_prompts": n_prompts, "buckets": [32, 128]}
        for name, reqs in build_streams(s, args, target.tokenizer, target.max_positions).items():
            eng = Engine(target, None, cfg.with_(policy="kv"))
            out[f"s{seed}:{name}"] = [(list(r.ids), eng.generate(list(r.ids), r.gen).output_ids, r.gen) for r in reqs]
    return out, target


def rate_length(S: list[float], V: list[float], lam: float) -> int:
    """The verify length with the most expected tokens less their cost at the long-run rate lam
    (tokens per ms): E_j - lam C_j (Dinkelbach) instead of the round's own best E_j / C_j."""
    best_j, best, e = 0, 1.0 - lam * V[0], 1.0
    for j, s in enumerate(S, start=1):
        e += s
        if e - lam * V[j] > best:
            best_j, best = j, e - lam * V[j]
    return best_j


def trusted(p: float, trust: float, arm: str) -> float:
    """A pooled chance p corrected by the request's trust: scaled and capped at 1 (the engine's
    rule), or, in the "odds" arm, its odds scaled (never certain), or in the "miss" arm its chance
    of a miss divided by a trust above 1."""
    if "odds" in arm:
        if p >= 1.0:
            return 1.0
        o = p / (1.0 - p) * trust
        return o / (1.0 + o)
    if "miss" in arm and trust > 1.0:
        return 1.0 - (1.0 - p) / trust
    return min(1.0, p * trust)


def replay(reqs, arm: str, prof, prior, lookup_k: int) -> float:
    """Rounds' ms of one stream under ``arm`` (see the module docstring)."""
    from gate_ceiling import proposal_at

    from rakv.drafts.ngram import ngram_confidence
    from rakv.decide.gate import AcceptMap, request_trust
    from rakv.decide.policy import best_verify_length
    from rakv.util.acceptance import judged
    from rakv.prefix_cache import TokenHistory

    def V(j, ctx):
        return prof.step(ctx) if j == 0 else prof.verify(j, ctx)

    fixed = arm.startswith("joint:")
    last = arm.split()[-1]
    cap = int(arm.split(":")[1]) if fixed else (int(last) if last.isdigit() else lookup_k)
    own = re.search(r"prior([0-9.]+)", arm)           # "gate, prior0.3 10": the map starts from that alpha alone
    amap = AcceptMap(float(own.group(1))) if own else AcceptMap(1.0, prior)
    hist, total, tokens = TokenHistory(), 0.0, 0
    for ids, out, N in reqs:
        h = hist if len(hist) else None
        n, i, hits, pred = len(out), 0, 0.0, 0.0
        while i < n - 1:
            toks, m, a = proposal_at(ids, out, i, N, cap, (3, 2), h)
            ctx = len(ids) + i + 1
            if not toks or fixed:
                j = len(toks)
            elif arm == "oracle":
                j = a
            else:
                confs = [ngram_confidence(m + t) for t in range(len(toks))]
                trust = 1.0 if arm == "gate, no trust" else request_trust(hits, pred)
                ps = [trusted(amap.p(c), trust, arm) for c in confs]
                S, s = [], 1.0
                for p in ps:
                    s *= p
                    S.append(s)
                Vs = [V(x, ctx) for x in range(len(toks) + 1)]
                if arm.startswith("gate, rate"):
                    j = rate_length(S, Vs, max(1.0 / Vs[0], tokens / total if total else 0.0))
                else:
                    j = best_verify_length(S, Vs, 0.0)
                if j:
                    for c, ok in judged(confs[:j], j, min(a, j)):
                        pred += amap.p(c)
                        hits += ok
                    amap.observe(confs[:j], ps[:j], min(a, j))
            total += V(j, ctx)
            tokens += min(j, a) + 1
            i += min(j, a) + 1
        hist.add(ids + out)
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0,7")
    ap.add_argument("--n-prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--workload", default="mixed,repetitive,chat,chat-heldout")
    ap.add_argument("--out", default=None)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--sample-seed", type=int, default=7)
    ap.add_argument("--arms", default="joint:2;joint:4;joint:8;oracle;gate;gate 8;gate, no trust;gate, rate;gate, rate 8",
                    help="arms, separated by semicolons")
    a = ap.parse_args()
    from rakv.session import get_profile
    from rakv.config import LOOKUP_K
    from rakv.drafts.ngram import NgramDraft

    from rakv.config import Sampling

    smp = Sampling(temperature=a.temperature, seed=a.sample_seed) if a.temperature > 0 else Sampling()
    data, target = outputs([int(x) for x in a.seeds.split(",")], a.n_prompts, a.max_new_tokens, a.workload.split(","), smp)
    prof = get_profile(target, NgramDraft(), 8)
    arms = ["joint:8"] + [x for x in a.arms.split(";") if x != "joint:8"]
    groups: dict[str, list[str]] = {}
    for key in data:
        seed, stream = key.split(":", 1)
        groups.setdefault(f"{stream.split('/')[0]} {seed}", []).append(key)
    res = {}
    for g, keys in sorted(groups.items()):
        ms = {arm: sum(replay(data[k], arm, prof, prof.accept_map, LOOKUP_K) for k in keys) for arm in arms}
        res[g] = {"ms": {k: round(v, 1) for k, v in ms.items()},
                  "vs_joint8": {k: round(ms["joint:8"] / v, 4) for k, v in ms.items()}}
        print(f"{g:18s} " + "  ".join(f"{k} {v:.3f}" for k, v in res[g]["vs_joint8"].items()))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

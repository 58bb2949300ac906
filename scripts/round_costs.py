"""Where the per-request cost model goes wrong, round by round: for fixed policies joint:k on chat
prompts (the bench's chat stream), each drafting round's measured time split into draft, catch-up,
verify and the rest (bookkeeping), against the profile's draft_round(k, ctx, alpha) + V(k, ctx); and the measured
tokens per round against E_k(alpha) at the request's own measured alpha.

    python scripts/round_costs.py --draft int8 --ks 1,2,4,8 --n-prompts 8 --max-new-tokens 48
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft", default="int8")
    ap.add_argument("--ks", default="1,2,4,8")
    ap.add_argument("--n-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workload", default="chat")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import torch

    from rakv.workloads import chat_prompts, chat_stream
    from rakv.session import get_profile, load
    from rakv.config import RakvConfig
    from rakv.decide.policy import E, overshoot
    from rakv.engine import Engine
    from rakv.records import Round

    torch.set_num_threads(a.threads)
    cfg = RakvConfig(target="demo", draft=a.draft)
    s0 = load(cfg.with_(threads=a.threads))
    target, draft = s0.target, s0.draft
    ks = [int(x) for x in a.ks.split(",")]
    prof = get_profile(target, draft, max(ks))
    reqs = chat_stream(chat_prompts(a.workload), target.tokenizer, a.n_prompts, a.max_new_tokens, seed=0)

    rounds: list = []
    eng = {k: Engine(target, draft, cfg.with_(policy=f"spec:{k}"), rounds.append, None) for k in ks}
    for k in ks:                                   # warm-up
        eng[k].generate(list(reqs[0].ids), 8)
    per = defaultdict(lambda: defaultdict(list))
    reach = defaultdict(lambda: defaultdict(int))      # k -> position j -> rounds that judged token j
    hold = defaultdict(lambda: defaultdict(int))       # ... and accepted it
    lat = defaultdict(list)
    for i, rq in enumerate(reqs):
        for j in range(len(ks)):
            k = ks[(i + j) % len(ks)]
            rounds.clear()
            end = eng[k].generate(list(rq.ids), rq.gen)
            rs = [r for r in rounds if isinstance(r, Round) and r.kind == "spec"]
            if not rs:
                continue
            acc = sum(r.accepted for r in rs)
            tri = sum(r.accepted + (r.accepted < r.drafted) for r in rs)
            alpha = acc / tri if tri else 0.0
            lat[k].append(end.latency_ms)
            P = per[k]
            for r in rs:
                for j in range(1, min(r.drafted, r.accepted + 1) + 1):
                    reach[k][j] += 1
                    hold[k][j] += j <= r.accepted
                ctx = r.context
                d_pred = prof.draft_round(r.drafted, ctx, alpha)
                v_pred = prof.verify(r.drafted, ctx)
                P["draft"].append(r.draft_ms - r.catchup_ms)
                P["draft_pred"].append(d_pred)
                P["catch"].append(r.catchup_ms)
                P["catch_tok"].append(r.catchup_tokens)
                P["verify"].append(r.verify_ms)
                P["verify_pred"].append(v_pred)
                P["rest"].append(r.round_ms - r.draft_ms - r.verify_ms)
                P["round"].append(r.round_ms)
                P["tokens"].append(len(r.emitted))
                P["full"].append(r.accepted == r.drafted)
            P["E_pred"].append(E(k, alpha) * len(rs))
            P["E_meas"].append(sum(len(r.emitted) for r in rs))
            n_r = sum(len(r.emitted) for r in rs)
            P["rounds_req"].append(len(rs))
            P["rounds_iid"].append(n_r / E(k, alpha))
            P["rounds_over"].append(n_r / E(k, alpha) + overshoot(k, alpha))
    t = prof.step(140)
    out = {"t_ms": t, "ks": {}}
    print(f"t(ctx 140) = {t:.2f} ms; per drafting round, means (ms):")
    print(" k | draft  pred | catch (tok) | verify  pred | rest | round  pred | tokens/round E_k(alpha) | full")
    for k in ks:
        P = per[k]
        m = {x: statistics.fmean(v) for x, v in P.items()}
        pred_round = m["draft_pred"] + m["verify_pred"]
        ek = sum(P["E_pred"]) / len(P["round"])
        row = dict(m, pred_round=pred_round, E_k=ek, tokens_per_round=sum(P["E_meas"]) / len(P["round"]),
                   latency_median=statistics.median(lat[k]))
        out["ks"][k] = row
        print(f"{k:2d} | {m['draft']:5.2f} {m['draft_pred']:5.2f} | {m['catch']:5.2f} ({m['catch_tok']:.2f}) | "
              f"{m['verify']:6.2f} {m['verify_pred']:6.2f} | {m['rest']:4.2f} | {m['round']:6.2f} {pred_round:6.2f} | "
              f"{row['tokens_per_round']:.2f} {ek:.2f} | {m['full']:.2f}   lat med {row['latency_median']:.0f}")
    print("rounds per request: measured | n / E_k(alpha) | + overshoot(k, alpha)")
    for k in ks:
        P = per[k]
        print(f"{k:2d} | {statistics.fmean(P['rounds_req']):.2f} | {statistics.fmean(P['rounds_iid']):.2f} | "
              f"{statistics.fmean(P['rounds_over']):.2f}")
    print("acceptance of draft token j given tokens 1..j-1 accepted (h_j), per k run:")
    for k in ks:
        h = {j: hold[k][j] / reach[k][j] for j in sorted(reach[k]) if reach[k][j]}
        out["ks"][k]["h"] = h
        print(f"{k:2d} | " + " ".join(f"{h[j]:.2f}({reach[k][j]})" for j in h))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

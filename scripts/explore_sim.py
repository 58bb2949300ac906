"""The controller's exploration on synthetic streams priced by a saved cost profile: every request
is a fresh prompt of P tokens and N new tokens, acceptance is Bernoulli at a true alpha per draft,
and a round costs what the profile says (draft steps, its prompt prefill, V(k), t). No model runs,
so it is deterministic per seed and takes a second; it checks the rules of exploration (when the
controller first drafts, what that costs where drafting does not pay), not the engine's timings.

Arms: k = 0 throughout (kv on unrelated prompts), fixed k (joint:K), and adaptive (the controller's
per-request decision, its probes and request-level exploration; no gate).

    python scripts/explore_sim.py docs/results/2026-12-06-xeon-qwen/cal_pair.json \\
        --alphas 0.55,0.65,0.75,0.82,0.9 --requests 6 --seeds 20
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rakv.decide.controller import Controller, Situation  # noqa: E402
from rakv.decide.profile import CostProfile  # noqa: E402


def load(path: str) -> CostProfile:
    d = json.loads(Path(path).read_text())
    keep = {k: v for k, v in d.items() if k in CostProfile.__dataclass_fields__}
    keep.update(alpha_learned=None, alpha_trials=None, scale={}, samples={})
    return CostProfile(**keep)


def request_ms(prof, k: int, P: int, N: int, alpha: float, rng, ctl=None, draft_model=True, explore=False):
    """One request at k (k = 0: plain steps, maybe probes); returns (ms, drafted rounds)."""
    ms = prof.T(P) + (prof.D(P) if k > 0 and draft_model else 0.0)
    out, ctx, drafted_rounds = 1, P + 1, 0
    behind = P if k > 0 or not draft_model else 0     # a k = 0 request's draft has read nothing
    if ctl is not None:
        ctl.earn(prof.T(P))
    while out < N:
        remaining = N - out
        if explore and k > 0 and not ctl.explore_holds(ctx, k, remaining):
            k = 0                              # an explored request stops drafting (as the planner does)
        kk = k
        if ctl is not None and k == 0:
            kk = ctl.maybe_probe(ctx, remaining, catchup_tokens=ctx - behind, draft_model=draft_model)
        kk = min(kk, remaining - 1)
        if kk > 0:
            catch = ctl.catchup_ms(ctx - behind, draft_model, ctx) if (ctl is not None and k == 0) else 0.0
            a = 0
            while a < kk and rng.random() < alpha:
                a += 1
            r_ms = catch + kk * prof.draft_step(ctx) + prof.verify(kk, ctx)
            if ctl is not None:
                ctl.observe_round(kk, a, r_ms, a + 1, ctx)
            out += a + 1
            ctx += a + 1
            behind = ctx - 1
            drafted_rounds += 1
        else:
            r_ms = prof.step(ctx)
            if ctl is not None:
                ctl.observe_round(0, 0, r_ms, 1, ctx)
            out += 1
            ctx += 1
        ms += r_ms
    if ctl is not None:
        ctl.end_request(out, N, "max_new_tokens")
    return ms, drafted_rounds


def stream(prof, policy, alpha, n, seed, P, N, ks):
    rng = random.Random(seed)
    prof = copy.deepcopy(prof)        # (a controller saves what it learned into its profile)
    ctl = Controller(prof, k_set=ks) if policy == "adaptive" else None
    total, chosen = 0.0, []
    for _ in range(n):
        if ctl is not None:
            ch = ctl.decide(Situation(P=P, N=N, budget=1 << 40, entry_bytes=1, draft_entry_bytes=1), ks)
            k, tag = ch.k, ch.reason
        else:
            k, tag = int(policy.split(":")[1]) if ":" in policy else 0, "fixed"
        ms, _ = request_ms(prof, k, P, N, alpha, rng, ctl, explore=tag == "probe")
        total += ms
        chosen.append(f"{k}{'p' if tag == 'probe' else ''}")
    return total, chosen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("profile")
    ap.add_argument("--alphas", default="0.55,0.65,0.75,0.82,0.9")
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--P", type=int, default=66)
    ap.add_argument("--N", type=int, default=64)
    ap.add_argument("--fixed", default="1,2,4,8")
    ap.add_argument("--horizon", type=float, default=None, help="EXPLORE_HORIZON for this run")
    args = ap.parse_args()
    if args.horizon is not None:
        import rakv.decide.controller as C
        C.EXPLORE_HORIZON = args.horizon
    prof = load(args.profile)
    ks = (0, 1, 2, 4, 6, 8)
    arms = ["kv"] + [f"joint:{k}" for k in args.fixed.split(",")]
    print(f"alpha0 {prof.alpha0:.3f}; P {args.P}, N {args.N}, {args.requests} requests, {args.seeds} seeds")
    print("alpha | adaptive / best fixed (mean, worst) | best fixed | adaptive / kv | first seed's k per request")
    for alpha in [float(a) for a in args.alphas.split(",")]:
        ratios, vs_kv, first = [], [], None
        best_names = []
        for seed in range(args.seeds):
            fixed = {arm: stream(prof, arm, alpha, args.requests, seed, args.P, args.N, ks)[0] for arm in arms}
            ad, chosen = stream(prof, "adaptive", alpha, args.requests, seed, args.P, args.N, ks)
            b = min(fixed, key=fixed.get)
            best_names.append(b)
            ratios.append(ad / fixed[b])
            vs_kv.append(ad / fixed["kv"])
            first = first or chosen
        best = statistics.mode(best_names)
        print(f"{alpha:.2f} | {statistics.mean(ratios):.3f}, {max(ratios):.3f} | {best} | "
              f"{statistics.mean(vs_kv):.3f} | {' '.join(first)}")


if __name__ == "__main__":
    main()

"""Speculative sampling in distribution on a real model and prompts never tuned on: the tokens that
rejection-mode speculation (``--verify rejection``) produces inside its rounds follow target-only
sampling's distribution; a deliberately wrong rejection sampler is shown to fail the same test.

Seeded mode needs no such test: its ids equal target-only sampling's for every seed (the
invariance figures of ``scripts/sampling_figures.py``). Rejection mode is exact in distribution
only, so it is checked by a two-sample test: for each held-out chat prompt (the first
``--n-prompts`` of rakv/workloads/data/chat_heldout.jsonl, through the chat template), R requests of
the target alone (``kv``: an exact repeat samples its first token from stored logits, then one token
per step) against R requests of ``joint:K`` with rejection verification, each arm on its own range of
seeds. Output positions 1..M (position 0 comes from the stored logits in both arms; the later ones
come out of speculative rounds) are compared one by one: a chi-square test of homogeneity on the
token counts, cells whose expected count is below 5 pooled. The significance is ALPHA = 1e-3 for a
whole arm (Bonferroni over prompts x positions). p-values use the Wilson-Hilferty normal
approximation of the chi-square tail, accurate to a few percent of p at these sizes.

The wrong arm runs the same test with a deliberate mistake (``--wrong``): ``ignore_q`` accepts a
drafted token x with probability p(x) instead of min(1, p(x) / q(x)) (likely tokens rejected too
often, the residual max(0, p - q) over-produced); ``accept_always`` accepts every drafted token
(the draft's own distribution). A mistake the test cannot see at this sample size says how much
power it has: the bias of each mistake grows with the draft's distance from the target. (Another classic mistake, resampling a rejected position from
p instead of the residual, biases the output by about the acceptance rate times the draft's
distance from the target: too small to see in a few hundred samples with either draft here.) Usage:

    python scripts/sampling_distribution.py [--drafts int8,layers:6] [--temperature 1.0]
        [--n-prompts 2] [--samples 400] [--positions 3] [--k 4] [--arms rejection,wrong]
        [--wrong ignore_q|accept_always]
        [--threads N] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rakv.decoding import sampling as S  # noqa: E402
from rakv.common import quiet_libs  # noqa: E402
from rakv.config import RakvConfig  # noqa: E402
from rakv.drafts.registry import make_draft  # noqa: E402
from rakv.engine import Engine  # noqa: E402
from rakv.load.hub import load_model  # noqa: E402
from rakv.config import Sampling  # noqa: E402

ALPHA = 1e-3
SEED_BASE = {"target": 1_000_000, "rejection": 2_000_000, "wrong": 3_000_000}


def held_out(n: int) -> list[str]:
    lines = (ROOT / "rakv/workloads/data/chat_heldout.jsonl").read_text().splitlines()
    return [json.loads(x)["prompt"] for x in lines if x.strip()][:n]


def chi2_sf_wh(stat: float, dof: int) -> float:
    """P(X > stat) for X ~ chi-square(dof), Wilson-Hilferty: (X / dof)^(1/3) is about normal."""
    if dof <= 0:
        return 1.0
    m, v = 1 - 2 / (9 * dof), 2 / (9 * dof)
    z = ((stat / dof) ** (1 / 3) - m) / math.sqrt(v)
    return 0.5 * math.erfc(z / math.sqrt(2))


def homogeneity_p(a: dict, b: dict) -> tuple[float, int]:
    """Two-sample chi-square test that token counts a and b come from one distribution: (p, dof)."""
    na, nb = sum(a.values()), sum(b.values())
    n = na + nb
    cells, pooled = [], [0, 0]
    for t in set(a) | set(b):
        ca, cb = a.get(t, 0), b.get(t, 0)
        if min(na, nb) * (ca + cb) / n >= 5:
            cells.append((ca, cb))
        else:
            pooled[0] += ca
            pooled[1] += cb
    if sum(pooled):
        cells.append(tuple(pooled))
    if len(cells) < 2:
        return 1.0, 0
    stat = 0.0
    for ca, cb in cells:
        ea, eb = na * (ca + cb) / n, nb * (ca + cb) / n
        stat += (ca - ea) ** 2 / ea + (cb - eb) ** 2 / eb
    return chi2_sf_wh(stat, len(cells) - 1), len(cells) - 1


def tokens_by_position(target, draft_spec: str, policy: str, s: Sampling, prompt: str, R: int,
                       positions: int) -> tuple[list[dict], float]:
    """R requests of one prompt on one engine (seeds s.seed .. s.seed + R - 1): token counts at
    output positions 1..positions, and the acceptance (accepted / drafted) of its rounds."""
    config = RakvConfig(policy=policy, sampling=s, max_new_tokens=positions + 1)
    draft = make_draft(draft_spec, target, config) if policy != "kv" else None
    rounds = []
    eng = Engine(target, draft, config,
                 callback=lambda r: rounds.append(r) if getattr(r, "type", "") == "round" and r.kind == "spec" else None)
    counts = [dict() for _ in range(positions)]
    for _ in range(R):
        out = eng.generate(prompt).output_ids
        for j in range(1, min(len(out), positions + 1)):
            counts[j - 1][out[j]] = counts[j - 1].get(out[j], 0) + 1
    drafted = sum(r.drafted for r in rounds)
    return counts, (sum(r.accepted for r in rounds) / drafted if drafted else float("nan"))


def accept_ignoring_q(log_p: float, log_q: float) -> float:
    """A deliberate mistake: a drafted token accepted with probability p(x), not min(1, p(x) / q(x))."""
    return math.exp(log_p)


def accept_always(log_p: float, log_q: float) -> float:
    """A deliberate mistake: every drafted token accepted (the test forgotten): the draft's distribution."""
    return 1.0


WRONG = {"ignore_q": accept_ignoring_q, "accept_always": accept_always}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="demo")
    ap.add_argument("--drafts", default="int8,layers:6")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--n-prompts", type=int, default=2)
    ap.add_argument("--samples", type=int, default=400, help="requests per arm and prompt")
    ap.add_argument("--positions", type=int, default=3, help="output positions compared (1..M)")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--arms", default="rejection,wrong", help="rejection (the real sampler), wrong (the mistake)")
    ap.add_argument("--wrong", default="ignore_q", choices=sorted(WRONG), help="which mistake the wrong arm makes")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    quiet_libs()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    target = load_model(args.target)
    prompts = held_out(args.n_prompts)
    tests = len(prompts) * args.positions
    out = {"date": time.strftime("%Y-%m-%d"), "temperature": args.temperature, "samples": args.samples,
           "positions": args.positions, "k": args.k, "alpha": ALPHA, "bonferroni_tests": tests, "rows": []}
    T = args.temperature
    refs = [tokens_by_position(target, "none", "kv", Sampling(T, seed=SEED_BASE["target"] + 10_000 * pi), prompt,
                               args.samples, args.positions)[0] for pi, prompt in enumerate(prompts)]
    for d in args.drafts.split(","):
        for arm in args.arms.split(","):
            worst, t0, accs = 1.0, time.perf_counter(), []
            for pi, prompt in enumerate(prompts):
                ref = refs[pi]
                real = S._accept_probability
                if arm == "wrong":
                    S._accept_probability = WRONG[args.wrong]
                try:
                    got, acc = tokens_by_position(target, d, f"joint:{args.k}",
                                                  Sampling(T, seed=SEED_BASE[arm] + 10_000 * pi, verify="rejection"),
                                                  prompt, args.samples, args.positions)
                finally:
                    S._accept_probability = real
                accs.append(acc)
                for j in range(args.positions):
                    p, dof = homogeneity_p(ref[j], got[j])
                    worst = min(worst, p)
                    out["rows"].append({"draft": d, "arm": arm, "prompt": pi, "position": j + 1, "p": p, "dof": dof})
            verdict = "holds" if worst >= ALPHA / tests else "FAILS"
            row = {"draft": d, "arm": arm if arm != "wrong" else f"wrong:{args.wrong}", "min_p": worst, "threshold": ALPHA / tests, "verdict": verdict,
                   "acceptance": [round(a, 3) for a in accs], "seconds": round(time.perf_counter() - t0, 1)}
            out.setdefault("verdicts", []).append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

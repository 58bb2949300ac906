"""Acceptance against temperature, seeded against rejection verification, and seed-exactness on
held-out prompts: the figures behind docs/results.md's sampling section.

For each draft (int8, layers:L, n-gram) and temperature, every held-out chat prompt
(rakv/workloads/data/chat_heldout.jsonl, never used for tuning) runs through the chat template with a
fixed k under both verification modes, and once with ``ar`` (target only). It reports the per-token
acceptance (accepted drafts / Bernoulli trials) of each mode, whether the seeded run's ids equal
``ar``'s for the same seed (they must: 0 mismatches), and the tokens per second of each arm (timing
is secondary here: a shared machine makes it noisy; the bench measures speed). Usage:

    python scripts/sampling_figures.py [--target demo] [--drafts int8,layers:6,ngram]
        [--temperatures 0,0.3,0.7,1.0] [--k 4] [--n-prompts 8] [--max-new-tokens 32] [--threads N]
        [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rakv.util.acceptance import trials  # noqa: E402
from rakv.common import quiet_libs  # noqa: E402
from rakv.config import RakvConfig  # noqa: E402
from rakv.drafts.registry import make_draft  # noqa: E402
from rakv.engine import Engine  # noqa: E402
from rakv.load.hub import load_model  # noqa: E402
from rakv.records import Round  # noqa: E402
from rakv.config import Sampling  # noqa: E402


def prompts(n: int) -> list[str]:
    lines = (ROOT / "rakv/workloads/data/chat_heldout.jsonl").read_text().splitlines()
    return [json.loads(x)["prompt"] for x in lines if x.strip()][:n]


def run_arm(target, draft_spec: str, policy: str, s: Sampling, texts, n: int, seed: int) -> dict:
    """One engine over the prompts: ids per prompt, acceptance (accepted / trials), tokens/s."""
    config = RakvConfig(policy=policy, sampling=Sampling(**{**s.to_dict(), "seed": seed}), max_new_tokens=n)
    rounds: list[Round] = []
    eng = Engine(target, make_draft(draft_spec, target, config) if policy != "ar" else None, config,
                 callback=lambda r: rounds.append(r) if isinstance(r, Round) and r.kind == "spec" else None)
    ids, toks, secs = [], 0, 0.0
    for p in texts:
        t0 = time.perf_counter()
        end = eng.generate(p)
        secs += time.perf_counter() - t0
        ids.append(end.output_ids)
        toks += len(end.output_ids)
    acc = sum(r.accepted for r in rounds)
    tri = sum(trials(r.accepted, r.drafted) for r in rounds)
    return {"ids": ids, "accepted": acc, "trials": tri, "alpha": round(acc / tri, 4) if tri else None,
            "tokens_per_s": round(toks / secs, 2) if secs else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="demo")
    ap.add_argument("--drafts", default="int8,layers:6,ngram")
    ap.add_argument("--temperatures", default="0,0.3,0.7,1.0")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--n-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    quiet_libs()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    target = load_model(args.target)
    texts = prompts(args.n_prompts)
    policy = f"spec:{args.k}"
    out = {"target": args.target, "k": args.k, "n_prompts": len(texts), "max_new_tokens": args.max_new_tokens,
           "date": time.strftime("%Y-%m-%d"), "rows": []}
    for T in [float(x) for x in args.temperatures.split(",")]:
        ref = run_arm(target, "none", "ar", Sampling(temperature=T), texts, args.max_new_tokens, args.seed)
        for d in args.drafts.split(","):
            row = {"draft": d, "temperature": T, "ar_tokens_per_s": ref["tokens_per_s"]}
            for mode in ("seeded", "rejection") if T > 0 else ("seeded",):
                r = run_arm(target, d, policy, Sampling(temperature=T, verify=mode), texts, args.max_new_tokens,
                            args.seed)
                row[mode] = {k: v for k, v in r.items() if k != "ids"}
                if mode == "seeded":
                    row["seeded"]["mismatches"] = sum(a != b for a, b in zip(r["ids"], ref["ids"]))
            print(json.dumps(row), flush=True)
            out["rows"].append(row)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

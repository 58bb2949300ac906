"""``ar`` decode against llama.cpp's on the same GGUF file, interleaved, and the engine's ids against
transformers' greedy decoding of that file on held-out prompts.

    python scripts/peer_ar.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf \
        --llama-bench path/to/llama.cpp/build/bin/llama-bench --threads 2 --reps 7 --tokens 64

Speed: each rep runs ``llama-bench -t T -p 0 -n N -r 1`` (batch-1 decode tokens/s of N tokens from an
empty context, its own timing) and then the engine's ``ar`` on N tokens after a 1-token prompt (the
BOS, or token 1), timed from the first decode step to the last (decode tokens/s, as llama-bench's
tg), alternating which goes first; figures are per-rep ratios, their median and a bootstrap 95%
interval. Exactness: the first ``--n-heldout`` held-out chat prompts (``chat_heldout.jsonl``,
through the chat template), ``--exact-tokens`` new tokens each, engine ``ar`` against
``generate(do_sample=False)`` of transformers' own loading of the file (``gguf_file=``). Prints one
JSON object (``--out`` writes it too) with the machine's ISA flags.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def llama_bench(exe: str, gguf: str, threads: int, n: int) -> float:
    out = subprocess.run([exe, "-m", gguf, "-t", str(threads), "-p", "0", "-n", str(n), "-r", "1", "-o", "json"],
                         capture_output=True, text=True, check=True).stdout
    return float(json.loads(out)[0]["avg_ts"])


def engine_decode(engine, n: int) -> float:
    """Decode tokens/s of one ar request of n tokens: (n - 1) steps over the time after the first token."""
    from rakv.records import Round

    t = []
    engine.callback = lambda r: t.append(time.perf_counter()) if isinstance(r, Round) else None
    end = engine.generate([1], n)
    assert len(end.output_ids) == n, "the request stopped early (EOS): pick another prompt"
    return (n - 1) / (t[-1] - t[0])


def bootstrap(xs: list[float], reps: int = 2000) -> tuple[float, float]:
    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(reps))
    return meds[int(0.025 * reps)], meds[int(0.975 * reps)]


def exactness(target, gguf: str, n_prompts: int, n_tokens: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from rakv.workloads import chat_prompts
    from rakv.config import RakvConfig
    from rakv.engine import Engine

    path = Path(gguf)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    eng = Engine(target, None, RakvConfig(policy="ar", chat_template=True))
    same = 0
    prompts = chat_prompts("chat-heldout")[:n_prompts]
    for text in prompts:
        ids = eng.encode(text)
        mine = eng.generate(ids, n_tokens).output_ids
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=n_tokens, do_sample=False,
                              eos_token_id=sorted(target.eos_ids))[0, len(ids):].tolist()
        same += mine == ref
    return {"prompts": len(prompts), "tokens": n_tokens, "same_ids": same}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--llama-bench", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--n-heldout", type=int, default=10)
    ap.add_argument("--exact-tokens", type=int, default=48)
    ap.add_argument("--numerics", default="auto", help="auto (q8 for a GGUF), q8 or fp32")
    ap.add_argument("--out")
    a = ap.parse_args()

    import torch

    from rakv.config import RakvConfig
    from rakv.util.device import isa_flags
    from rakv.engine import Engine
    from rakv.load.hub import load_model

    torch.set_num_threads(a.threads)
    target = load_model(a.gguf, numerics=a.numerics)
    eng = Engine(target, None, RakvConfig(policy="ar"))
    engine_decode(eng, a.tokens)                                  # warm-up apart
    llama_bench(a.llama_bench, a.gguf, a.threads, a.tokens)
    mine, peer = [], []
    for i in range(a.reps):
        if i % 2:
            mine.append(engine_decode(eng, a.tokens))
            peer.append(llama_bench(a.llama_bench, a.gguf, a.threads, a.tokens))
        else:
            peer.append(llama_bench(a.llama_bench, a.gguf, a.threads, a.tokens))
            mine.append(engine_decode(eng, a.tokens))
        print(f"[peer_ar] rep {i}: engine {mine[-1]:.1f} tok/s, llama.cpp {peer[-1]:.1f} tok/s", file=sys.stderr)
    ratios = [m / p for m, p in zip(mine, peer)]
    res = {
        "gguf": Path(a.gguf).name, "threads": a.threads, "tokens": a.tokens, "reps": a.reps,
        "engine_tok_s": [round(x, 1) for x in mine], "llamacpp_tok_s": [round(x, 1) for x in peer],
        "engine_median": round(statistics.median(mine), 1), "llamacpp_median": round(statistics.median(peer), 1),
        "ratio_median": round(statistics.median(ratios), 3), "ratio_ci95": [round(x, 3) for x in bootstrap(ratios)],
        "numerics": target.numerics, "isa": " ".join(isa_flags()), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    if a.n_heldout > 0 and target.numerics == "fp32":      # (q8 is not transformers' arithmetic)
        res["exact"] = exactness(target, a.gguf, a.n_heldout, a.exact_tokens)
    print(json.dumps(res))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

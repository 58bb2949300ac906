"""The engine's `ar` ids (lean forward, C layers, block codes) against transformers' own greedy
`generate` on the plain fp32 weights of the same model (the folder the loader converted a GGUF
into, or the checkpoint itself), on the held-out chat prompts, chat-templated (docs/results.md).

    .venv/bin/python scripts/ids_vs_transformers.py --target FILE.gguf --n 12 --max-new-tokens 48

Prints one line a prompt and the count of prompts whose ids are the same; exit status 0 when all are.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rakv.bench import bench_config, build_parser, load_session  # noqa: E402
from rakv.workloads import chat_prompts  # noqa: E402
from rakv.config import RakvConfig  # noqa: E402
from rakv.engine import Engine  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n", type=int, default=12, help="held-out chat prompts")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    a = ap.parse_args()
    args, _ = build_parser().parse_known_args(["--target", a.target, "--threads", str(a.threads)])
    args.draft = "none"
    target = load_session(args, bench_config(args, {"k_set": [0]})).target
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(target.model.config._name_or_path, dtype=torch.float32).eval()
    eng = Engine(target, None, RakvConfig(policy="ar"))
    eos = sorted(target.eos_ids)
    same = 0
    prompts = chat_prompts("chat-heldout")[: a.n]
    for i, p in enumerate(prompts):
        ids = eng.encode_prompt(p).ids
        got = list(eng.generate(p, a.max_new_tokens).output_ids)
        x = torch.tensor([ids])
        with torch.inference_mode():
            out = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                              max_new_tokens=a.max_new_tokens, eos_token_id=eos, pad_token_id=eos[0])
        want = out[0, len(ids):].tolist()
        ok = got == want
        same += ok
        print(f"{i:3d} {'same' if ok else 'DIFFERENT'}: {len(got)} tokens (transformers {len(want)})", flush=True)
    print(f"{same} of {len(prompts)} held-out prompts: `ar` ids = transformers' greedy")
    return 0 if same == len(prompts) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Decode speed with and without a co-tenant: one busy core elsewhere (a Python spin loop), as a
server's clients or the explorer's GUI thread would be, against the same decode on a quiet machine.

    python scripts/cotenant.py --target demo --tokens 128 --repeats 3 [--arm NAME:VAR=VAL,threads=N ...]

Arms: "adaptive" (the engine as shipped: no --threads, the count adapts, rakv/util/threads.py) and
"pinned N" (--threads N, N = this machine's cores: the count before it adapted), then any --arm
("NAME:" alone is the adaptive count again: an A/A pair). Each arm runs `rakv generate --policy ar
--json` in a fresh process (its environment as given), the quiet and the busy runs interleaved,
each repeat starting with the next arm; prints tokens/s (the median over repeats) for each arm
quiet and beside the spin loop, their ratio, and the thread switches. Run it on an otherwise quiet
machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."


def decode_tok_s(target: str, tokens: int, env: dict, threads: int | None) -> tuple[float, int]:
    """One fresh process's decode speed (tokens after the first over the time after it) and how many
    times its thread count switched."""
    argv = [sys.executable, "-m", "rakv", "generate", "--target", target, "--draft", "none", "--policy", "ar",
            "--max-new-tokens", str(tokens), "--json", "--prompt", PROMPT]
    if threads:
        argv += ["--threads", str(threads)]
    p = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, **env}, cwd=ROOT, timeout=900)
    if p.returncode != 0:
        raise SystemExit(f"rakv generate failed: {p.stderr.strip().splitlines()[-1] if p.stderr.strip() else p.returncode}")
    j = json.loads(p.stdout.strip().splitlines()[-1])
    n = len(j["output_ids"]) - 1
    return n / ((j["latency_ms"] - j["ttft_ms"]) / 1e3), int(j.get("thread_switches", 0))


def spin() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="demo")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--arm", action="append", default=[],
                    help="NAME:VAR=VAL,VAR=VAL or NAME:threads=1 (repeatable; default: the engine as shipped)")
    a = ap.parse_args()
    cores = len(os.sched_getaffinity(0))
    arms = {"adaptive": ({}, None), f"pinned {cores}": ({}, cores)}
    for spec in a.arm:
        name, _, kv = spec.partition(":")
        env, threads = {}, None
        for item in filter(None, kv.split(",")):
            k, _, v = item.partition("=")
            if k == "threads":
                threads = int(v)
            else:
                env[k] = v
        arms[name] = (env, threads)
    res = {name: {"quiet": [], "busy": [], "switches": []} for name in arms}
    names = list(arms)
    for r in range(a.repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:      # each repeat starts with another arm
            env, threads = arms[name]
            tok_s, sw = decode_tok_s(a.target, a.tokens, env, threads)
            res[name]["quiet"].append(tok_s)
            res[name]["switches"].append(sw)
            s = spin()
            try:
                tok_s, sw = decode_tok_s(a.target, a.tokens, env, threads)
                res[name]["busy"].append(tok_s)
                res[name]["switches"].append(sw)
            finally:
                s.kill()
                s.wait()
            print(f"[cotenant] repeat {r + 1}: {name}: quiet {res[name]['quiet'][-1]:.1f}, "
                  f"busy {res[name]['busy'][-1]:.1f} tok/s (thread switches {res[name]['switches'][-2]}, "
                  f"{res[name]['switches'][-1]})", file=sys.stderr, flush=True)
    base = statistics.median(res[f"pinned {cores}"]["quiet"])
    print(f"| arm | quiet tok/s | beside a busy core | busy / quiet | busy / pinned {cores} quiet | switches quiet, busy |")
    print("|---|---|---|---|---|---|")
    for name, r in res.items():
        q, b = statistics.median(r["quiet"]), statistics.median(r["busy"])
        sw = f"{statistics.median(r['switches'][0::2]):g}, {statistics.median(r['switches'][1::2]):g}"
        print(f"| {name} | {q:.1f} | {b:.1f} | {b / q:.2f} | {b / base:.2f} | {sw} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

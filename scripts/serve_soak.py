"""Many requests through one `rakv serve --parallel P`, in random arrival orders: every answer equal to
the same request answered alone, and the server's resident memory over the run.

    python scripts/serve_soak.py --target demo --draft ngram --parallel 4 --clients 8 --requests 1000 \
        --out soak/          [--policy adaptive] [--max-tokens 24]

Half the requests are greedy, half seeded (temperature 0.8, top_p 0.95, a seed each); prompts are the
shipped chat and code workloads, each request one of them at random with a random max_tokens up to
--max-tokens. Phase 1 sends them all from --clients closed-loop clients (requests join and leave
the batch at random points); phase 2 sends every distinct (prompt, max_tokens, seed) once more, one
at a time, as the solo reference. Prints the mismatches (0 expected), RSS at every 100 requests
(KB, /proc/PID/status VmRSS) and tokens/s; writes OUT/soak.json. Loopback only; bounded in count.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rakv.bench.load import rakv_server, stop  # noqa: E402


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def prompts() -> list[str]:
    """The shipped chat and code prompts (rakv/workloads/data)."""
    import rakv.workloads

    data = Path(rakv.workloads.__file__).parent / "data"
    out = []
    for name in ("chat.jsonl", "code.jsonl"):
        for line in (data / name).read_text().splitlines():
            if line.strip():
                out.append(json.loads(line)["prompt"])
    return out


def ask(url: str, req: dict) -> dict:
    import urllib.request

    body = {"prompt": req["prompt"], "max_tokens": req["max_tokens"]}
    if req["seed"] is not None:
        body.update(temperature=0.8, top_p=0.95, seed=req["seed"])
    else:
        body.update(temperature=0)
    r = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                               headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(r, timeout=600) as resp:
        j = json.loads(resp.read())
    return {"text": j["choices"][0]["text"], "ids": j["rakv"]["output_ids"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="demo")
    ap.add_argument("--draft", default="ngram")
    ap.add_argument("--policy", default="adaptive")
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="soak")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    ps = prompts()
    reqs = [{"prompt": rng.choice(ps), "max_tokens": rng.randint(1, a.max_tokens),
             "seed": rng.randrange(1 << 30) if i % 2 else None} for i in range(a.requests)]
    spec = rakv_server(a.target, a.draft, a.parallel, a.policy,
                       extra=["--max-queue", str(a.requests), "--max-new-tokens", str(a.max_tokens)])
    out = Path(a.out)
    proc, url = spec.start(out / "logs")
    try:
        got: dict[int, dict] = {}
        rss = [(0, rss_kb(proc.pid))]
        lock = threading.Lock()
        nxt = [0]

        def client():
            while True:
                with lock:
                    if nxt[0] >= len(reqs):
                        return
                    i = nxt[0]
                    nxt[0] += 1
                time.sleep(rng.random() * 0.02)          # arrivals at random points of the others' rounds
                res = ask(url, reqs[i])
                with lock:
                    got[i] = res
                    if len(got) % 100 == 0:
                        rss.append((len(got), rss_kb(proc.pid)))
                        print(f"[soak] {len(got)} answered, RSS {rss[-1][1]} KB", file=sys.stderr, flush=True)

        t0 = time.perf_counter()
        threads = [threading.Thread(target=client) for _ in range(a.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        print(f"[soak] phase 1: {len(got)} requests in {wall:.1f} s; now each distinct one alone", file=sys.stderr)
        solo: dict[str, dict] = {}
        bad = []
        for i, r in enumerate(reqs):
            key = json.dumps([r["prompt"], r["max_tokens"], r["seed"]])
            if key not in solo:
                solo[key] = ask(url, r)
            if solo[key]["ids"] != got[i]["ids"]:
                bad.append(i)
        rss.append((len(reqs), rss_kb(proc.pid)))
        res = {"requests": len(reqs), "mismatches": len(bad), "mismatched": bad[:20], "distinct": len(solo),
               "seeded": sum(r["seed"] is not None for r in reqs), "phase1_wall_s": round(wall, 2),
               "rss_kb": rss, "args": vars(a)}
        out.mkdir(parents=True, exist_ok=True)
        (out / "soak.json").write_text(json.dumps(res, indent=1))
        print(json.dumps({k: v for k, v in res.items() if k != "args"}))
        return 1 if bad else 0
    finally:
        stop(proc)


if __name__ == "__main__":
    sys.exit(main())

"""Servers under concurrent load (``rakv bench --load``): `rakv serve --parallel N` and llama.cpp's
`llama-server -np N` (with and without its draft ``-md``) started here on the same model files, each
driven by N closed-loop clients (rakv/bench/load.py), the servers in turn and the client counts
interleaved. Prints and writes (OUT/load.md, OUT/load.json) tokens/s, latency and TTFT p50 / p99
per server and client count, and how many answers differ from the one-client answer."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from rakv import argtypes as A

from .base import Peer

SERVERS = ("rakv", "rakv-ar", "rakv-kN", "llama", "llama-md")
FIXED_K = re.compile(r"rakv-k(0|[1-9][0-9]?)")     # rakv serve --policy joint:N (reuse, a fixed k; k0: kv)


def rakv_policy(server: str, policy: str) -> str | None:
    """The --policy a rakv arm serves with: rakv the given one, rakv-ar ar, rakv-kN joint:N (rakv-k0: kv,
    reuse without drafting); None: no rakv arm."""
    if server == "rakv":
        return policy
    if server == "rakv-ar":
        return "ar"
    m = FIXED_K.fullmatch(server)
    if m is None:
        return None
    return "kv" if m.group(1) == "0" else f"joint:{m.group(1)}"


def known_server(server: str) -> bool:
    return server in ("llama", "llama-md") or rakv_policy(server, "adaptive") is not None


def _int_list(text: str) -> list[int]:
    try:
        xs = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--clients {text!r}: expected comma-separated integers") from None
    if not xs or any(x < 1 or x > 64 for x in xs):
        raise ValueError(f"--clients {text!r}: each count between 1 and 64")
    return xs


def gguf_of(spec: str) -> Path | None:
    """The GGUF file behind a --target / --draft: a preset's (fetched once) or a .gguf path."""
    from rakv.load.presets import PRESETS, ensure_preset

    if spec in PRESETS:
        return ensure_preset(spec)
    p = Path(spec).expanduser()
    return p if p.suffix == ".gguf" and p.is_file() else None


def llama_arm(args, arm: str, flag: str, parallel: int, ctx_per_slot: int = 2048):
    """llama-server on the target's GGUF file (``llama-md``: with the draft's as ``-md``) for the
    bench's ``flag`` (--load, --edits): its ServerSpec; a missing binary or file is a ValueError of
    one line."""
    from ..load import llama_server, llama_server_binary

    binary = llama_server_binary()
    if binary is None:
        raise ValueError(f"{flag} llama: no llama-server (bash scripts/build_llama_cpp.sh builds it; "
                         "or set RAKV_LLAMA_SERVER)")
    target = gguf_of(args.target)
    if target is None:
        raise ValueError(f"{flag} {arm}: --target {args.target!r} is no preset nor .gguf file")
    draft = gguf_of(args.draft) if arm == "llama-md" else None
    if arm == "llama-md" and draft is None:
        raise ValueError(f"{flag} llama-md: --draft {args.draft!r} is no preset nor .gguf file")
    return llama_server(binary, str(target), parallel, str(draft) if draft else None,
                        threads=args.threads or 2, ctx_per_slot=ctx_per_slot)


def load_prompts(workload: str, n: int) -> list[str]:
    from rakv.workloads import CHAT_FILES

    path = CHAT_FILES.get(workload, Path(workload))
    if not Path(path).is_file():
        raise ValueError(f"--load: workload {workload!r} is none of {', '.join(CHAT_FILES)} nor a prompts file")
    lines = [x for x in Path(path).read_text(encoding="utf-8").splitlines() if x.strip()]
    out = [json.loads(x)["prompt"] if str(path).endswith(".jsonl") else x for x in lines]
    return out[:n]


class ServingPeer(Peer):
    name = "servers under load"

    def add_args(self, ap) -> None:
        g = ap.add_argument_group("servers under concurrent load (--load; docs/serve.md)")
        g.add_argument("--load", default=None, metavar="LIST",
                       help=f"measure servers instead of policies: comma-separated {', '.join(SERVERS)} (rakv: rakv serve "
                            "with the first --policies or adaptive; rakv-k4: rakv serve --policy joint:4 (a fixed k; rakv-k0: kv); "
                            "llama: llama-server -np N on --target's GGUF; llama-md: with --draft's GGUF as its -md)")
        g.add_argument("--clients", default="1,2,4,8", help="client counts (default 1,2,4,8)")
        g.add_argument("--load-parallel", type=A.int_range(1, 64), default=None,
                       help="requests each server decodes together (default: the largest --clients)")
        g.add_argument("--load-requests", type=A.int_range(1, 100_000), default=32,
                       help="requests per run (default 32)")
        g.add_argument("--load-trace", default=None, metavar="C:R,...",
                       help="a load that changes instead of --clients: phases of C clients over R requests, in "
                            "order on one server (e.g. 1:8,8:32,2:8); tokens/s per phase and overall")
        g.add_argument("--load-time-limit", type=A.finite_float(1), default=600.0,
                       help="seconds a run may take at most (default 600)")
        g.add_argument("--load-block-waves", type=A.int_range(1, 100), default=2, metavar="W",
                       help="with --load-alternate: blocks of W waves of the clients (W x clients requests; "
                            "default 2): more waves weigh each block's opening and drain less")
        g.add_argument("--load-lengths", default=None, metavar="MIN:MAX",
                       help="each prompt's max_tokens drawn from MIN..MAX (seeded: the same for every server) "
                            "instead of --max-new-tokens for all: answers of different lengths")
        g.add_argument("--load-alternate", action="store_true",
                       help="every server up at once, taking turns in blocks of 2 x clients requests "
                            "(the same prompts in a block): for a host whose speed drifts within minutes")

    def check(self, args) -> None:
        if not args.load:
            return
        bad = [s for s in args.load.split(",") if not known_server(s)]
        if bad:
            raise ValueError(f"--load: unknown server {bad[0]!r} (choose from {', '.join(SERVERS)}; N from 0 to 99)")
        _int_list(args.clients)
        if args.load_lengths:
            from ..load import answer_lengths

            answer_lengths(args.load_lengths, 1)
        if args.load_trace:
            from ..load import parse_trace

            parse_trace(args.load_trace)

    def takes_over(self, args) -> bool:
        return bool(args.load)

    def run_alone(self, args) -> int:
        from ..load import markdown, parse_trace, rakv_server, run_alternating, run_load, run_trace, summary_rows

        trace = parse_trace(args.load_trace) if args.load_trace else None
        clients = [c for c, _ in trace] if trace else _int_list(args.clients)
        parallel = args.load_parallel or max(clients)
        n_tokens = args.max_new_tokens or 64
        wanted = sum(n for _, n in trace) if trace else args.load_requests     # (no prompt twice where the file allows)
        prompts = load_prompts(args.workload.split(",")[0], max(8, args.n_prompts or wanted))
        if args.load_lengths:
            from ..load import answer_lengths

            lengths = answer_lengths(args.load_lengths, len(prompts), args.seed or 0)
            n_tokens = max(lengths)                  # (the servers' cap; each request asks its own)
        policy = (args.policies or ["adaptive"])[0]
        specs = []
        for s in args.load.split(","):
            pol = rakv_policy(s, policy)
            if pol is not None:
                extra = ["--max-new-tokens", str(n_tokens), "--max-queue", str(max(clients) * 4)]   # (a cap)
                if args.threads:
                    extra += ["--threads", str(args.threads)]
                specs.append(rakv_server(args.target, args.draft or "none", parallel, pol, extra,
                                         name=f"rakv {pol} --parallel {parallel}"))
            else:
                specs.append(llama_arm(args, s, "--load", parallel))
        asked = lengths if args.load_lengths else n_tokens
        out = Path(args.out)
        progress = lambda m: print(m, file=sys.stderr, flush=True)       # noqa: E731
        if trace:
            print(markdown(run_trace(specs, prompts, trace, asked, args.load_time_limit, out,
                                     repeats=args.repeats or 1, progress=progress)))
            return 0
        if args.load_alternate:
            runs = run_alternating(specs, prompts, clients, args.load_requests, asked, args.load_time_limit,
                                   out, progress=progress, waves=args.load_block_waves)
        else:
            runs = run_load(specs, prompts, clients, args.load_requests, asked, args.load_time_limit, out,
                            repeats=args.repeats or 1, progress=progress)
        print(markdown(summary_rows(runs)))
        if (out / "paired.md").is_file() and args.load_alternate:
            print("\nThe first server against each other one, block by block (median ratio, bootstrap 95% CI):")
            print((out / "paired.md").read_text().rstrip())
        return 0

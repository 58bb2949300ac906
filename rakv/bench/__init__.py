"""``rakv bench``: every policy and the transformers peers on the same seeded request streams.

    rakv bench [--target M] [--draft M]
               [--workload chat|chat-heldout|code|code-heldout|conversation|conversation-heldout|wikitext|humaneval|repetitive|mixed|FILE]
               [--policies ...] [--repeats R] [--out DIR] [--quick] [--raw] [--prompts WIKITEXT_FILE]
    rakv bench --edits rakv,rakv-ar,llama,llama-md [--edits-set tuning|heldout] [--out DIR]
    rakv bench --peer vllm --vllm-target DIR [--vllm-profile FILE] [--vllm-mode one|batched|both] [--out DIR]

Writes DIR/executions.csv (one row per timed execution), DIR/candidates.csv (the adaptive
policies' predicted cost of every action), DIR/summary.md, PNG plots, meta.json and the cost
profile used. Progress goes to stderr. See docs/results.md. The peers (transformers, llama.cpp,
vLLM) are rakv/bench/peers/, one interface; ``--peer vllm``: the RAKV proposer against vLLM's own
arms on a vLLM engine instead (``rakv/bench/peers/vllm.py``, docs/vllm.md).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from rakv import argtypes as A

from rakv.workloads import ALL_WORKLOADS, WIKITEXT_ENV, WIKITEXT_HELP, WORKLOADS
from rakv.util.paths import env_text

OUTPUT_FILES = ("executions.csv", "candidates.csv", "summary.md", "meta.json", "profile.json", "latency.png",
                "predicted_vs_measured.png", "speedup_vs_alpha.png", "llama_cpp.json")

QUICK = dict(buckets="32,128", gens="32", n_prompts=4, repeats=1, k_set="0,2,4")
# --quick's policies (unless --policies): the baselines, the paper's Joint-k4, the controller and one
# transformers peer; the full default adds spec:K / joint:K for every K, adaptive:round and more peers
QUICK_POLICIES = ("ar", "kv", "joint:4", "adaptive:request", "hf:assist")
FULL = dict(buckets="32,128,512", gens="32,128", n_prompts=8, repeats=2, k_set="0,1,2,4,6,8")
TINY = dict(buckets="16,48", gens="8", n_prompts=4, repeats=1, k_set="0,2,4")


class _Parser(argparse.ArgumentParser):
    def error(self, message):          # one line through main's guard, not usage + exit
        raise ValueError(message)


def build_parser() -> argparse.ArgumentParser:
    from rakv.common import add_model_args, add_sampling_args

    ap = _Parser(prog="rakv bench", description=__doc__.split("\n\n")[0])
    add_model_args(ap)
    add_sampling_args(ap, seed_flag="--sample-seed")
    ap.add_argument("--workload", default="chat",
                    help="chat (default; instruction prompts shipped with rakv) | chat-heldout | code (code "
                         "completions and edits shipped with rakv: Python, JavaScript, C, SQL, shell) | code-heldout | "
                         "conversation "
                         "(multi-turn conversations shipped with rakv; reuse and latency per turn) | "
                         "conversation-heldout | wikitext "
                         "(needs --prompts) | humaneval | repetitive | mixed (needs --prompts) | a prompts FILE; "
                         "comma-separate several")
    ap.add_argument("--raw", action="store_true",
                    help="chat workloads: send the instructions as they are (default: through the tokenizer's "
                         "chat template, if it has one)")
    ap.add_argument("--policies", nargs="+", default=None,
                    help="ar kv spec:K joint:K adaptive adaptive:request adaptive:round adaptive:gate adaptive:nogate hf:assist hf:confidence hf:lookup "
                         "(default: ar, kv, spec:K and joint:K for each K, both adaptive, the peers)")
    ap.add_argument("--repeats", type=A.int_range(1), default=None, help="replays of every stream with fresh engines "
                    f"(default {FULL['repeats']}; --quick {QUICK['repeats']})")
    ap.add_argument("--out", default="bench-out", help="output directory (default bench-out)")
    ap.add_argument("--quick", action="store_true",
                    help=f"a few minutes: {QUICK['n_prompts']} requests per stream, N {QUICK['gens']}, "
                         f"{QUICK['repeats']} repeat, K {QUICK['k_set']}, policies {', '.join(QUICK_POLICIES)} "
                         f"(those that apply to the draft), buckets {QUICK['buckets']}, a quick calibration")
    ap.add_argument("--buckets", default=None, help=f"prompt-length buckets in tokens (default {FULL['buckets']})")
    ap.add_argument("--gens", default=None, help=f"generation lengths (default {FULL['gens']})")
    ap.add_argument("--max-new-tokens", type=A.int_range(1), default=None, help="one generation length (overrides --gens)")
    ap.add_argument("--n-prompts", type=A.int_range(1), default=None, help=f"requests per stream (default {FULL['n_prompts']})")
    ap.add_argument("--prompts", default=None,
                    help="WikiText-2 raw file (wiki.test.raw) for the wikitext and mixed workloads "
                         "(default: $RAKV_WIKITEXT; not shipped, CC BY-SA)")
    ap.add_argument("--seed", type=A.int_range(0), default=0)
    ap.add_argument("--k-set", default=None, help=f"K for the policies and the controller (default {FULL['k_set']})")
    from .peers import PEERS

    for peer in PEERS:
        peer.add_args(ap)
    from .edits import add_args as add_edit_args

    add_edit_args(ap)
    ap.add_argument("--lookup-k", type=A.int_range(1, 64), default=None, help="prompt_lookup_num_tokens (default: max K)")
    ap.add_argument("--budget-mib", type=A.finite_float(0), default=512.0)
    ap.add_argument("--recalibrate", action="store_true", help="measure the cost profile again before running")
    ap.add_argument("--dry-run", action="store_true", help="print the plan (streams, policies, executions) and exit")
    ap.add_argument("--no-progress", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--report-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--resume", action="store_true",
                    help="keep the streams already complete in --out and run only the rest "
                         "(a long grid can span several sittings; same flags required)")
    return ap


def int_list(text: str, what: str, lo: int = 1) -> list[int]:
    try:
        xs = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"bad {what} {text!r}: expected comma-separated integers") from None
    if not xs or any(x < lo for x in xs):
        raise ValueError(f"bad {what} {text!r}: expected integers >= {lo}")
    return sorted(set(xs))


def settings(args) -> dict:
    from rakv.config import parse_k_set

    base = TINY if args.tiny else (QUICK if args.quick else FULL)
    pick = lambda name: getattr(args, name) if getattr(args, name) is not None else base[name]  # noqa: E731
    gens = [args.max_new_tokens] if args.max_new_tokens is not None else int_list(pick("gens"), "--gens")
    if gens[0] < 1:
        raise ValueError("--max-new-tokens must be >= 1")
    s = dict(buckets=int_list(pick("buckets"), "--buckets", 2), gens=gens, n_prompts=pick("n_prompts"),
             repeats=pick("repeats"), k_set=list(parse_k_set(pick("k_set"))))
    if s["n_prompts"] < 1:
        raise ValueError("--n-prompts must be >= 1")
    if s["repeats"] < 1:
        raise ValueError("--repeats must be >= 1")
    if args.lookup_k is not None and args.lookup_k < 1:
        raise ValueError("--lookup-k must be >= 1")
    if args.budget_mib < 0:
        raise ValueError("--budget-mib must be >= 0")
    s["workloads"] = parse_workloads(args.workload)
    if {"wikitext", "mixed"} & set(s["workloads"]) and not (args.prompts or env_text(WIKITEXT_ENV)):
        raise ValueError(WIKITEXT_HELP)        # before any model is loaded
    s["policies"] = policy_names(args.policies)
    check_out(args, s["workloads"])
    from .peers import PEERS

    for peer in PEERS:          # each peer's settings found (or one line) before any model loads
        peer.configure(args, s["policies"])
    return s


def check_out(args, workloads: list[str]) -> None:
    """--out must be a folder (or not exist yet) and none of the files it gets may be an input."""
    out = Path(args.out).expanduser()
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {args.out} is a file, not a folder")
    inputs = {"--workload": w for w in workloads if Path(w).is_file()}
    if args.prompts:
        inputs["--prompts"] = args.prompts
    for name in OUTPUT_FILES:
        A.refuse_overwrite(out / name, "--out", inputs)


def policy_names(raw: list[str] | None) -> list[str] | None:
    """--policies split on commas and checked before any model is loaded (None: the default set)."""
    from rakv.config import Policy

    from .peers import nameable
    from .runner import ADAPTIVE_ARMS

    if not raw:
        return None
    names = [n.strip().lower() for x in raw for n in x.split(",") if n.strip()]
    for n in names:
        if n not in ADAPTIVE_ARMS and not nameable(n):
            Policy.parse(n)
    if not names:
        raise ValueError("--policies is empty")
    return names


def parse_workloads(text: str) -> list[str]:
    names = [w.strip() for w in text.split(",") if w.strip()]
    if not names:
        raise ValueError("--workload is empty")
    for w in names:
        if w not in ALL_WORKLOADS and not Path(w).is_file():
            raise ValueError(f"unknown workload {w!r} (chat, chat-heldout, code, code-heldout, conversation, "
                             f"conversation-heldout, "
                             f"wikitext, humaneval, repetitive, mixed, or a prompts file)")
    return names


def bench_config(args, s: dict):
    """The bench's config: the model pair and its flags, K, the budget and the sampling (one seed
    for every arm); each arm's engine sets its own policy."""
    from rakv.common import device_kw, draft_vocab_of
    from rakv.config import RakvConfig

    return RakvConfig(target=args.target, draft=args.draft, revision=args.revision, dtype=args.dtype,
                      numerics=getattr(args, "numerics", "auto"), draft_vocab=draft_vocab_of(args),
                      draft_codes=getattr(args, "draft_codes", "auto") or "auto", threads=args.threads,
                      k_set=tuple(s["k_set"]), budget_mib=args.budget_mib, sampling=bench_sampling(args),
                      **device_kw(args))


def load_session(args, config):
    """The session of the bench's models (rakv.session.load; ``--tiny``: the tiny random pair);
    its profile comes once the arms are known."""
    from rakv.session import Session, load

    if args.tiny:
        from rakv.load.numerics import set_fast

        from .tiny import make_pair

        target, draft = make_pair(config.draft)
        set_fast(target, config.fast)
        if draft.has_model and draft.lm.fast:
            set_fast(draft.lm, config.fast)
        return Session(config, target, draft)
    return load(config)


def build_streams(s: dict, args, tokenizer, max_pos: int | None) -> dict:
    from rakv import workloads as W

    if tokenizer is None:
        raise ValueError("the bench needs a target with a tokenizer")
    n, seed = s["n_prompts"], args.seed
    sources: dict = {}

    def src(name):
        if name not in sources:
            sources[name] = {"wikitext": lambda: W.wikitext_source(args.prompts), "humaneval": W.humaneval_source,
                             "repetitive": lambda: W.repetitive_source(seed)}[name]()
        return sources[name]

    streams = {}
    for w in s["workloads"]:
        for g in s["gens"]:
            if w in W.CONVERSATION_WORKLOADS:
                st = W.conversation_stream(W.conversations(w), tokenizer, n, g, seed, raw=args.raw, name=w)
                longest = W.conversation_tokens(st, tokenizer, args.raw)
                if max_pos is not None and longest > max_pos:
                    raise ValueError(f"a {w} conversation can grow to {longest} tokens with {g} new tokens a "
                                     f"turn, beyond the model's context of {max_pos}")
                streams[f"{w}/N{g}"] = st
                continue
            if w in W.CHAT_WORKLOADS:
                st = W.chat_stream(W.chat_prompts(w), tokenizer, n, g, seed, raw=args.raw, name=w)
                longest = max(len(r.ids) for r in st)
                if max_pos is not None and longest + g > max_pos:
                    raise ValueError(f"a {w} prompt ({longest} tokens) + {g} new tokens exceeds the model's "
                                     f"context of {max_pos}")
                streams[f"{w}/N{g}"] = st
                continue
            if Path(w).is_file() and w not in ALL_WORKLOADS:
                cap = None if max_pos is None else max_pos - g
                streams[f"file/N{g}"] = W.file_stream(W.file_source(w), tokenizer, g, cap)
                continue
            for b in s["buckets"]:
                if max_pos is not None and b + g > max_pos:
                    raise ValueError(f"bucket {b} + {g} new tokens exceeds the model's context of {max_pos}")
                if w == "mixed":
                    streams[f"mixed/P{b}/N{g}"] = W.build_stream([src(x) for x in WORKLOADS], tokenizer, n, b, g,
                                                                 seed)
                else:
                    streams[f"{w}/P{b}/N{g}"] = W.build_stream(src(w), tokenizer, n, b, g, seed)
    return streams


def run(args, argv: list[str]) -> int:
    from rakv.common import quiet_libs
    from rakv.decide.profile import save_profile
    from rakv.util.paths import log


    from .peers import PEERS
    from .report import write_summary
    from .runner import Arm, BenchContext, default_arm_names, parse_arms, run_streams

    for peer in PEERS:
        peer.check(args)
    if args.edits is not None:     # the edit trace against /infill servers (rakv/bench/edits.py)
        from .edits import check as check_edits, run_cli as run_edits

        check_edits(args)
        return run_edits(args)
    alone = next((p for p in PEERS if p.takes_over(args)), None)
    if alone is not None:
        return alone.run_alone(args)
    out = Path(args.out)
    if args.report_only:
        if not (out / "executions.csv").exists():
            raise ValueError(f"no executions.csv in {out}")
        log(f"wrote {write_summary(out)}")
        return 0
    quiet_libs()
    s = settings(args)
    t_start = time.perf_counter()
    session = load_session(args, bench_config(args, s))
    target, draft = session.target, session.draft
    names = s["policies"] or default_arm_names(s["k_set"], args.peers, draft)
    if args.quick and not s["policies"]:
        names = [n for n in names if n in QUICK_POLICIES]
    arms = parse_arms(names, draft)
    for peer in PEERS:          # the arms a peer's own flags ask for (--peer-llama-cpp)
        arms += [Arm(n, peer=peer) for n in peer.added_arms(args, draft)]
    fixed_k = [a.action[1] for a in arms if a.action is not None]
    k_max = max(s["k_set"] + fixed_k + [1])
    lookup_k = args.lookup_k or max(s["k_set"] + [1])
    streams = build_streams(s, args, target.tokenizer, target.max_positions)
    if args.dry_run:
        return print_plan(streams, arms, s["repeats"])
    profile = session.calibrate(k_max, force=args.recalibrate, quick=args.quick or args.tiny)
    out.mkdir(parents=True, exist_ok=True)
    save_profile(profile, out / "profile.json")
    meta = run_meta(args, argv, s, target, draft, arms, lookup_k, streams, profile, session.config.sampling)
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    log(f"bench: {len(streams)} streams x {s['n_prompts']} requests x {s['repeats']} repeats x "
        f"{len(arms)} policies ({', '.join(a.name for a in arms)}) -> {out}")
    ctx = BenchContext(session, arms, lookup_k, raw=args.raw)
    n_exec, n_bad = run_streams(ctx, streams, s["repeats"], out, show_progress=not args.no_progress,
                                resume=args.resume)
    meta["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    meta["executions"], meta["mismatches"] = n_exec, n_bad
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    summary = write_summary(out)
    log(f"{n_exec} executions, {n_bad} mismatches vs ar, {meta['elapsed_s'] / 60:.1f} min; wrote {summary}")
    return 0


def print_plan(streams: dict, arms, repeats: int) -> int:
    n_req = sum(len(x) for x in streams.values())
    for name, st in streams.items():
        kinds = {k: sum(1 for r in st if r.kind == k) for k in ("unrelated", "shared", "repeat")}
        known = [len(r.ids) for r in st if r.ids]        # a conversation's later turns: built as it runs
        turns = f", {sum(1 for r in st if r.turn == 1)} conversations" if any(r.turn for r in st) else ""
        print(f"{name}: {len(st)} requests{turns}, prompt tokens {min(known)}-{max(known)}"
              f"{' (first turns)' if turns else ''}, {kinds}")
    print(f"policies ({len(arms)}): {', '.join(a.name for a in arms)}")
    print(f"timed executions: {n_req} requests x {repeats} repeats x {len(arms)} policies = {n_req * repeats * len(arms)}")
    return 0


def run_meta(args, argv, s, target, draft, arms, lookup_k, streams, profile=None, sampling=None) -> dict:
    import torch

    from rakv.prompts import has_chat_template
    from rakv.util.device import hardware_info, versions_info
    from rakv.decide.regime import regime

    return dict(command=shlex.join(["rakv", "bench", *argv]), target=target.name, draft=getattr(draft, "name", "none"),
                numerics=getattr(target, "numerics", "fp32"),
                draft_has_model=bool(getattr(draft, "has_model", False)), k_set=s["k_set"], lookup_k=lookup_k,
                policies=[a.name for a in arms], workloads=s["workloads"], buckets=s["buckets"], gens=s["gens"],
                n_prompts=s["n_prompts"], repeats=s["repeats"], seed=args.seed, streams=list(streams),
                chat_template=bool(not args.raw and has_chat_template(target.tokenizer)),
                threads=torch.get_num_threads(), hardware=hardware_info(), versions=versions_info(),
                device=str(next(target.model.parameters()).device), fast=bool(getattr(target, "fast", False)),
                started=time.strftime("%Y-%m-%dT%H:%M:%S"), elapsed_s=0.0,
                regime=None if profile is None else regime(profile),
                sampling=None if sampling is None else sampling.to_dict(),
                **peer_meta(args))


def peer_meta(args) -> dict:
    """What the peers add to meta.json (llama_cpp: what llama.cpp's tools ran, None without them)."""
    from .peers import PEERS

    out: dict = {}
    for peer in PEERS:
        out.update(peer.meta(args))
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    from rakv.common import resolve_draft

    args = resolve_draft(build_parser().parse_args(argv))
    return run(args, argv)


def bench_sampling(args):
    """The bench's sampling: one seed for every arm (drawn once when none is given), so request i
    of every arm samples with the same seed + i and the seeded arms can be checked against ar."""
    from dataclasses import replace

    from rakv.common import sampling_of
    from rakv.config import draw_seed

    s = sampling_of(args)
    return s if s.greedy or s.seed is not None else replace(s, seed=draw_seed())


"""``rakv bench``: every policy and the transformers peers on the same seeded request streams.

    rakv bench [--target M] [--draft M]
               [--workload chat|chat-heldout|code|code-heldout|conversation|conversation-heldout|wikitext|humaneval|repetitive|mixed|FILE]
               [--policies ...] [--repeats R] [--out DIR] [--quick] [--raw] [--prompts WIKITEXT_FILE]
    rakv bench --peer vllm --vllm-target DIR [--vllm-profile FILE] [--vllm-mode one|batched|both] [--out DIR]

Writes DIR/executions.csv (one row per timed execution), DIR/candidates.csv (the adaptive
policies' predicted cost of every action), DIR/summary.md, PNG plots, meta.json and the cost
profile used. Progress goes to stderr. See docs/results.md. ``--peer vllm``: the RAKV proposer
against vLLM's own arms on a vLLM engine instead (``rakv/bench/vllm_peer.py``, docs/vllm.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

from rakv import argtypes as A

from rakv.workloads import ALL_WORKLOADS, WIKITEXT_ENV, WIKITEXT_HELP, WORKLOADS

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
    ap.add_argument("--peers", action=argparse.BooleanOptionalAction, default=True,
                    help="include the transformers peers (hf:assist, hf:confidence, hf:lookup)")
    ap.add_argument("--peer-gguf", default=None, metavar="FILE",
                    help="a GGUF of the target's weights: adds the llama.cpp peer (needs llama-cpp-python)")
    ap.add_argument("--peer-llama-cpp", action="store_true",
                    help="add llama.cpp's own tools as peers on the same GGUF files, request by request: "
                         "llama.cpp:ar (llama-completion, greedy) and llama.cpp:spec:N (llama-speculative-simple "
                         "with the draft's file); needs a GGUF target (a preset or .gguf) and the tools "
                         "(bash scripts/build_llama_cpp.sh)")
    ap.add_argument("--llama-cpp-dir", default=None, metavar="DIR",
                    help="the folder holding llama-completion (or llama-cli) and llama-speculative-simple "
                         "(default: the build script's, in the cache dir)")
    ap.add_argument("--llama-cpp-draft-lengths", default=None, metavar="LIST",
                    help="llama.cpp:spec:N arms, N = --spec-draft-n-max (default 2,4,8,16)")
    from .vllm_peer import add_args as add_vllm_args

    add_vllm_args(ap)
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
    if {"wikitext", "mixed"} & set(s["workloads"]) and not (args.prompts or os.environ.get(WIKITEXT_ENV)):
        raise ValueError(WIKITEXT_HELP)        # before any model is loaded
    s["policies"] = policy_names(args.policies)
    from .peers import LlamaCppPeer

    if args.peer_gguf is not None and not Path(args.peer_gguf).expanduser().is_file():
        raise ValueError(f"--peer-gguf {args.peer_gguf}: no such file")
    LlamaCppPeer.configure(str(Path(args.peer_gguf).expanduser()) if args.peer_gguf else None)
    why = LlamaCppPeer.available() if "llama.cpp" in (s["policies"] or []) else None
    if why:
        raise ValueError(why)
    check_out(args, s["workloads"])
    from .llama_cli import configure

    if getattr(args, "peer_llama_cpp", False) and args.temperature:
        raise ValueError("--peer-llama-cpp runs llama.cpp greedy: use it with --temperature 0")
    s["llama_cpp"] = configure(args)          # tools and GGUF files found (or one line) before any model loads
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

    from .peers import PEERS
    from .runner import ADAPTIVE_ARMS

    if not raw:
        return None
    names = [n.strip().lower() for x in raw for n in x.split(",") if n.strip()]
    for n in names:
        if n not in ADAPTIVE_ARMS + PEERS:
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


def load_models(args, draft_spec: str):
    from rakv.common import device_kw, draft_vocab_of, load_pair
    from rakv.config import RakvConfig

    kw = device_kw(args)
    if args.tiny:
        from rakv.drafts import ModelDraft
        from rakv.models import set_fast

        from .tiny import make_pair

        target, draft = make_pair(draft_spec)
        set_fast(target, kw["fast"])
        if isinstance(draft, ModelDraft) and draft.lm.fast:
            set_fast(draft.lm, kw["fast"])
        return target, draft
    return load_pair(args, RakvConfig(target=args.target, draft=draft_spec, dtype=args.dtype,
                                      numerics=getattr(args, "numerics", "auto"), draft_vocab=draft_vocab_of(args), draft_codes=getattr(args, "draft_codes", "auto") or "auto",
                                      **kw))


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
    from rakv.common import device_kw, draft_vocab_of, get_profile, quiet_libs
    from rakv.config import RakvConfig
    from rakv.paths import log

    from rakv.costs import save_profile

    from .report import write_summary
    from .runner import BenchContext, default_arm_names, parse_arms, run_streams

    from . import vllm_peer

    vllm_peer.check_args(args)
    if args.peer == "vllm":
        return vllm_peer.run(args)
    out = Path(args.out)
    if args.report_only:
        if not (out / "executions.csv").exists():
            raise ValueError(f"no executions.csv in {out}")
        log(f"wrote {write_summary(out)}")
        return 0
    quiet_libs()
    s = settings(args)
    t_start = time.perf_counter()
    target, draft = load_models(args, args.draft)
    names = s["policies"] or default_arm_names(s["k_set"], args.peers, draft)
    if args.quick and not s["policies"]:
        names = [n for n in names if n in QUICK_POLICIES]
    arms = parse_arms(names, draft)
    if s.get("llama_cpp") is not None:
        from .runner import Arm

        lc = s["llama_cpp"]
        if lc.draft_gguf is None:
            log(f"--peer-llama-cpp: the draft {args.draft!r} is no GGUF file, so llama.cpp runs without "
                "speculation (llama.cpp:ar only)")
        arms += [Arm(n, peer=True) for n in lc.arm_names()]
    fixed_k = [a.action[1] for a in arms if a.action is not None]
    k_max = max(s["k_set"] + fixed_k + [1])
    lookup_k = args.lookup_k or max(s["k_set"] + [1])
    streams = build_streams(s, args, target.tokenizer, target.max_positions)
    if args.dry_run:
        return print_plan(streams, arms, s["repeats"])
    profile = get_profile(target, draft, k_max, force=args.recalibrate, quick=args.quick or args.tiny,
                          sampling=bench_sampling(args))
    out.mkdir(parents=True, exist_ok=True)
    save_profile(profile, out / "profile.json")
    config = RakvConfig(target=args.target, draft=args.draft, dtype=args.dtype, numerics=getattr(args, "numerics", "auto"),
                        draft_vocab=draft_vocab_of(args), draft_codes=getattr(args, "draft_codes", "auto") or "auto",
                        k_set=tuple(s["k_set"]),
                        budget_mib=args.budget_mib, sampling=bench_sampling(args), **device_kw(args))
    meta = run_meta(args, argv, s, target, draft, arms, lookup_k, streams, profile, config.sampling)
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    log(f"bench: {len(streams)} streams x {s['n_prompts']} requests x {s['repeats']} repeats x "
        f"{len(arms)} policies ({', '.join(a.name for a in arms)}) -> {out}")
    ctx = BenchContext(target, draft, config, profile, arms, lookup_k, raw=args.raw, llama_cpp=s.get("llama_cpp"))
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
    from rakv.device import hardware_info, versions_info
    from rakv.regime import regime

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
                llama_cpp=llama_cpp_meta(s.get("llama_cpp"), args))


def llama_cpp_meta(lc, args) -> dict | None:
    """What the llama.cpp peer ran: its tools, the files, the draft lengths, how the prompt was sent."""
    if lc is None:
        return None
    return dict(tools=str(lc.tools.folder), completion=lc.tools.completion.name, target_gguf=lc.target_gguf,
                draft_gguf=lc.draft_gguf, draft_lengths=list(lc.draft_lengths) if lc.draft_gguf else [],
                prompt=("the text of the ids our bench feeds every policy (decoded with the special tokens kept, "
                        "parsed by llama.cpp), " + ("raw" if args.raw else "through the chat template where "
                                                    "the workload uses it")),
                greedy=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    return run(args, argv)


def bench_sampling(args):
    """The bench's sampling: one seed for every arm (drawn once when none is given), so request i
    of every arm samples with the same seed + i and the seeded arms can be checked against ar."""
    from dataclasses import replace

    from rakv.common import sampling_of
    from rakv.config import draw_seed

    s = sampling_of(args)
    return s if s.greedy or s.seed is not None else replace(s, seed=draw_seed())


"""``rakv``: generate, calibrate, replay, bench. Logs and progress go to stderr; with --json,
stdout holds exactly one JSON object per request. Bad input: one line on stderr, exit 2."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from . import argtypes as A
from .common import (CliError, add_model_args, add_sampling_args, device_kw, draft_vocab_of, quiet_libs,  # noqa: F401
                     read_prompts, resolve_draft, sampling_of)
from .config import DEFAULT_K_SET, POLICIES_HELP, Policy, RakvConfig, parse_k_set
from .util.textstream import TextStream


def build_parser() -> argparse.ArgumentParser:
    ap = A.OneLineParser(prog="rakv", description="Exact speculative decoding with prefix KV reuse.")
    ap.add_argument("--version", action="version", version=f"rakv {package_version()}")
    sub = ap.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate for one or more prompts (one engine, one cache)")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    src.add_argument("--prompts-file", help=".jsonl with {\"prompt\": ...} per line, or one prompt per line")
    add_run_args(g)

    add_chat_parser(sub)

    from .serve import add_serve_parser

    add_serve_parser(sub, add_run_args)

    c = sub.add_parser("calibrate", help="measure this machine's costs for a model pair")
    add_model_args(c)
    c.add_argument("--k-max", type=A.int_range(1, 64), default=8)
    c.add_argument("--quick", action="store_true")
    c.add_argument("--json", action="store_true")
    c.add_argument("--check", action="store_true",
                   help="measure a few terms now and print how far the saved profile is from them")
    c.add_argument("--engine", choices=["rakv", "vllm"], default="rakv",
                   help="vllm: time a vLLM engine's steps (eager; --target a model folder vLLM loads; "
                        "--batch-sizes) and write a profile for its RAKV proposer (docs/vllm.md)")
    c.add_argument("--out", default=None, help="--engine vllm: the profile's path (default vllm-profile.json)")
    c.add_argument("--vllm-k", default="0,1,2,4,8", help="--engine vllm: the k timed")
    c.add_argument("--tokens", type=A.int_range(2, 4096), default=32, help="--engine vllm: steps a repeat")
    c.add_argument("--repeats", type=A.int_range(1, 100), default=3, help="--engine vllm: repeats per k")
    c.add_argument("--batch-sizes", default="1",
                   help="--engine vllm: the batch sizes timed, e.g. 1,2,4 (B same-length prompts generated "
                        "together; batch 1 is always timed)")
    c.add_argument("--vllm-draft", default=None, metavar="M",
                   help="--engine vllm: a model draft for the RAKV proposer, run by rakv in vLLM's worker "
                        "(demo, a preset, a .gguf, a folder; same tokenizer as the target; --numerics, "
                        "default q8): its acceptance on the engine goes into the profile")

    r = sub.add_parser("replay", help="derive a timing CSV from a recording")
    r.add_argument("file")
    r.add_argument("--csv", required=True, help="output CSV path (one row per request)")
    r.add_argument("--oracle-csv", default=None,
                   help="where the 'measure every action' rows go (default: OUT.oracle.csv beside --csv, "
                        "written only when the recording has oracle measurements)")

    v = sub.add_parser("advise", help="the speculative_config a serving engine's cost profile supports")
    v.add_argument("--engine", choices=["vllm"], default="vllm")
    v.add_argument("--profile", required=True,
                   help="a vLLM cost profile (python -m rakv.integrations.vllm_run calibrate; docs/vllm.md)")
    v.add_argument("--alpha", type=A.finite_float(0), default=None, help="the workload's per-token acceptance")
    v.add_argument("--metrics", default=None,
                   help="a vLLM server's URL or a saved /metrics text: the acceptance it measured")
    v.add_argument("--k-max", type=A.int_range(1, 64), default=8)
    v.add_argument("--json", action="store_true")

    b = sub.add_parser("bench", help="benchmark policies (see rakv bench --help)", add_help=False)
    b.add_argument("rest", nargs=argparse.REMAINDER)
    return ap


def package_version() -> str:
    """The installed package's version (its metadata), else the source tree's."""
    try:
        from importlib.metadata import PackageNotFoundError, version

        return version("rakv-explorer")
    except (ImportError, PackageNotFoundError):
        from . import __version__

        return __version__


def add_run_args(g) -> None:
    """The flags of a run (model pair, policy, cache, recording, output): generate's and chat's."""
    add_model_args(g)
    add_sampling_args(g)
    g.add_argument("--max-new-tokens", type=A.int_range(1), default=64)
    g.add_argument("--raw", action="store_true",
                   help="send the prompt text as it is (default: through the tokenizer's chat template, "
                        "if it has one)")
    g.add_argument("--policy", default="adaptive", type=A.policy, help=POLICIES_HELP)
    g.add_argument("--k-set", default=",".join(map(str, DEFAULT_K_SET)))
    g.add_argument("--budget-mib", type=A.finite_float(0), default=512.0, help="prefix-cache budget (MiB, >= 0)")
    g.add_argument("--granularity", choices=["request", "round"], default=None,
                   help="adaptive: decide k per request (paper, default) or per round")
    g.add_argument("--explore-share", type=float, default=None,
                   help="adaptive: share of the stream's time probes may spend (default 0.005)")
    g.add_argument("--record", help="write a JSONL recording")
    g.add_argument("--json", action="store_true", help="one JSON object per request on stdout")
    g.add_argument("--recalibrate", action="store_true", help="measure costs again before running")


def cmd_generate(args) -> int:
    from .util.text_in import checked_text

    prompts = read_prompts(args.prompts_file) if args.prompts_file else \
        [checked_text(p, f"--prompt {i + 1}" if len(args.prompt) > 1 else "--prompt") for i, p in enumerate(args.prompt)]
    for i, p in enumerate(prompts):
        if not p.strip():
            raise CliError(f"prompt {i + 1} is empty")
    with Run(args, {"--prompts-file": args.prompts_file}) as run:
        for prompt in prompts:
            end = run.engine.generate(prompt)
            run.report(end)
        run.remeasure_if_quiet()
    return 0


# ----------------------------------------------------------------------------- a run (generate, chat)
def run_config(args) -> tuple[RakvConfig, Policy]:
    """The engine's config from the run flags (checked before any model loads)."""
    try:
        k_set = parse_k_set(args.k_set)
        policy = Policy.parse(args.policy)
    except ValueError as e:
        raise CliError(str(e)) from None
    if policy.k > 0 and args.draft == "none":
        raise CliError(f"policy {policy.name} needs a draft; --draft is 'none'")
    kw = dict(target=args.target, draft=args.draft, revision=args.revision, dtype=args.dtype, numerics=args.numerics,
              draft_vocab=draft_vocab_of(args), draft_codes=getattr(args, "draft_codes", "auto") or "auto",
              threads=args.threads, policy=policy.name, max_new_tokens=args.max_new_tokens,
              k_set=k_set, budget_mib=args.budget_mib, chat_template=not args.raw, sampling=sampling_of(args),
              **device_kw(args))
    if args.granularity:
        kw["granularity"] = args.granularity
    if args.explore_share is not None:
        if not 0.0 <= args.explore_share <= 1.0:
            raise CliError("--explore-share must be between 0 and 1")
        kw["explore_share"] = args.explore_share
    return RakvConfig(**kw), policy


class Run:
    """What generate, chat and serve share: the session (rakv.session.build) of the run flags, its
    engine's callback (the recording, each request's decision and gate rounds, the text streamed to
    stdout without --json), and each request's report (a JSON object on stdout, or the summary on
    stderr)."""

    def __init__(self, args, inputs: dict | None = None, on_record=None):
        self.args = args
        self.on_record = on_record            # also called with every record (rakv serve's records endpoint)
        self.config, self.policy = run_config(args)
        if args.record:      # checked before any model loads
            A.refuse_overwrite(args.record, "--record", inputs or {})
            A.check_writable_file(args.record, "--record")
        self.stream_text = not args.json
        self.last_decision: dict = {}
        self.starts: dict = {}
        self.gated: dict[int, list[dict]] = {}
        self.copies: dict[int, list[int]] = {}    # request -> [copied, copies accepted]
        self.stream = None
        self.recorder = None
        self.profile = None
        from .records import Recorder
        from .session import build

        self.k_max = max(max(self.config.k_set), self.policy.k, 1)
        s = build(self.config, self.callback, k_max=self.k_max, recalibrate=args.recalibrate,
                  on_loaded=self._template_notice)
        self.session, self.profile, self.engine = s, s.profile, s.engine
        self.recorder = Recorder(args.record) if args.record else None     # the engine's first record is its header
        h = self.engine.header()
        if h.learned and self.policy.adaptive:
            L = h.learned
            moved = ", ".join(f"{k} x{v:.2f}" for k, v in L["scale"].items() if abs(v - 1) > 0.05) or "none"
            print(f"[rakv] profile: alpha {L['alpha_learned'] if L['alpha_learned'] is not None else L['alpha0']:.2f}"
                  f" (calibrated {L['alpha0']:.2f}, {L['alpha_trials'] or 0:.0f} trials since), last output share "
                  f"{L['out_frac'] if L['out_frac'] is not None else 1.0:.2f} (each run learns its own), cost scales moved: {moved}", file=sys.stderr)

    def _template_notice(self, s) -> None:
        from .prompts import template_notice

        notice = template_notice(s.target.tokenizer, self.config.chat_template, s.target.name)
        if notice:
            print(f"[rakv] {notice}", file=sys.stderr, flush=True)

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def remeasure_if_quiet(self) -> None:
        """After the run's requests: a profile flagged contended is measured again now if the machine
        is quiet (announced, Ctrl-C skips; the next run uses it), never before the first token."""
        if self.profile is None or not self.profile.contended:
            return
        from .decide.calibration import remeasure_if_quiet, text_progress
        from .util.paths import cache_dir, log
        from .session import save_learned

        save_learned(self.profile)       # what this run learned stays, whatever comes next
        new = remeasure_if_quiet(self.profile, self.engine.target, self.engine.draft, cache_dir(), self.k_max,
                                 progress=text_progress(), log=log)
        if new is not None:
            self.profile = None          # saved already; the old one's learning must not overwrite it

    def close(self) -> None:
        if self.recorder:
            self.recorder.close()
            self.recorder = None
        if self.profile is not None and self.policy.adaptive:
            from .session import save_learned

            save_learned(self.profile)
            self.profile = None

    def callback(self, rec) -> None:
        from .records import Decision, RequestStart, Round

        if self.recorder:
            self.recorder(rec)
        if isinstance(rec, Decision) and rec.round == -1:
            self.last_decision[rec.request_id] = rec
        elif isinstance(rec, RequestStart):
            self.starts[rec.request_id] = rec
            if self.stream_text:
                self.stream = TextStream(self.engine.target.tokenizer)
        elif isinstance(rec, Round):
            if rec.draft_source == "lookup":         # n-gram copies a gate verified in a k = 0 round
                c = self.copies.setdefault(rec.request_id, [0, 0])
                c[0] += rec.drafted
                c[1] += rec.accepted
            if self.stream is not None:
                write_out(self.stream.push(rec.emitted))
            if rec.draft_stop:
                self.gated.setdefault(rec.request_id, []).append(
                    {"round": rec.index, "k_max": rec.k, "drafted": rec.drafted, "accepted": rec.accepted,
                     "pred": rec.draft_pred, "stop": rec.draft_stop, "source": rec.draft_source or "draft"})
        if self.on_record is not None:
            self.on_record(rec)

    def request_json(self, end) -> dict:
        """generate's --json object of one request."""
        from .load.loaded import backend_name

        dec = self.last_decision.get(end.request_id)
        start = self.starts.get(end.request_id)
        copied, copies_accepted = self.copies.pop(end.request_id, (0, 0))
        return {
            "request_id": end.request_id, "prompt_tokens": end.prompt_tokens,
            "output_ids": end.output_ids, "text": end.text, "hit_tokens": end.hit_tokens,
            "exact_repeat": end.exact_repeat, "action": end.action,
            "candidates": [{"reuse": c["reuse"], "k": c["k"], "predicted_ms": c["predicted_ms"],
                            "feasible": c["feasible"], **({"reason": c["reason"]} if c.get("reason") else {})}
                           for c in (dec.candidates if dec else [])],
            "latency_ms": end.latency_ms, "ttft_ms": end.ttft_ms, "tokens_per_s": end.tokens_per_s,
            # drafted / accepted: the draft's own rounds; copied / copies_accepted: n-gram tokens the
            # gate verified (draft_source lookup: k = 0 rounds, or in place of the model draft; the gate
            # entries count both); the totals add them up
            "drafted": end.drafted, "accepted": end.accepted, "copied": copied, "copies_accepted": copies_accepted,
            "drafted_total": end.drafted + copied, "accepted_total": end.accepted + copies_accepted,
            "rounds": end.rounds,
            "alpha_ewma": end.alpha_ewma, "alpha_star": dec.alpha_star if dec else {},
            "predicted_ms": end.predicted_ms, "stopped": end.stopped, "policy": self.policy.name,
            # the chosen action priced as the copy of an exact repeat's earlier output, and the target
            # passes after the prefill it predicted (beside "rounds": those taken)
            "copy": bool(dec and dec.copy), "predicted_passes": dec.predicted_passes if dec else None,
            "numerics": self.engine.target.numerics,
            "backend": backend_name(self.engine.target),
            "templated": bool(start and start.templated),
            "sampling": start.sampling if start else {},
            "template_prefix": start.template_prefix if start else 0,
            "explore_ms": end.explore_ms,
            "threads": end.threads, "thread_switches": end.thread_switches,
            "cost_corrections": dict(end.cost_corrections),     # V(k) the round records corrected
            **({"gate": self.gated.pop(end.request_id)} if end.request_id in self.gated else {}),
        }

    def report(self, end, extra: dict | None = None, what: str = "", note: str = "") -> None:
        """After a request: its JSON object (--json), else the rest of its streamed text and a
        newline on stdout and the summary on stderr."""
        if self.args.json:
            write_out(json.dumps({**self.request_json(end), **(extra or {})}) + "\n")
            return
        rest = self.stream.finish() if self.stream is not None else end.text
        self.stream = None
        write_out(rest + "\n")
        print(f"[rakv] {what or f'request {end.request_id}'}: {len(end.output_ids)} tokens in "
              f"{end.latency_ms:.0f} ms ({end.tokens_per_s:.1f} tok/s, TTFT {end.ttft_ms:.0f} ms), action "
              f"r={end.action['reuse']} k={end.action['k']}, hit {end.hit_tokens}/{end.prompt_tokens}, "
              f"accepted {end.accepted}/{end.drafted}" + (", stopped" if end.stopped == "stop" else "") + note,
              file=sys.stderr)


def write_out(text: str) -> None:
    """Text to stdout at once (streamed pieces must not wait in a buffer)."""
    if text:
        sys.stdout.write(text)
        sys.stdout.flush()


# ----------------------------------------------------------------------------- chat
CHAT_MAX_NEW_TOKENS = 256     # chat's default (generate keeps 64): a code answer finishes
CHAT_HELP = "/reset starts a new conversation, /stats shows each turn's reuse and timing, /exit (or Ctrl-D) ends"


def add_chat_parser(sub) -> None:
    ch = sub.add_parser("chat", help="a conversation: each turn reuses the whole conversation before it",
                        description="A multi-turn chat. On a terminal: a prompt with history; " + CHAT_HELP +
                                    "; Ctrl-C stops the answer. Otherwise one user turn per stdin line.")
    add_run_args(ch)
    ch.set_defaults(max_new_tokens=CHAT_MAX_NEW_TOKENS)      # an answer (code included) gets room to finish


class ChatSession:
    """``rakv chat``: one conversation at a time over a Run's engine; each turn's report adds
    the turn's conversation info to generate's output."""

    def __init__(self, run: Run):
        from .engine.chat import Conversation

        self.run = run
        self.conv = Conversation.for_engine(run.engine)
        self.rows: list[dict] = []          # this conversation's turns, for /stats

    def turn(self, text: str):
        from .engine.chat import run_turn

        end = run_turn(self.run.engine, self.conv, text)
        info = (self.run.starts.get(end.request_id).conversation or {}) if end.request_id in self.run.starts else {}
        self.rows.append({"turn": info.get("turn", len(self.rows) + 1), "P": end.prompt_tokens, "hit": end.hit_tokens,
                          "before": info.get("previous_tokens", 0), "ids_from": info.get("ids_from", ""),
                          "ttft": end.ttft_ms, "latency": end.latency_ms, "out": len(end.output_ids)})
        note = ""
        if info.get("turn", 1) > 1:
            note = (f"; the conversation before: {info['previous_tokens']} tokens, "
                    + ("ids appended" if info["ids_from"] == "append" else f"re-templated ({info['reason']})"))
        self.run.report(end, {"turn": info.get("turn"), "conversation": info},
                        what=f"turn {info.get('turn')}" + (f" of conversation {info.get('conversation')}"
                                                            if info.get("conversation", 1) > 1 else ""), note=note)
        return end

    def reset(self) -> None:
        self.conv.reset()
        self.rows = []
        print(f"[rakv] new conversation ({self.conv.number})", file=sys.stderr)

    def stats(self) -> str:
        st = self.run.engine.store.stats
        lines = [f"conversation {self.conv.number}: {len(self.conv.turns)} turns, {len(self.conv.ids)} tokens; "
                 f"prefix cache {st.entries} entries, {st.bytes_used / 2**20:.1f} of {st.budget / 2**20:.0f} MiB"]
        for r in self.rows:
            lines.append(f"  turn {r['turn']}: P {r['P']}, hit {r['hit']} (conversation before: {r['before']}, "
                         f"{r['ids_from']}), TTFT {r['ttft']:.0f} ms, {r['out']} tokens in {r['latency']:.0f} ms")
        return "\n".join(lines)


def cmd_chat(args) -> int:
    with Run(args) as run:
        chat = ChatSession(run)
        if sys.stdin.isatty():
            with Terminal(run) as term:
                while True:
                    try:                    # a Ctrl-C anywhere but in an answer: the chat goes on
                        line = term.read()
                        if line is None or not chat_line(chat, line, interactive=True):
                            break
                    except KeyboardInterrupt:
                        run.stream = None
                        print("\n[rakv] (Ctrl-D or /exit ends the chat)", file=sys.stderr)
        else:                               # one user turn per line
            for line in stdin_lines():
                if not chat_line(chat, line, interactive=False):
                    break
        run.remeasure_if_quiet()
    return 0


def stdin_lines():
    """Piped stdin's lines, read as bytes and decoded by the one rule (rakv.util.text_in): a line that is
    not valid UTF-8 ends the chat with one line naming it (CliError, exit 2); the turns before it
    were answered."""
    from .util.text_in import TextError, decode_utf8

    src = getattr(sys.stdin, "buffer", None)
    for n, raw in enumerate(src if src is not None else (x.encode("utf-8", "surrogateescape") for x in sys.stdin), 1):
        try:
            yield decode_utf8(raw, f"stdin line {n}").rstrip("\r\n")
        except TextError as e:
            raise CliError(str(e)) from None


def chat_line(chat: ChatSession, line: str, interactive: bool) -> bool:
    """One line of the chat: a command or a user turn. False: the chat ends."""
    from .engine import EngineError
    from .util.text_in import text_problem

    cmd = line.strip()
    if not cmd:
        return True
    if cmd in ("/exit", "/quit", "/bye"):
        return False
    if cmd in ("/reset", "/new", "/clear"):
        chat.reset()
    elif cmd == "/stats":
        print(chat.stats(), file=sys.stderr)
    elif cmd in ("/help", "/?"):
        print(f"[rakv] {CHAT_HELP}; Ctrl-C stops an answer", file=sys.stderr)
    elif not interactive:
        chat.turn(line)                     # an error ends a piped chat: one line, exit 2
    elif text_problem(line):                # a terminal that sent bytes that are not UTF-8
        print(f"rakv: error: that line is not valid text: {text_problem(line)} (refused; type it again)",
              file=sys.stderr)
    else:
        try:
            with stop_on_interrupt(chat.run.engine):
                chat.turn(line)
        except EngineError as e:            # e.g. the conversation outgrew the context: say so, go on
            print(f"rakv: error: {e} (/reset starts a new conversation)", file=sys.stderr)
        except KeyboardInterrupt:           # a second Ctrl-C: the answer is dropped, the chat goes on
            chat.run.stream = None
            print("\n[rakv] interrupted: that turn is not kept", file=sys.stderr)
    return True


class Terminal:
    """The chat's prompt on a terminal: line editing and history (kept in the cache dir); ``read``
    gives a line, None on Ctrl-D; Ctrl-C at the prompt clears the line."""

    def __init__(self, run: Run):
        self.run = run
        self.readline = self.hist = None

    def __enter__(self) -> "Terminal":
        try:
            import readline

            from .util.paths import cache_dir

            self.readline, self.hist = readline, cache_dir() / "chat_history"
            try:
                readline.read_history_file(self.hist)
            except OSError:
                pass
            readline.set_history_length(1000)
        except ImportError:       # no readline on this platform: plain input()
            pass
        print(f"[rakv] chat with {self.run.engine.target.name} (policy {self.run.policy.name}); {CHAT_HELP}; "
              "Ctrl-C stops an answer", file=sys.stderr)
        return self

    def read(self) -> str | None:
        try:
            return input(">>> ")
        except EOFError:
            print(file=sys.stderr)
            return None

    def __exit__(self, *exc) -> None:
        if self.readline is not None:
            try:
                self.readline.write_history_file(self.hist)
            except OSError:
                pass


class stop_on_interrupt:
    """While an answer runs, Ctrl-C asks the engine to stop it (within one round; the part
    generated stays in the conversation); a second Ctrl-C interrupts at once."""

    def __init__(self, engine):
        self.engine = engine
        self.pressed = False

    def _handler(self, signum, frame):
        if self.pressed:
            raise KeyboardInterrupt
        self.pressed = True
        self.engine.stop()

    def __enter__(self):
        import signal

        self.old = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc):
        import signal

        signal.signal(signal.SIGINT, self.old)
        return False


def cmd_calibrate(args) -> int:
    if args.engine == "vllm":
        return cmd_calibrate_vllm(args)
    from .session import load

    config = RakvConfig(target=args.target, draft=args.draft, revision=args.revision, dtype=args.dtype,
                        threads=args.threads, numerics=args.numerics, draft_vocab=draft_vocab_of(args),
                        draft_codes=getattr(args, "draft_codes", "auto") or "auto", **device_kw(args))
    s = load(config)
    if args.check:
        return calibrate_check(s.target, s.draft, args.json)
    prof = s.calibrate(args.k_max, force=True, quick=args.quick)
    if args.json:
        print(json.dumps(asdict(prof)))
        return 0
    for line in regime_lines(prof):
        print(line)
    q = prof.quality
    if q:
        print(f"quality: CPU share {q.get('cpu_share')}, {q.get('retries', 0)} re-measured, "
              f"largest spread {max(q.get('spread', {0: 0}).values()):.2f}"
              + (f"; CONTENDED: {'; '.join(q.get('reasons', []))}" if q.get("contended") else "; clean"))
    return 0


def cmd_calibrate_vllm(args) -> int:
    """`rakv calibrate --engine vllm`: in this Python if it has vLLM, else in RAKV_VLLM_PYTHON's."""
    from .integrations.vllm_env import _int_list, check_target, run_in_vllm_python, vllm_python

    if args.target == "demo":
        raise CliError("--engine vllm needs --target: a model folder vLLM loads (docs/vllm.md: the demo "
                       "model as a vLLM folder)")
    try:
        ks = sorted(set(_int_list(args.vllm_k, "--vllm-k", 0)) | {0})
        sizes = _int_list(args.batch_sizes, "--batch-sizes", 1)
    except ValueError as e:
        raise CliError(f"{e} (e.g. --vllm-k 0,1,2,4,8 --batch-sizes 1,2,4)") from None
    if max(sizes) > 1024:
        raise CliError(f"--batch-sizes {args.batch_sizes}: at most 1024")
    exe = vllm_python()
    check_target(args.target)
    out = args.out or "vllm-profile.json"
    argv = ["calibrate", "--target", args.target, "--out", out, "--k", ",".join(map(str, ks)),
            "--tokens", str(args.tokens), "--repeats", str(args.repeats), "--batch-sizes", ",".join(map(str, sizes))]
    if args.vllm_draft:
        argv += ["--draft", args.vllm_draft, "--draft-numerics", "fp32" if args.numerics == "fp32" else "q8"]
    return run_in_vllm_python(argv, exe)


def calibrate_check(target, draft, as_json: bool) -> int:
    """`rakv calibrate --check`: a few terms measured now against the saved profile (exit 0)."""
    from .decide.calibration import check_profile
    from .decide.profile import saved_profile
    from .util.paths import cache_dir

    prof, path = saved_profile(target, draft, cache_dir())
    if prof is None:
        print(f"no saved cost profile for this machine and pair yet ({path}); `rakv calibrate` or a first "
              "`rakv generate` measures one")
        return 0
    rows, probe_share = check_profile(prof, target, draft)
    if as_json:
        print(json.dumps({"profile": str(path), "contended": prof.contended, "cpu_share_now": probe_share,
                          "terms": rows}))
        return 0
    q = prof.quality
    print(f"profile {path.name} (calibrated {prof.calibrated_at}"
          f"{', marked contended' if prof.contended else ''}; CPU share then {q.get('cpu_share', '?')}, now "
          f"{probe_share:.2f})")
    for r in rows:
        print(f"  {r['term']:<16} profile {r['profile_ms']:9.3f} ms   now {r['now_ms']:9.3f} ms   "
              f"now/profile {r['ratio']:5.2f}{'' if abs(r['ratio'] - 1) <= 0.15 else '  (off by more than 15%)'}")
    return 0


def regime_lines(prof) -> list[str]:
    """The calibration's figures as text: the machine, the step against its floor, V(k)/t, d/t."""
    g = prof.regime or {}
    ctx = prof.V_ctx
    t = prof.step(ctx)
    out = []
    if g:
        out.append(f"machine: {g.get('device', '?')}, {g.get('torch_threads', '?')} threads of {g.get('cores', '?')} "
                   f"cores, torch kernels {g.get('torch_capability') or '?'}, ISA {' '.join(g.get('isa') or []) or '?'}; "
                   f"fast path {'on (packed oneDNN linears' + (', lean forward)' if g.get('lean') else ')') if g.get('fast') else 'off (plain torch kernels)'}")
        if g.get("floor_ms"):
            out.append(f"target step @{ctx}: {t:.2f} ms = {t / g['floor_ms']:.2f} x the weight-streaming floor "
                       f"{g['floor_ms']:.2f} ms ({g.get('floor_method', '')}); 5 rows: {g.get('floor5_ms', 0):.2f} ms")
    else:
        out.append(f"target step @{ctx}: {t:.2f} ms")
    out.append(f"V(k)/t @{ctx}: " + ", ".join(f"k={k}: {prof.verify(int(k), ctx) / t:.2f}"
                                             for k in sorted(prof.V, key=int)))
    d = prof.draft_step(ctx)
    out.append(f"d/t @{ctx}: {d / t:.3f} (draft step {d:.2f} ms; its 2-token step {prof.d2_ratio:.2f} d)"
               if d > 0 else "d/t: - (no draft model)")
    out.append("T_pf: " + ", ".join(f"{int(n)}: {ms:.1f} ms" for n, ms in prof.T_pf))
    out.append(f"alpha0 = {prof.alpha0:.3f};  calibration took {prof.calibration_s:.1f} s"
               + ("  (measured while the machine was busy: contended)" if getattr(prof, "contended", False) else ""))
    return out


def cmd_replay(args) -> int:
    from .records import (OracleResult, RecordingError, oracle_csv_path, read_recording, write_csv,
                          write_oracle_csv)

    A.refuse_overwrite(args.csv, "--csv", {"the recording": args.file})
    oracle_out = args.oracle_csv or oracle_csv_path(args.csv)
    A.refuse_overwrite(oracle_out, "--oracle-csv", {"the recording": args.file, "--csv": args.csv})
    try:
        recs = read_recording(args.file, warn=lambda m: A.warn("rakv", m))
    except RecordingError as e:
        raise CliError(str(e)) from None
    try:
        n = write_csv(recs, args.csv)
    except OSError as e:
        raise CliError(f"cannot write {args.csv}: {e}") from None
    print(f"[rakv] wrote {n} request rows to {args.csv}", file=sys.stderr)
    if args.oracle_csv or any(isinstance(r, OracleResult) for r in recs):
        out = oracle_out
        try:
            m = write_oracle_csv(recs, out)
        except OSError as e:
            raise CliError(f"cannot write {out}: {e}") from None
        print(f"[rakv] wrote {m} oracle rows ('measure every action') to {out}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "bench":
        from .bench import main as bench_main

        return _guard(lambda: bench_main(argv[1:]))
    ap = build_parser()
    try:
        args = resolve_draft(ap.parse_args(argv))
    except SystemExit as e:     # --help (0) or a bad flag (2, one line already printed)
        return e.code if isinstance(e.code, int) else 2
    quiet_libs()
    return _guard(lambda: {"generate": cmd_generate, "chat": cmd_chat, "calibrate": cmd_calibrate,
                                "replay": cmd_replay, "serve": cmd_serve, "advise": cmd_advise}[args.cmd](args))


def cmd_advise(args) -> int:
    from .integrations.vllm_advise import advise, format_text

    if args.alpha is not None and args.alpha > 1:
        raise CliError("--alpha is a per-token acceptance in [0, 1]")
    try:
        a = advise(args.profile, args.alpha, args.metrics, args.k_max)
    except (KeyError, TypeError, AttributeError, ValueError) as e:     # (JSONDecodeError is a ValueError)
        raise CliError(f"{args.profile} is not a vLLM cost profile ({type(e).__name__}: {e})") from None
    print(json.dumps(a) if args.json else format_text(a))
    return 0


def cmd_serve(args) -> int:
    from .serve import cmd_serve as serve

    return serve(args, lambda on_record: Run(args, on_record=on_record))


def _guard(fn) -> int:
    from .engine import EngineError
    from .load.loaded import ModelError
    from .records import RecordingError

    try:
        return fn() or 0
    except (CliError, EngineError, ModelError, RecordingError, ValueError, OSError) as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"rakv: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("rakv: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

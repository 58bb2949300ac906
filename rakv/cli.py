"""``rakv``: generate, calibrate, replay, bench. Logs and progress go to stderr; with --json,
stdout holds exactly one JSON object per request. Bad input: one line on stderr, exit 2."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from . import argtypes as A
from .common import (CliError, add_model_args, device_kw, get_profile, load_pair, quiet_libs,  # noqa: F401
                     read_prompts, save_learned)
from .config import DEFAULT_K_SET, POLICIES_HELP, Policy, RakvConfig, parse_k_set


def build_parser() -> argparse.ArgumentParser:
    ap = A.OneLineParser(prog="rakv", description="Exact speculative decoding with prefix KV reuse.")
    sub = ap.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate for one or more prompts (one engine, one cache)")
    add_model_args(g)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    src.add_argument("--prompts-file", help=".jsonl with {\"prompt\": ...} per line, or one prompt per line")
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

    c = sub.add_parser("calibrate", help="measure this machine's costs for a model pair")
    add_model_args(c)
    c.add_argument("--k-max", type=A.int_range(1, 64), default=8)
    c.add_argument("--quick", action="store_true")
    c.add_argument("--json", action="store_true")
    c.add_argument("--check", action="store_true",
                   help="measure a few terms now and print how far the saved profile is from them")

    r = sub.add_parser("replay", help="derive a timing CSV from a recording")
    r.add_argument("file")
    r.add_argument("--csv", required=True, help="output CSV path (one row per request)")
    r.add_argument("--oracle-csv", default=None,
                   help="where the 'measure every action' rows go (default: OUT.oracle.csv beside --csv, "
                        "written only when the recording has oracle measurements)")

    b = sub.add_parser("bench", help="benchmark policies (see rakv bench --help)", add_help=False)
    b.add_argument("rest", nargs=argparse.REMAINDER)
    return ap


def cmd_generate(args) -> int:
    from .engine import Engine
    from .records import Decision, Recorder, RequestEnd, RequestStart, Round

    try:
        k_set = parse_k_set(args.k_set)
        policy = Policy.parse(args.policy)
    except ValueError as e:
        raise CliError(str(e)) from None
    prompts = read_prompts(args.prompts_file) if args.prompts_file else list(args.prompt)
    for i, p in enumerate(prompts):
        if not p.strip():
            raise CliError(f"prompt {i + 1} is empty")
    if policy.k > 0 and args.draft == "none":
        raise CliError(f"policy {policy.name} needs a draft; --draft is 'none'")
    if args.record:      # checked before any model loads
        A.refuse_overwrite(args.record, "--record", {"--prompts-file": args.prompts_file})
        A.check_writable_file(args.record, "--record")
    kw = dict(target=args.target, draft=args.draft, revision=args.revision, dtype=args.dtype,
              threads=args.threads, policy=policy.name, max_new_tokens=args.max_new_tokens,
              k_set=k_set, budget_mib=args.budget_mib, chat_template=not args.raw, **device_kw(args))
    if args.granularity:
        kw["granularity"] = args.granularity
    if args.explore_share is not None:
        if not 0.0 <= args.explore_share <= 1.0:
            raise CliError("--explore-share must be between 0 and 1")
        kw["explore_share"] = args.explore_share
    config = RakvConfig(**kw)
    target, draft = load_pair(args, config)
    k_max = max(max(k_set), policy.k, 1)
    profile = get_profile(target, draft, k_max, force=args.recalibrate) if (
        policy.adaptive or args.recalibrate) else None
    recorder = Recorder(args.record) if args.record else None
    last_decision: dict[int, Decision] = {}
    starts: dict[int, RequestStart] = {}
    gated: dict[int, list[dict]] = {}

    def callback(rec):
        if recorder:
            recorder(rec)
        if isinstance(rec, Decision) and rec.round == -1:
            last_decision[rec.request_id] = rec
        elif isinstance(rec, RequestStart):
            starts[rec.request_id] = rec
        elif isinstance(rec, Round) and rec.draft_stop:
            gated.setdefault(rec.request_id, []).append(
                {"round": rec.index, "k_max": rec.k, "drafted": rec.drafted, "accepted": rec.accepted,
                 "pred": rec.draft_pred, "stop": rec.draft_stop, "source": rec.draft_source or "draft"})

    engine = Engine(target, draft, config, callback, profile)
    h = engine.header()
    if h.learned and policy.adaptive:
        L = h.learned
        moved = ", ".join(f"{k} x{v:.2f}" for k, v in L["scale"].items() if abs(v - 1) > 0.05) or "none"
        print(f"[rakv] profile: alpha {L['alpha_learned'] if L['alpha_learned'] is not None else L['alpha0']:.2f}"
              f" (calibrated {L['alpha0']:.2f}, {L['alpha_trials'] or 0:.0f} trials since), last output share "
              f"{L['out_frac'] if L['out_frac'] is not None else 1.0:.2f} (each run learns its own), cost scales moved: {moved}", file=sys.stderr)
    try:
        for prompt in prompts:
            end: RequestEnd = engine.generate(prompt)
            dec = last_decision.get(end.request_id)
            start = starts.get(end.request_id)
            if args.json:
                obj = {
                    "request_id": end.request_id, "prompt_tokens": end.prompt_tokens,
                    "output_ids": end.output_ids, "text": end.text, "hit_tokens": end.hit_tokens,
                    "exact_repeat": end.exact_repeat, "action": end.action,
                    "candidates": [{"reuse": c["reuse"], "k": c["k"], "predicted_ms": c["predicted_ms"],
                                    "feasible": c["feasible"], **({"reason": c["reason"]} if c.get("reason") else {})}
                                   for c in (dec.candidates if dec else [])],
                    "latency_ms": end.latency_ms, "ttft_ms": end.ttft_ms, "tokens_per_s": end.tokens_per_s,
                    "drafted": end.drafted, "accepted": end.accepted, "rounds": end.rounds,
                    "alpha_ewma": end.alpha_ewma, "alpha_star": dec.alpha_star if dec else {},
                    "predicted_ms": end.predicted_ms, "stopped": end.stopped, "policy": policy.name,
                    "templated": bool(start and start.templated),
                    "template_prefix": start.template_prefix if start else 0,
                    "explore_ms": end.explore_ms,
                    **({"gate": gated.pop(end.request_id)} if end.request_id in gated else {}),
                }
                sys.stdout.write(json.dumps(obj) + "\n")
            else:
                sys.stdout.write(end.text + "\n")
                print(f"[rakv] request {end.request_id}: {len(end.output_ids)} tokens in {end.latency_ms:.0f} ms "
                      f"({end.tokens_per_s:.1f} tok/s, TTFT {end.ttft_ms:.0f} ms), action r={end.action['reuse']} "
                      f"k={end.action['k']}, hit {end.hit_tokens}/{end.prompt_tokens}, "
                      f"accepted {end.accepted}/{end.drafted}", file=sys.stderr)
            sys.stdout.flush()
    finally:
        if recorder:
            recorder.close()
        if profile is not None and policy.adaptive:
            save_learned(profile)
    return 0


def cmd_calibrate(args) -> int:
    config = RakvConfig(target=args.target, draft=args.draft, dtype=args.dtype, threads=args.threads,
                        **device_kw(args))
    target, draft = load_pair(args, config)
    if args.check:
        return calibrate_check(target, draft, args.json)
    prof = get_profile(target, draft, args.k_max, force=True, quick=args.quick)
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


def calibrate_check(target, draft, as_json: bool) -> int:
    """`rakv calibrate --check`: a few terms measured now against the saved profile (exit 0)."""
    from .costs import check_profile, saved_profile
    from .paths import cache_dir

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
        args = ap.parse_args(argv)
    except SystemExit as e:     # --help (0) or a bad flag (2, one line already printed)
        return e.code if isinstance(e.code, int) else 2
    quiet_libs()
    return _guard(lambda: {"generate": cmd_generate, "calibrate": cmd_calibrate, "replay": cmd_replay}[args.cmd](args))


def _guard(fn) -> int:
    from .engine import EngineError
    from .models import ModelError
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

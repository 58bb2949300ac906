"""``rakv bench --peer vllm``: the RAKV proposer against vLLM's own arms, on one vLLM engine
(``VllmPeer``: it takes the whole run over, instead of the engine's policies).

It runs ``python -m rakv.integrations.vllm_run bench`` in this Python when it has vLLM, else in
the one ``RAKV_VLLM_PYTHON`` names (vLLM's CPU build lives in its own venv; docs/vllm.md). The
arms (``plain``, vLLM's n-gram lookup at a fixed ``ngram:K``, the RAKV proposer ``rakv``) are
switched per request on one engine (``SwitchProposer``); every prompt of the workload (copy-heavy
prompts and open chat prompts, ``--n-prompts`` of each) goes through every arm:

  one       each prompt alone (batch 1), arms interleaved per prompt;
  batched   all prompts of a class in one ``generate`` call (batch = their number), one arm a call;
  both      (the default) one, then batched, on the same engine.

Writes ``OUT/vllm.json`` (every call: wall and CPU seconds, ids, vLLM's counters; the summaries),
``OUT/vllm-summary.md`` (the arms side by side, also printed on stdout) and
``OUT/vllm-proposer.json`` (the RAKV proposer's own counters). Progress goes to stderr, a line a
call. The rakv engine's policies do not run in this mode.
"""

from __future__ import annotations

import sys
from pathlib import Path

from rakv import argtypes as A

from .base import Peer
from rakv.util.paths import set_env

VLLM_OUTPUTS = ("vllm.json", "vllm-summary.md", "vllm-proposer.json")
DEFAULTS = dict(n_prompts=5, repeats=2, max_new_tokens=96)


def add_args(ap) -> None:
    g = ap.add_argument_group("vLLM as the peer (--peer vllm; docs/vllm.md)")
    g.add_argument("--peer", choices=["vllm"], default=None,
                   help="vllm: run the RAKV proposer against vLLM's own arms on a vLLM engine (instead of the "
                        "rakv engine's policies): plain, n-gram at fixed k, rakv; needs --vllm-target")
    g.add_argument("--vllm-target", default=None, metavar="DIR", help="a model folder vLLM loads")
    g.add_argument("--vllm-profile", default=None, metavar="FILE",
                   help="the RAKV proposer's cost profile (rakv calibrate --engine vllm); without one it "
                        "assumes V(k) = t (1 + 0.08 k)")
    g.add_argument("--vllm-mode", choices=["one", "batched", "both"], default="both",
                   help="one: each prompt alone (batch 1); batched: each class's prompts in one generate "
                        "call; both (default)")
    g.add_argument("--vllm-arms", default=None, metavar="LIST",
                   help="comma-separated, default plain,ngram:1,ngram:2,ngram:4,ngram:8,rakv; also rakvcopy (the "
                        "RAKV proposer with copies only) and draft:K (its model draft at a fixed K); rakv and "
                        "draft:K use the model draft the profile names (rakv calibrate --engine vllm --vllm-draft M) "
                        "or RAKV_VLLM_DRAFT (docs/vllm.md)")
    g.add_argument("--vllm-k-max", type=int, default=8, metavar="K",
                   help="the engine's num_speculative_tokens: the most drafts an arm may verify (default 8)")


def check_args(args) -> None:
    """One line (ValueError) for any flag that does not fit --peer vllm, before anything starts."""
    if args.peer != "vllm":
        for flag in ("vllm_target", "vllm_profile", "vllm_arms"):
            if getattr(args, flag) is not None:
                raise ValueError(f"--{flag.replace('_', '-')} goes with --peer vllm")
        return
    if not args.vllm_target:
        raise ValueError("--peer vllm needs --vllm-target DIR: a model folder vLLM loads (docs/vllm.md)")
    clash = [f for f, on in (("--policies", args.policies), ("--peer-llama-cpp", args.peer_llama_cpp),
                             ("--peer-gguf", args.peer_gguf), ("--resume", args.resume),
                             ("--report-only", args.report_only), ("--prompts", args.prompts)) if on]
    if args.workload != "chat":
        clash.append("--workload")
    if clash:
        raise ValueError(f"{clash[0]} does not apply to --peer vllm (it runs its own arms on its own workload: "
                         "copy-heavy and chat-heldout prompts)")
    if args.temperature:
        raise ValueError("--peer vllm runs greedy: use it with --temperature 0")
    if not 1 <= args.vllm_k_max <= 64:
        raise ValueError(f"--vllm-k-max {args.vllm_k_max}: between 1 and 64")


def plan(args) -> dict:
    from rakv.integrations.vllm_env import ARMS, check_arms

    arms = check_arms((args.vllm_arms or ",".join(ARMS)).split(","), args.vllm_profile)
    if "plain" not in arms:
        raise ValueError("--vllm-arms must include plain (the base of every ratio and of the ids check)")
    big = [a for a in arms if a.startswith(("ngram:", "draft:")) and int(a.split(":")[1]) > args.vllm_k_max]
    if big:
        raise ValueError(f"--vllm-arms: {big[0]} drafts more than --vllm-k-max {args.vllm_k_max}")
    pick = lambda name: getattr(args, name) if getattr(args, name) is not None else DEFAULTS[name]  # noqa: E731
    return dict(arms=arms, n=pick("n_prompts"), repeats=pick("repeats"), max_tokens=pick("max_new_tokens"),
                mode=args.vllm_mode)


def run(args) -> int:
    from rakv.decide.profile import load_vllm_profile, profile_batches
    from rakv.integrations.vllm_env import check_target, run_in_vllm_python, vllm_python

    check_args(args)
    p = plan(args)
    check_target(args.vllm_target)
    if args.vllm_profile:
        try:
            profile_batches(load_vllm_profile(args.vllm_profile))
        except (OSError, ValueError, TypeError, AttributeError) as e:
            raise ValueError(f"--vllm-profile {args.vllm_profile} is not a vLLM cost profile "
                             f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    out = Path(args.out).expanduser()
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {args.out} is a file, not a folder")
    calls_one = 2 * p["n"] * len(p["arms"]) * p["repeats"] if p["mode"] in ("one", "both") else 0
    calls_b = 2 * len(p["arms"]) * p["repeats"] if p["mode"] in ("batched", "both") else 0
    if args.dry_run:
        print(f"vLLM engine on {args.vllm_target}; arms ({len(p['arms'])}): {', '.join(p['arms'])}")
        print(f"workload: {p['n']} copy-heavy + {p['n']} chat-heldout prompts, at most {p['max_tokens']} new tokens, "
              f"greedy; mode {p['mode']}")
        print(f"generate calls: {calls_one} one at a time + {calls_b} batched (batch {p['n']}) = {calls_one + calls_b}")
        return 0
    for name in VLLM_OUTPUTS:
        A.refuse_overwrite(out / name, "--out", {"--vllm-profile": args.vllm_profile})
    exe = vllm_python()
    out.mkdir(parents=True, exist_ok=True)
    argv = ["bench", "--target", args.vllm_target, "--out", str(out / "vllm.json"), "--md",
            str(out / "vllm-summary.md"), "--arms", ",".join(p["arms"]), "--mode", p["mode"],
            "--repeats", str(p["repeats"]), "--max-tokens", str(p["max_tokens"]), "--copy", str(p["n"]),
            "--chat", str(p["n"]), "--k-max", str(args.vllm_k_max)]
    if args.vllm_profile:
        argv += ["--profile", str(Path(args.vllm_profile).expanduser().resolve())]
    set_env("RAKV_VLLM_STATS", str(out / "vllm-proposer.json"))
    print(f"[rakv] bench --peer vllm: {calls_one + calls_b} generate calls ({', '.join(p['arms'])}; mode "
          f"{p['mode']}) -> {out}" + ("" if exe is None else f" (vLLM in {exe})"), file=sys.stderr, flush=True)
    return run_in_vllm_python(argv, exe)


class VllmPeer(Peer):
    """--peer vllm: the whole run is vLLM's (its own arms, workload and engine); the flags that go
    with it are refused without it."""

    name = "vLLM"

    def add_args(self, ap) -> None:
        add_args(ap)

    def check(self, args) -> None:
        check_args(args)

    def takes_over(self, args) -> bool:
        return args.peer == "vllm"

    def run_alone(self, args) -> int:
        return run(args)

"""summary.md: tables like the paper's (latency and throughput per policy with ratios to ar, kv
and joint:4), per workload and per (prompt bucket, generation length), controller quality against
the oracle, acceptance crossovers, the plots, and the definitions."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import rakv.bench.metrics as M
from .plots import crossover_plot, gate_plot, gate_reliability, latency_plot, predicted_plot

DEFINITIONS = """\
## Definitions

- **Execution**: one policy generating for one request. Timed executions exclude the warm-up pass
  (every policy once, on throwaway engines). Policies are interleaved per request in a rotated
  order; each engine policy has its own engine and prefix cache that sees the same stream.
- **latency**: wall time of the request (ms); **TTFT**: time to the first output token;
  **tokens/s**: output tokens / latency. Tables show medians (p90 where marked).
- **accept len**: mean acceptance length, 1 + (accepted + copies accepted) / rounds (tokens per
  target forward after the first token), mean over executions that ran decoding rounds (peers: not
  reported). Copies are the n-gram tokens the confidence gate verified, k = 0 rounds included
  (`lookup_accepted` in executions.csv); `drafted` / `accepted` count the draft's own rounds.
- **hit %**: share of executions whose prompt hit the prefix cache (q > 0).
- **exact**: every execution's output ids are compared with `ar` on the same request; a
  mismatch is any difference. The count must be 0.
- **xR** (speedup vs policy R): median over requests of latency_R / latency (paired on the same
  request and repeat); > 1 means faster than R.
- **Adaptive against every policy**: for each other policy P, the median over requests of
  latency_P / latency_adaptive (paired on the same request and repeat); > 1: adaptive is faster.
- **Best fixed policy of a workload**: the fixed policy (ar, kv, spec:k, joint:k) with the lowest
  *total* latency over the workload's requests (what serving the workload costs), and separately
  the one with the lowest *median* latency; the adaptive policies' gaps to each, in percent.
- **Controller quality** (per adaptive policy). *Oracle from repeated measurements*: a request is
  a stream position (the same request, in the same cache state, in every repeat); the cost of an
  action (r, k) on it is the **median** over the repeats of the fixed policy that takes that action
  (ar=(0,0), kv=(1,0), spec:k=(0,k), joint:k=(1,k)), its spread the min-max of those repeats. With
  fewer than 3 repeats the oracle is **not de-noised** and is labelled so. Over the actions A both
  predicted (feasible candidates of the per-request decision) and measured: *oracle* = argmin over A
  of the medians. Accuracies are shares of decisions (one per request and repeat):
  *action acc.* strict = chosen (r,k) is the oracle; *within spread* = the chosen action's median is
  no worse than the oracle's slowest repeat (a gap the oracle's own repeats show is noise);
  *k acc.* strict = chosen k = oracle k, within spread = the best measured action with the chosen k
  is within the oracle's spread; *speculate?* (the paper's k accuracy) = the same for the binary
  question k > 0 or not. *MAPE* = mean of |predicted - median measured| / median measured over
  decisions and actions (*full N*: only requests whose `ar` output ran to max_new_tokens, as the
  controller predicts N tokens); *Spearman* = rank correlation of predicted vs median measured over
  A, averaged over decisions. *regret (own)* = per request (median of the adaptive policy's own
  latencies of it - oracle median) / oracle median, mean over requests (per-round control can go
  below 0); *action regret* = (median of the fixed policy of the chosen action - oracle median) /
  oracle median, mean over the request's decisions, then over requests. *held-out*: both regrets
  with the oracle chosen on the other repeats' medians and judged, with the chosen action and the
  policy's own execution, on the held-out repeat (a minimum over noisy medians is biased low, so the
  plain regrets of even a perfect controller exceed 0 where actions tie); *Spearman ceiling*: one
  repeat's measurements ranked against the other repeats' medians, how well the measurements rank
  the actions themselves. 95% CIs: percentile
  bootstrap over requests (2,000 resamples, seed 0). *same choice every repeat*: share of requests
  on which the adaptive policy chose the same action in every repeat. The oracle's measurements
  come from the fixed policies' own engines, whose caches see the same stream (an adaptive engine
  that declined reuse may see a different hit).
- **The paper's table**: per regime group (*no-pay* workloads: best fixed policy by total latency
  has k = 0; *pays*: k > 0), latency = total latency of the adaptive policy / total of kv or
  joint:4 over the same executions - 1 (< 0: adaptive faster); throughput = tokens/s ratio - 1.
- **alpha** of a request: accepted / (accepted + rejecting rounds) over its drafting rounds.
  **Crossover alpha\\***: predicted = smallest alpha with C(k, 0) <= C(0, 0) from the cost profile
  at the median prompt/generation length; measured = the alpha threshold that best separates
  spec:k executions faster than ar from slower ones.
"""


def fmt(v, nd: int = 1, pct: bool = False, x: bool = False) -> str:
    if v is None:
        return "-"
    if pct:
        return f"{v * 100:.{nd}f}%"
    if x:
        return f"{v:.2f}x"
    return f"{v:.{nd}f}" if isinstance(v, float) else str(v)


def md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def policy_md(rows: list[dict], full: bool = True) -> str:
    t = M.policy_table(rows)
    refs = [r for r in M.REFS if any(x["policy"] == r for x in rows)]
    if full:
        head = ["policy", "n", "latency ms", "p90 ms", "TTFT ms", "tok/s", "accept len", "hit %", "mismatch"]
    else:
        head = ["policy", "n", "latency ms", "tok/s", "accept len", "mismatch"]
    head += [f"x{r}" for r in refs]
    body = []
    for p in t:
        cells = [p["policy"], str(p["n"]), fmt(p["latency_ms"], 0)]
        if full:
            cells += [fmt(p["p90_ms"], 0), fmt(p["ttft_ms"], 0)]
        cells += [fmt(p["tokens_per_s"], 1), fmt(p["accept_len"], 2)]
        if full:
            cells += [fmt(p["hit_rate"], 0, pct=True)]
        cells += [str(p["mismatches"])] + [fmt(p[f"vs_{r}"], x=True) for r in refs]
        body.append(cells)
    return md_table(head, body)


def cells_md(rows: list[dict]) -> str:
    """Median latency (ms) per (workload, bucket, gen) x policy."""
    pols = M.policies_in(rows)
    cells = sorted({(r["workload"], r["bucket"], r["gen"]) for r in rows})
    body = []
    for w, b, g in cells:
        rs = [r for r in rows if (r["workload"], r["bucket"], r["gen"]) == (w, b, g)]
        body.append([w, str(b), str(g)] + [fmt(M.median(r["latency_ms"] for r in rs if r["policy"] == p), 0)
                                          for p in pols])
    return md_table(["workload", "P", "N"] + pols, body)


def quality(cands: list[dict], rows: list[dict]) -> list[dict]:
    """controller_quality of every adaptive policy that has data."""
    pols = [p for p in M.policies_in(rows) if p.startswith("adaptive")]
    return [q for q in (M.controller_quality(cands, rows, p) for p in pols) if q]


def ci(v, c, nd: int = 1) -> str:
    """A share with its 95% CI, e.g. '0.4% [0.1, 0.8]'."""
    if v is None:
        return "-"
    if not c:
        return fmt(v, nd, pct=True)
    return f"{v * 100:.{nd}f}% [{c[0] * 100:.{nd}f}, {c[1] * 100:.{nd}f}]"


def ci_only(c, pct: bool = False, nd: int = 1) -> str:
    """A 95% CI alone, e.g. ' [70.0, 90.0]' (shares in percent), '' without one."""
    if not c:
        return ""
    return f" [{c[0] * 100:.{nd}f}, {c[1] * 100:.{nd}f}]" if pct else f" [{c[0]:.2f}, {c[1]:.2f}]"


def signed(v, nd: int = 1) -> str:
    """A relative change with its sign, e.g. '+0.45%' / '-64.0%'."""
    return "-" if v is None else f"{v * 100:+.{nd}f}%"


def denoise_note(rows: list[dict]) -> str:
    n = M.min_repeats(rows)
    if n >= M.MIN_REPEATS:
        return (f"Oracle de-noised: every action measured at least {n} times on every request (the fixed policies, "
                f"one execution per repeat); medians compared, spread = min-max of the repeats.")
    return (f"**Oracle not de-noised**: repeats = {n} < {M.MIN_REPEATS}, so each action's cost on a request is "
            f"{'a single execution' if n == 1 else f'the median of {n} executions'} and run-to-run noise can flip the "
            f"oracle; run with `--repeats {M.MIN_REPEATS}` or more. The figures below are labelled \"not de-noised\".")


def controller_md(qs: list[dict]) -> str:
    if not qs:
        return "_No controller-quality data (needs an adaptive policy and at least two fixed policies)._\n"
    head = ["policy", "requests", "decisions", "|A|", "oracle", "action acc. strict / spread", "k acc. strict / spread",
            "speculate? strict / spread", "MAPE", "MAPE full N", "Spearman (ceiling)", "regret (own) [95% CI]",
            "action regret [95% CI]", "held-out: own / action regret [95% CI]", "regret ms", "same choice every repeat"]
    body = [[q["policy"], str(q["requests"]),
             str(q["decisions"]) + (f" ({q['k_free']} one-token)" if q.get("k_free") else ""), str(q["actions"]),
             f"median of {q['repeats']}" if q["denoised"] else f"not de-noised ({q['repeats']})",
             f"{fmt(q['action_acc'], 0, pct=True)} / {fmt(q['action_acc_spread'], 0, pct=True)}",
             f"{fmt(q['k_acc'], 0, pct=True)} / {fmt(q['k_acc_spread'], 0, pct=True)}",
             f"{fmt(q['spec_acc'], 0, pct=True)} / {fmt(q['spec_acc_spread'], 0, pct=True)}",
             fmt(q["mape"], 1, pct=True), fmt(q["mape_full"], 1, pct=True),
             f"{fmt(q['spearman'], 2)} ({fmt(q.get('spearman_ceiling'), 2)})",
             ci(q["realized"], q["realized_ci"]), ci(q["regret"], q["regret_ci"]),
             f"{ci(q.get('realized_ho'), q.get('realized_ho_ci'))} / {ci(q.get('regret_ho'), q.get('regret_ho_ci'))}",
             fmt(q["regret_ms"], 0),
             fmt(q["consistency"], 0, pct=True)] for q in qs]
    text = md_table(head, body)
    for q in qs:
        text += (f"\n- {q['policy']}: chosen (r,k) counts {q['chosen_counts']}; oracle {q['oracle_counts']}; "
                 f"the oracle action's own spread (max - min) / median: {fmt(q['oracle_noise'], 1, pct=True)} (median "
                 f"over decisions)")
        if q.get("best_fixed_action") is not None:
            text += (f"; the best single action on every request, {q['best_fixed_action']}, has a held-out action "
                     f"regret of {fmt(q['best_fixed_regret_ho'], 1, pct=True)}")
    return text + "\n"


PAPER = dict(action_acc=0.833, k_acc=1.0, mape=0.321, spearman=0.780, regret=0.0032, vs_kv=0.0045, vs_joint4=-0.64,
             executions=3600, mismatches=0)


def fixed_policies(rows: list[dict]) -> list[str]:
    return [p for p in M.policies_in(rows) if M.fixed_action(p) is not None]


def adaptive_vs_md(rows: list[dict]) -> str:
    """Each adaptive policy against every other policy: paired speedup (median over requests of
    latency_other / latency_adaptive; > 1: adaptive is faster), over all requests and per workload."""
    ads = [p for p in M.policies_in(rows) if p.startswith("adaptive")]
    if not ads:
        return "_No adaptive policy in this run._\n"
    others = [p for p in M.policies_in(rows) if p not in ads]
    ws = sorted({r["workload"] for r in rows})
    subsets = [rows] + [[r for r in rows if r["workload"] == w] for w in ws]
    text = ""
    for a in ads:
        head = ["vs policy", "all"] + ws
        body = [[o] + [fmt(M.paired_speedup(rw, a, o), x=True) for rw in subsets] for o in others]
        text += f"\n**{a}** (x = median over requests of latency(policy) / latency({a}); > 1: {a} is faster)\n\n"
        text += md_table(head, body)
    return text


def best_fixed_md(rows: list[dict]) -> str:
    """Per workload: the best fixed policy (lowest total latency over the workload's requests) and
    each adaptive policy's gap to it, in total latency and in median latency."""
    ads = [p for p in M.policies_in(rows) if p.startswith("adaptive")]
    fixed = fixed_policies(rows)
    if not ads or not fixed:
        return "_Needs an adaptive policy and fixed policies._\n"
    body = []
    for w in ["all"] + sorted({r["workload"] for r in rows}):
        rw = rows if w == "all" else [r for r in rows if r["workload"] == w]
        tot = {p: sum(r["latency_ms"] for r in rw if r["policy"] == p) for p in fixed + ads}
        med = {p: M.median(r["latency_ms"] for r in rw if r["policy"] == p) for p in fixed + ads}
        bt = min(fixed, key=lambda p: tot[p])
        pays = M.fixed_action(bt)[1] > 0
        bm = min(fixed, key=lambda p: med[p] if med[p] is not None else float("inf"))
        mixed = w == "all" and len({r["workload"] for r in rows}) > 1
        cells = [w, "(per workload)" if mixed else ("yes" if pays else "no"), f"{bt} {tot[bt] / 1e3:.1f} s"]
        cells += [f"{tot[a] / 1e3:.1f} s ({(tot[a] / tot[bt] - 1) * 100:+.1f}%)" for a in ads]
        cells += [f"{bm} {med[bm]:.0f}"]
        cells += [f"{med[a]:.0f} ({(med[a] / med[bm] - 1) * 100:+.1f}%)" for a in ads]
        body.append(cells)
    head = (["workload", "speculation pays?", "best fixed, total"] + [f"{a} total" for a in ads]
            + ["best fixed, median ms"] + [f"{a} median" for a in ads])
    return md_table(head, body)


def regime_groups(rows: list[dict]) -> list[tuple[str, list[dict]]]:
    """(label, rows): all workloads, then the workloads where speculation does not pay (best
    fixed policy by total latency has k = 0) and those where it pays, when the run has both kinds
    or one kind only (then the group is the same rows, still labelled by its regime)."""
    pays = M.speculation_pays(rows)
    out = [("all workloads", rows)]
    for flag, name in ((False, "no-pay"), (True, "pays")):
        ws = [w for w, p in pays.items() if p is flag]
        if ws:
            out.append((f"{name}: {', '.join(ws)}", [r for r in rows if r["workload"] in ws]))
    if len(out) == 2 and len(out[1][1]) == len(rows):
        out = out[1:]
    return out


def paper_rows(rows: list[dict], cands: list[dict], policy: str, pred_star: dict) -> dict:
    """The paper's table for one adaptive policy over ``rows``: formatted cells by metric."""
    q = M.controller_quality(cands, rows, policy) or {}
    kv, j4 = M.total_vs(rows, policy, "kv"), M.total_vs(rows, policy, "joint:4")
    pts = M.speedup_points(rows)
    tag = "" if q.get("denoised", True) else " (not de-noised)"
    cross = "; ".join(f"k={k}: {fmt(pred_star.get(k), 2)} / {fmt(M.empirical_crossover(xy), 2)}"
                      for k, xy in pts.items()) or "-"
    n_bad = sum(1 for r in rows if not r["match"])
    free = f" ({q['k_free']} one-token decisions left out)" if q and q.get("k_free") else ""
    sp = lambda a, b: (f"{fmt(q.get(a), 1, pct=True)}{ci_only(q.get(a + '_ci'), pct=True)} / "  # noqa: E731
                       f"{fmt(q.get(b), 1, pct=True)}{tag}{free}") if q else "-"
    return {
        "latency vs kv (total)": signed(kv and kv["latency"], 2),
        "latency vs joint:4 (total)": signed(j4 and j4["latency"], 1),
        "throughput vs joint:4": signed(j4 and j4["throughput"], 1),
        "k accuracy: speculate or not, strict / within spread": sp("spec_acc", "spec_acc_spread"),
        "k accuracy: exact k, strict / within spread": sp("k_acc", "k_acc_spread"),
        "action accuracy, strict / within spread": sp("action_acc", "action_acc_spread"),
        "MAPE (full-N requests)": (f"{fmt(q.get('mape'), 1, pct=True)}{ci_only(q.get('mape_ci'), pct=True)} "
                                   f"({fmt(q.get('mape_full'), 1, pct=True)})" if q else "-"),
        "Spearman": (fmt(q.get("spearman"), 3) + ci_only(q.get("spearman_ci"))) if q else "-",
        "regret, own executions [95% CI]": ci(q.get("realized"), q.get("realized_ci"), 2) + tag if q else "-",
        "action regret [95% CI]": ci(q.get("regret"), q.get("regret_ci"), 2) + tag if q else "-",
        "held-out regret: own / action [95% CI]": (f"{ci(q.get('realized_ho'), q.get('realized_ho_ci'), 2)} / "
                                                   f"{ci(q.get('regret_ho'), q.get('regret_ho_ci'), 2)}{tag}") if q else "-",
        "Spearman ceiling (the measurements' own)": fmt(q.get("spearman_ceiling"), 3) if q else "-",
        "alpha* predicted / measured": cross,
        "timed executions / mismatches": f"{len(rows):,} / {n_bad}",
    }


PAPER_CELLS = {
    "latency vs kv (total)": f"+{PAPER['vs_kv'] * 100:.2f}%",
    "latency vs joint:4 (total)": f"{PAPER['vs_joint4'] * 100:.0f}%",
    "throughput vs joint:4": "-",
    "k accuracy: speculate or not, strict / within spread": f"{PAPER['k_acc'] * 100:.0f}%",
    "k accuracy: exact k, strict / within spread": "-",
    "action accuracy, strict / within spread": f"{PAPER['action_acc'] * 100:.1f}%",
    "MAPE (full-N requests)": f"{PAPER['mape'] * 100:.1f}%",
    "Spearman": f"{PAPER['spearman']:.3f}",
    "regret, own executions [95% CI]": f"{PAPER['regret'] * 100:.2f}%",
    "action regret [95% CI]": "-",
    "held-out regret: own / action [95% CI]": "-",
    "Spearman ceiling (the measurements' own)": "-",
    "alpha* predicted / measured": "-",
    "timed executions / mismatches": f"{PAPER['executions']:,} / {PAPER['mismatches']}",
}


def paper_table_md(rows: list[dict], cands: list[dict], pred_star: dict) -> str:
    """The paper's table beside ours: one table per adaptive policy, a column per regime group."""
    ads = [p for p in M.policies_in(rows) if p.startswith("adaptive")]
    if not ads:
        return "_No adaptive policy in this run._\n"
    groups = regime_groups(rows)
    text = ""
    for a in ads:
        cols = [paper_rows(g, cands, a, pred_star) for _, g in groups]
        head = ["metric", "paper (RAKV-ASD, GPT-2 pair)"] + [f"{a}, {label}" for label, _ in groups]
        body = [[m, PAPER_CELLS[m]] + [c[m] for c in cols] for m in PAPER_CELLS]
        text += f"\n**{a}**\n\n" + md_table(head, body)
    return text


def crossover_md(rows: list[dict], predicted: dict) -> str:
    pts = M.speedup_points(rows)
    if not pts:
        return "_No spec:k executions with drafting rounds._\n"
    body = [[str(k), fmt(predicted.get(k), 3), fmt(M.empirical_crossover(xy), 3), str(len(xy)),
             fmt(statistics.fmean(a for a, _ in xy), 3), fmt(M.median(s for _, s in xy), 2)]
            for k, xy in pts.items()]
    return md_table(["k", "predicted alpha*", "measured crossover", "n", "mean alpha", "median speedup"], body)


def predicted_alpha_star(rows: list[dict], meta: dict, out: Path) -> dict:
    prof_path = out / "profile.json"
    if not prof_path.exists():
        return {}
    from rakv.decide.profile import ProfileError, load_profile

    try:
        prof = load_profile(prof_path)
    except ProfileError:
        return {}
    ks = sorted(M.speedup_points(rows))
    if prof is None or not ks:
        return {}
    P = M.median(r["prompt_tokens"] for r in rows) or 1
    N = M.median(r["gen"] for r in rows) or 1
    return M.predicted_crossover(prof, ks, P, N, bool(meta.get("draft_has_model", True)))


def write_summary(out: Path) -> Path:
    rows = M.load_csv(out / "executions.csv")
    cands = M.load_csv(out / "candidates.csv") if (out / "candidates.csv").exists() else []
    meta = json.loads((out / "meta.json").read_text()) if (out / "meta.json").exists() else {}
    pred = predicted_alpha_star(rows, meta, out)
    figs = [latency_plot(rows, out), predicted_plot(cands, rows, out),
            crossover_plot(rows, pred, out), gate_plot(rows, out)]
    text = header_md(rows, meta, run_regime(meta, out))
    text += "\n## Latency and throughput per policy (all requests)\n\n" + policy_md(rows)
    for w in sorted({r["workload"] for r in rows}):
        text += f"\n## Workload: {w}\n\n" + policy_md([r for r in rows if r["workload"] == w], full=False)
    text += conversation_md(rows)
    text += "\n## Median latency (ms) per prompt bucket P and generation length N\n\n" + cells_md(rows)
    text += "\n## Adaptive against every policy (paired ratios)\n" + adaptive_vs_md(rows)
    text += "\n## Adaptive against the best fixed policy of each workload\n\n" + best_fixed_md(rows)
    text += explore_md(rows)
    text += llama_cpp_md(rows, out)
    quiet, dropped = M.quiet_rows(rows)
    if dropped:
        text += (f"\n### The same without contended requests\n\n{dropped} of {len({M.key(r) for r in rows})} "
                 f"request positions dropped: in at least one policy's execution the main thread got less than "
                 f"{M.QUIET_SHARE:.0%} of the wall time (another process took the CPU).\n\n" + best_fixed_md(quiet))
    qs = quality(cands, rows)
    text += ("\n## Controller quality (oracle = every action run on the same request, median over repeats)\n\n"
             + denoise_note(rows) + "\n\n" + controller_md(qs))
    if qs:
        text += ("\n### Next to the paper's controller (the paper's table, per regime)\n\n"
                 "Regime of a workload: *no-pay* when its best fixed policy by total latency has k = 0, *pays* "
                 "otherwise (this machine's costs are in the header).\n" + paper_table_md(rows, cands, pred))
    text += "\n## Acceptance crossover per k (no reuse)\n\n" + crossover_md(rows, pred)
    text += gate_md(rows)
    text += "\n## Plots\n\n" + "".join(f"![{f.stem}]({f.name})\n\n" for f in figs if f is not None)
    text += "\n" + DEFINITIONS
    path = out / "summary.md"
    path.write_text(text, encoding="utf-8")
    return path


def llama_cpp_table(rows: list[dict]) -> list[dict]:
    """llama.cpp's arms (--peer-llama-cpp) next to ours: per policy, median tokens/s (end to end and
    decode only), acceptance (sum accepted / sum drafted), and for each llama.cpp arm the paired
    median ratios of its tokens/s to our ar's, to our counterpart's (spec:N for llama.cpp:spec:N, ar
    for llama.cpp:ar) and to our fastest policy's (by median tokens/s)."""
    from .peers.llamacpp import PREFIX, is_arm

    pols = M.policies_in(rows)
    theirs = [p for p in pols if is_arm(p)]
    if not theirs:
        return []
    ours = [p for p in pols if not is_arm(p) and p != "llama.cpp" and not p.startswith("hf:")]

    def tps(p):
        return {M.key(r): r["tokens_per_s"] for r in rows if r["policy"] == p and r["tokens_per_s"]}

    def med(p, col):
        return M.median(r.get(col) for r in rows if r["policy"] == p and isinstance(r.get(col), (int, float)))

    fastest = max(ours, key=lambda p: med(p, "tokens_per_s") or 0.0) if ours else None
    out = []
    for p in ours + theirs:
        rs = [r for r in rows if r["policy"] == p]
        dr = sum(r["drafted"] for r in rs if isinstance(r.get("drafted"), (int, float)))
        ac = sum(r["accepted"] for r in rs if isinstance(r.get("accepted"), (int, float)))
        t = dict(policy=p, side="llama.cpp" if p in theirs else "rakv", n=len(rs), tokens_per_s=med(p, "tokens_per_s"),
                 decode_tps=med(p, "decode_tps"), acceptance=ac / dr if dr else None,
                 prompt_tokens=med(p, "prompt_tokens"), peer_prompt_tokens=med(p, "peer_prompt_tokens"),
                 text_match=(sum(1 for r in rs if r.get("text_match") == 1) / len(rs)) if p in theirs and rs else None)
        if p in theirs:
            mine = p[len(PREFIX):]
            for name, ref in (("vs_ar", "ar"), ("vs_counterpart", mine if mine in ours else None),
                              ("vs_fastest", fastest)):
                a, b = tps(p), tps(ref) if ref else {}
                t[name] = M.median(a[k] / b[k] for k in a if k in b and b[k])
                t[name + "_policy"] = ref
        out.append(t)
    return out


def llama_cpp_md(rows: list[dict], out: Path | None = None) -> str:
    """The llama.cpp section of summary.md (and llama_cpp.json beside it)."""
    t = llama_cpp_table(rows)
    if not t:
        return ""
    if out is not None:
        (out / "llama_cpp.json").write_text(json.dumps(t, indent=1), encoding="utf-8")
    body = []
    for p in t:
        body.append([p["policy"], p["side"], str(p["n"]), fmt(p["tokens_per_s"], 1), fmt(p["decode_tps"], 1),
                     fmt(p["acceptance"], 0, pct=True),
                     fmt(p["peer_prompt_tokens"] if p["side"] == "llama.cpp" else p["prompt_tokens"], 0),
                     fmt(p["text_match"], 0, pct=True),
                     fmt(p.get("vs_ar"), x=True), fmt(p.get("vs_counterpart"), x=True),
                     (fmt(p.get("vs_fastest"), x=True) + (f" ({p['vs_fastest_policy']})" if p.get("vs_fastest_policy")
                                                          else "")) if p["side"] == "llama.cpp" else "-"])
    return ("\n## llama.cpp on the same files (--peer-llama-cpp)\n\n"
            "Interleaved with our policies request by request, the same prompts and max new tokens, greedy, the same "
            "thread count. tok/s: output tokens / (prompt + decode time), llama.cpp's own timings (model loading "
            "excluded on both sides); decode tok/s: the tokens after the first over the time after it (llama.cpp: "
            "its eval / decoded lines); acceptance: accepted / drafted; prompt: median prompt tokens as each side "
            "tokenized it; same text: share of requests where llama.cpp's text and our ar's agree as far as the shorter goes. Ratios: paired "
            "medians of llama.cpp's tokens/s over ours (> 1: llama.cpp faster).\n\n"
            + md_table(["policy", "side", "n", "tok/s", "decode tok/s", "acceptance", "prompt", "same text",
                        "/ our ar", "/ our counterpart", "/ our fastest"], body))


def conversation_md(rows: list[dict]) -> str:
    """Conversation workloads, per turn and policy: medians of the prompt P, the hit q, TTFT and
    latency, and TTFT against ar's on the same executions (median of the paired ratios)."""
    conv = [r for r in rows if (r.get("turn") or 0) > 0]
    if not conv:
        return ""
    pols = M.policies_in(conv)
    ar = {M.key(r): r for r in conv if r["policy"] == "ar"}
    body = []
    for w in sorted({r["workload"] for r in conv}):
        for t in sorted({r["turn"] for r in conv if r["workload"] == w}):
            for p in pols:
                rs = [r for r in conv if r["workload"] == w and r["turn"] == t and r["policy"] == p]
                if not rs:
                    continue
                P, q = M.median(r["prompt_tokens"] for r in rs), M.median(r["hit_tokens"] for r in rs)
                before = M.median(min(r["hit_tokens"] or 0, r.get("previous_tokens") or 0) / r["previous_tokens"]
                                  for r in rs if r.get("previous_tokens"))
                x = M.median(ar[M.key(r)]["ttft_ms"] / r["ttft_ms"] for r in rs
                             if M.key(r) in ar and r["ttft_ms"] and ar[M.key(r)]["ttft_ms"])
                body.append([w, str(t), p, str(len(rs)), fmt(P, 0), fmt(q, 0),
                             fmt(q / P if P else None, 0, pct=True), fmt(before, 0, pct=True),
                             fmt(M.median(r["ttft_ms"] for r in rs), 0),
                             fmt(M.median(r["latency_ms"] for r in rs), 0), fmt(x, x=True)])
    return ("\n## Conversations: reuse and latency per turn\n\nA turn's prompt is the whole conversation so "
            "far; turn 1 hits the chat template's shared prefix at most, a later turn the previous turn's prompt "
            "and answer (policies that reuse). Medians; *from before* = the share of the conversation before the "
            "turn (as fed) that the hit covers; TTFT vs ar = median over the same executions of ar's TTFT / the "
            "policy's.\n\n"
            + md_table(["workload", "turn", "policy", "n", "P", "hit q", "q/P", "from before", "TTFT ms",
                        "latency ms", "TTFT vs ar"], body))


def explore_md(rows: list[dict]) -> str:
    """What each adaptive policy spent on exploration (probes' cost beyond the plain steps they replaced)."""
    out = []
    for p in (p for p in M.policies_in(rows) if p.startswith("adaptive")):
        mine = [r for r in rows if r["policy"] == p]
        total = sum(r["latency_ms"] or 0 for r in mine)
        spent = sum(r.get("explore_ms") or 0 for r in mine)
        if total > 0:
            out.append(f"- {p}: exploration {spent:.0f} ms of {total / 1e3:.1f} s ({100 * spent / total:.2f}%)")
    return ("\n" + "\n".join(out) + "\n") if out else ""


def gate_md(rows: list[dict]) -> str:
    """The confidence gate's calibration per gated policy: predicted vs observed per bin, and its
    stop reasons (empty when no policy used the gate)."""
    rels = gate_reliability(rows)
    if not rels:
        return ""
    text = "\n## Confidence gate: predicted against observed acceptance (judged drafted tokens)\n\n"
    for pol, rel in sorted(rels.items()):
        stops: dict[str, int] = {}
        for r in rows:
            if r["policy"] == pol:
                for s in (r.get("gate_stops") or "").split():
                    k, v = s.split(":")
                    stops[k] = stops.get(k, 0) + int(v)
        text += (f"**{pol}**: {sum(rel.n)} tokens, calibration error (ECE) {rel.error():.3f}; draft stops: "
                 + ", ".join(f"{k} {v}" for k, v in sorted(stops.items())) + "\n\n")
        text += md_table(["predicted bin", "tokens", "mean predicted", "observed"],
                         [[f"{x['bin'][0]:.1f}-{x['bin'][1]:.1f}", str(x["n"]), f"{x['predicted']:.3f}",
                           f"{x['observed']:.3f}"] for x in rel.rows()]) + "\n"
    return text


def run_regime(meta: dict, out: Path) -> dict | None:
    """The regime recorded with the run (meta.json); for an older run, the cost figures from its
    saved profile (the ISA and threads of that machine were not recorded then)."""
    if meta.get("regime"):
        return meta["regime"]
    prof_path = out / "profile.json"
    if not prof_path.exists():
        return None
    from rakv.decide.profile import load_profile
    from rakv.decide.regime import regime

    prof = load_profile(prof_path)
    if prof is None:
        return None
    reg = regime(prof, cpuinfo="")
    reg.update(isa=None, cpu_capability=None, threads=meta.get("threads"))
    return reg


def header_md(rows: list[dict], meta: dict, reg: dict | None = None) -> str:
    n_bad = sum(1 for r in rows if not r["match"])
    kinds = {k: sum(1 for r in rows if r["kind"] == k and r["policy"] == "ar") for k in ("unrelated", "shared", "repeat")}
    lines = ["# rakv bench summary", ""]
    natural = any(str(w).startswith(("chat", "code", "conversation")) or "/" in str(w) or "." in str(w) for w in meta.get("workloads", []))
    if meta.get("command"):
        lines += [f"Command: `{meta['command']}`", ""]
    lines += [f"- target `{meta.get('target', '?')}`, draft `{meta.get('draft', '?')}`, "
              f"numerics {meta.get('numerics', 'fp32')}, K = {meta.get('k_set', '?')}, "
              f"lookup k = {meta.get('lookup_k', '?')}",
              f"- workloads {meta.get('workloads', '?')}; prompt buckets {meta.get('buckets', '?')}"
              f"{' (bucketed workloads only; chat and file prompts keep their own length)' if natural else ''}; "
              f"generation lengths {meta.get('gens', '?')}; {meta.get('n_prompts', '?')} requests per stream; "
              f"repeats {meta.get('repeats', '?')}; seed {meta.get('seed', '?')}"
              + (f"; chat prompts {'through the chat template' if meta['chat_template'] else 'raw'}"
                 if "chat_template" in meta and any(str(w).startswith(("chat", "code", "conversation"))
                                                    for w in meta.get("workloads", []))
                 else ""),
              f"- requests per kind (per repeat x stream): unrelated {kinds['unrelated']}, shared context "
              f"{kinds['shared']}, exact repeat {kinds['repeat']}",
              f"- **{len(rows)} timed executions, {n_bad} mismatches vs ar**; wall time "
              f"{meta.get('elapsed_s', 0) / 60:.1f} min",
              f"- machine: {meta.get('hardware', {}).get('cpu', '?')}, {meta.get('threads', '?')} torch threads; "
              f"torch {meta.get('versions', {}).get('torch', '?')}, transformers "
              f"{meta.get('versions', {}).get('transformers', '?')}", ""]
    lines += ["## Regime of this machine and pair", ""]
    if reg:
        lines += [f"- {x}" for x in describe_regime(reg)]
    else:
        lines += ["- not recorded (no regime in meta.json and no profile.json)"]
    alphas = M.workload_alpha(rows)
    pays = M.speculation_pays(rows)
    lines += ["- measured alpha per workload (mean per-request alpha of the fixed drafting policies) and whether "
              "speculation pays there (best fixed policy by total latency has k > 0): "
              + "; ".join(f"{w} alpha {fmt(a, 3)}, {'pays' if pays.get(w) else 'does not pay'} "
                          f"(best {M.best_fixed([r for r in rows if r['workload'] == w])})" for w, a in alphas.items()),
              ""]
    return "\n".join(lines)


def load_run(out: Path) -> dict:
    """A finished run's rows, candidates, meta, regime and predicted alpha* (for side-by-side tables)."""
    rows = M.load_csv(out / "executions.csv")
    cands = M.load_csv(out / "candidates.csv") if (out / "candidates.csv").exists() else []
    meta = json.loads((out / "meta.json").read_text()) if (out / "meta.json").exists() else {}
    return dict(out=out, rows=rows, cands=cands, meta=meta, regime=run_regime(meta, out),
                pred=predicted_alpha_star(rows, meta, out))


def compare_md(outs: list[Path]) -> str:
    """The paper's table across several runs (e.g. one per draft or machine: the regimes side by
    side), one column per run x regime group x adaptive policy, and each run's regime."""
    runs = [load_run(Path(o)) for o in outs]
    cols, text = [], "# The paper's table across runs\n\n"
    for i, run in enumerate(runs, 1):
        m = run["meta"]
        text += f"**run {i}** `{run['out']}`: target `{m.get('target', '?')}`, draft `{m.get('draft', '?')}`; "
        text += denoise_note(run["rows"]) + "\n\n"
        text += "".join(f"- {x}\n" for x in (describe_regime(run["regime"]) if run["regime"] else ["regime not recorded"]))
        text += "\n"
        for a in (p for p in M.policies_in(run["rows"]) if p.startswith("adaptive")):
            for label, g in regime_groups(run["rows"]):
                cols.append((f"run {i} {m.get('draft', '?')}, {a}, {label}", paper_rows(g, run["cands"], a, run["pred"])))
    if not cols:
        return text + "_No adaptive policy in these runs._\n"
    head = ["metric", "paper (RAKV-ASD, GPT-2 pair)"] + [c for c, _ in cols]
    return text + md_table(head, [[k, PAPER_CELLS[k]] + [c[k] for _, c in cols] for k in PAPER_CELLS])


def describe_regime(reg: dict) -> list[str]:
    from rakv.decide.regime import describe

    return describe(reg)


if __name__ == "__main__":      # python -m rakv.bench.report OUT_DIR [OUT_DIR ...]
    import sys

    if len(sys.argv) < 2:
        sys.exit("usage: python -m rakv.bench.report OUT_DIR [OUT_DIR ...]  (the paper's table across runs)")
    print(compare_md([Path(a) for a in sys.argv[1:]]))

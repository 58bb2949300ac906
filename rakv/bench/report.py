"""summary.md: tables like the paper's (latency and throughput per policy with ratios to ar, kv
and joint:4), per workload and per (prompt bucket, generation length), controller quality against
the oracle, acceptance crossovers, the plots, and the definitions."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from . import metrics as M
from . import plots

DEFINITIONS = """\
## Definitions

- **Execution**: one policy generating for one request. Timed executions exclude the warm-up pass
  (every policy once, on throwaway engines). Policies are interleaved per request in a rotated
  order; each engine policy has its own engine and prefix cache that sees the same stream.
- **latency**: wall time of the request (ms); **TTFT**: time to the first output token;
  **tokens/s**: output tokens / latency. Tables show medians (p90 where marked).
- **accept len**: mean acceptance length, 1 + accepted / rounds (tokens per target forward after
  the first token), mean over executions that ran decoding rounds (peers: not reported).
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
- **Controller quality** (per adaptive policy; the oracle runs every action (r, k) on the same
  request: the fixed policies ar=(0,0), kv=(1,0), spec:k=(0,k), joint:k=(1,k)). Over the actions
  A both predicted (feasible candidates of the per-request decision) and measured:
  *oracle* = argmin over A of measured latency; *action acc.* = share of requests with chosen
  (r,k) = oracle; *k acc.* = share with chosen k = oracle k; *MAPE* = mean of
  |predicted - measured| / measured over requests and actions (*full N*: only requests whose `ar`
  output ran to max_new_tokens, as the controller predicts N tokens); *Spearman* = rank correlation of
  predicted vs measured costs over A, averaged over requests; *regret* = mean of
  (measured(chosen) - measured(oracle)) / measured(oracle); *realized* = the same with the
  adaptive policy's own measured latency instead of measured(chosen) (per-round control can go
  below 0). The oracle's measurements come from the fixed policies' own engines, whose caches see
  the same stream (an adaptive engine that declined reuse may see a different hit).
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


def controller_md(qs: list[dict]) -> str:
    if not qs:
        return "_No controller-quality data (needs an adaptive policy and at least two fixed policies)._\n"
    head = ["policy", "requests", "|A|", "action acc.", "k acc.", "MAPE", "MAPE full N", "Spearman", "regret", "regret ms",
            "realized"]
    body = [[q["policy"], str(q["requests"]), str(q["actions"]), fmt(q["action_acc"], 0, pct=True),
             fmt(q["k_acc"], 0, pct=True), fmt(q["mape"], 1, pct=True),
             fmt(q["mape_full"], 1, pct=True), fmt(q["spearman"], 2),
             fmt(q["regret"], 1, pct=True), fmt(q["regret_ms"], 0), fmt(q["realized"], 1, pct=True)] for q in qs]
    text = md_table(head, body)
    for q in qs:
        text += f"\n- {q['policy']}: chosen (r,k) counts {q['chosen_counts']}; oracle {q['oracle_counts']}"
    return text + "\n"


PAPER = dict(action_acc=0.833, k_acc=1.0, mape=0.321, spearman=0.780, regret=0.0032)


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
        bm = min(fixed, key=lambda p: med[p] if med[p] is not None else float("inf"))
        cells = [w, f"{bt} {tot[bt] / 1e3:.1f} s"]
        cells += [f"{tot[a] / 1e3:.1f} s ({(tot[a] / tot[bt] - 1) * 100:+.1f}%)" for a in ads]
        cells += [f"{bm} {med[bm]:.0f}"]
        cells += [f"{med[a]:.0f} ({(med[a] / med[bm] - 1) * 100:+.1f}%)" for a in ads]
        body.append(cells)
    head = (["workload", "best fixed, total"] + [f"{a} total" for a in ads]
            + ["best fixed, median ms"] + [f"{a} median" for a in ads])
    return md_table(head, body)


def paper_md(qs: list[dict]) -> str:
    if not qs:
        return ""
    head = ["metric", "paper (RAKV-ASD)"] + [q["policy"] for q in qs]
    names = [("action_acc", "action accuracy (higher is better)", True), ("k_acc", "k accuracy (higher)", True),
             ("mape", "MAPE, all requests (lower)", True), ("mape_full", "MAPE, full-N requests (lower)", True),
             ("spearman", "Spearman (higher)", False), ("regret", "mean regret (lower)", True)]
    body = []
    for key, label, pct in names:
        ref = PAPER.get(key, PAPER.get("mape") if key == "mape_full" else None)
        cells = [label, fmt(ref, 1 if key != "k_acc" else 0, pct=True) if pct else fmt(ref, 3)]
        cells += [fmt(q[key], 1, pct=True) if pct else fmt(q[key], 3) for q in qs]
        body.append(cells)
    return md_table(head, body)


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
    from rakv.costs import CostProfile, ProfileError

    try:
        prof = CostProfile.load(prof_path)
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
    figs = [plots.latency_plot(rows, out), plots.predicted_plot(cands, rows, out),
            plots.crossover_plot(rows, pred, out)]
    text = header_md(rows, meta)
    text += "\n## Latency and throughput per policy (all requests)\n\n" + policy_md(rows)
    for w in sorted({r["workload"] for r in rows}):
        text += f"\n## Workload: {w}\n\n" + policy_md([r for r in rows if r["workload"] == w], full=False)
    text += "\n## Median latency (ms) per prompt bucket P and generation length N\n\n" + cells_md(rows)
    text += "\n## Adaptive against every policy (paired ratios)\n" + adaptive_vs_md(rows)
    text += "\n## Adaptive against the best fixed policy of each workload\n\n" + best_fixed_md(rows)
    qs = quality(cands, rows)
    text += "\n## Controller quality (oracle = every action run on the same request)\n\n" + controller_md(qs)
    pm = paper_md(qs)
    if pm:
        text += "\n### Next to the paper's controller\n\n" + pm
    text += "\n## Acceptance crossover per k (no reuse)\n\n" + crossover_md(rows, pred)
    text += "\n## Plots\n\n" + "".join(f"![{f.stem}]({f.name})\n\n" for f in figs if f is not None)
    text += "\n" + DEFINITIONS
    path = out / "summary.md"
    path.write_text(text, encoding="utf-8")
    return path


def header_md(rows: list[dict], meta: dict) -> str:
    n_bad = sum(1 for r in rows if not r["match"])
    kinds = {k: sum(1 for r in rows if r["kind"] == k and r["policy"] == "ar") for k in ("unrelated", "shared", "repeat")}
    lines = ["# rakv bench summary", ""]
    natural = any(str(w).startswith("chat") or "/" in str(w) or "." in str(w) for w in meta.get("workloads", []))
    if meta.get("command"):
        lines += [f"Command: `{meta['command']}`", ""]
    lines += [f"- target `{meta.get('target', '?')}`, draft `{meta.get('draft', '?')}`, K = {meta.get('k_set', '?')}, "
              f"lookup k = {meta.get('lookup_k', '?')}",
              f"- workloads {meta.get('workloads', '?')}; prompt buckets {meta.get('buckets', '?')}"
              f"{' (bucketed workloads only; chat and file prompts keep their own length)' if natural else ''}; "
              f"generation lengths {meta.get('gens', '?')}; {meta.get('n_prompts', '?')} requests per stream; "
              f"repeats {meta.get('repeats', '?')}; seed {meta.get('seed', '?')}"
              + (f"; chat prompts {'through the chat template' if meta['chat_template'] else 'raw'}"
                 if "chat_template" in meta and any(str(w).startswith("chat") for w in meta.get("workloads", []))
                 else ""),
              f"- requests per kind (per repeat x stream): unrelated {kinds['unrelated']}, shared context "
              f"{kinds['shared']}, exact repeat {kinds['repeat']}",
              f"- **{len(rows)} timed executions, {n_bad} mismatches vs ar**; wall time "
              f"{meta.get('elapsed_s', 0) / 60:.1f} min",
              f"- machine: {meta.get('hardware', {}).get('cpu', '?')}, {meta.get('threads', '?')} torch threads; "
              f"torch {meta.get('versions', {}).get('torch', '?')}, transformers "
              f"{meta.get('versions', {}).get('transformers', '?')}", ""]
    return "\n".join(lines)

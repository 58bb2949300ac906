"""PNG plots (matplotlib, Agg): latency per policy per workload; predicted vs measured action
cost (measured: median over repeats, min-max whiskers); measured speedup vs alpha per k (one
point per request, medians over repeats) with the crossover marked."""

from __future__ import annotations

from pathlib import Path

import rakv.bench.metrics as M


def _save(plt, fig, path: Path) -> Path:
    """Lay the figure out, write it as a PNG (110 dpi), close it."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plt():
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def latency_plot(rows: list[dict], out: Path) -> Path | None:
    plt = _plt()
    if plt is None or not rows:
        return None
    pols = M.policies_in(rows)
    wls = sorted({r["workload"] for r in rows})
    fig, ax = plt.subplots(figsize=(min(13, max(6, 0.3 * len(pols) * len(wls) + 3)), 4.5))
    width = 0.8 / len(wls)
    for j, w in enumerate(wls):
        med, lo, hi = [], [], []
        for p in pols:
            xs = [r["latency_ms"] for r in rows if r["policy"] == p and r["workload"] == w]
            m = M.median(xs) or 0.0
            med.append(m)
            lo.append(m - (M.quantile(xs, 0.25) or m))
            hi.append((M.quantile(xs, 0.75) or m) - m)
        xs = [i + (j - (len(wls) - 1) / 2) * width for i in range(len(pols))]
        ax.bar(xs, med, width, yerr=[lo, hi], capsize=2, label=w)
    ax.set_xticks(range(len(pols)))
    ax.set_xticklabels(pols, rotation=40, ha="right")
    ax.set_ylabel("median latency per request (ms), IQR bars")
    ax.set_title("Latency per policy and workload")
    ax.legend(fontsize=8)
    return _save(plt, fig, out / "latency.png")


def predicted_plot(cands: list[dict], rows: list[dict], out: Path) -> Path | None:
    plt = _plt()
    pols = [p for p in M.policies_in(rows) if p.startswith("adaptive")]
    pts = [(p, s, a) for pol in pols for x in M.per_request_quality(cands, rows, pol)
           for p, s, a in zip(x["pred"], x["spreads"], x["actions"])]
    if plt is None or not pts:
        return None
    fig, ax = plt.subplots(figsize=(5.5, 5))
    ks = sorted({a[1] for _, _, a in pts})
    cmap = plt.get_cmap("viridis", max(2, len(ks)))
    for i, k in enumerate(ks):
        for r, mk in ((0, "o"), (1, "^")):
            sel = [(p, s) for p, s, a in pts if a == (r, k)]
            if sel:
                ax.errorbar([s.median for _, s in sel], [p for p, _ in sel],
                            xerr=[[s.median - s.lo for _, s in sel], [s.hi - s.median for _, s in sel]],
                            fmt=mk, ms=3.5, color=cmap(i), alpha=0.7, elinewidth=0.6, label=f"r={r} k={k}")
    hi = max(max(p, s.hi) for p, s, _ in pts) * 1.05
    ax.plot([0, hi], [0, hi], "k--", lw=1)
    ax.set_xlim(0, hi)
    ax.set_ylim(0, hi)
    ax.set_xlabel("measured latency of the action (ms): median, min-max of repeats")
    ax.set_ylabel("controller's predicted cost (ms)")
    ax.set_title("Predicted vs measured action cost")
    ax.legend(fontsize=6, ncol=2)
    return _save(plt, fig, out / "predicted_vs_measured.png")


def crossover_plot(rows: list[dict], predicted: dict, out: Path) -> Path | None:
    plt = _plt()
    pts = M.speedup_points(rows)
    if plt is None or not pts:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    cmap = plt.get_cmap("tab10")
    for i, (k, xy) in enumerate(pts.items()):
        c = cmap(i % 10)
        ax.scatter([a for a, _ in xy], [s for _, s in xy], s=12, color=c, alpha=0.7, label=f"spec:{k}")
        a_pred = predicted.get(k)
        if a_pred is not None:
            ax.axvline(a_pred, color=c, ls="--", lw=1)
        a_emp = M.empirical_crossover(xy)
        if a_emp is not None:
            ax.axvline(a_emp, color=c, ls=":", lw=1.5)
    ax.axhline(1.0, color="k", lw=1)
    ax.set_xlim(-0.02, 1.02)
    ax.set_xlabel("per-request acceptance alpha")
    ax.set_ylabel("measured speedup vs ar (latency_ar / latency)")
    ax.set_title("Speedup vs alpha per k (dashed: predicted alpha*, dotted: measured)")
    ax.legend(fontsize=7)
    return _save(plt, fig, out / "speedup_vs_alpha.png")


def gate_reliability(rows: list[dict]) -> dict:
    """Per gated policy: rakv.decide.gate.Reliability over every judged drafted token of the run."""
    from rakv.decide.gate import Reliability

    out: dict = {}
    for r in rows:
        toks = (r.get("gate_tokens") or "").split()
        if not toks:
            continue
        rel = out.setdefault(r["policy"], Reliability())
        for t in toks:
            p, ok = t.split(":")
            rel.add_one(float(p), ok == "1")
    return out


def gate_plot(rows: list[dict], out: Path) -> Path | None:
    """Reliability diagram of the confidence gate: predicted acceptance against observed, per bin."""
    plt = _plt()
    rels = gate_reliability(rows)
    if plt is None or not rels:
        return None
    fig, ax = plt.subplots(figsize=(4.8, 4.5))
    ax.plot([0, 1], [0, 1], "--", color="#999", lw=1, label="calibrated")
    for pol, rel in sorted(rels.items()):
        rs = rel.rows()
        top = max(x["n"] for x in rs)
        ax.scatter([x["predicted"] for x in rs], [x["observed"] for x in rs],
                   s=[20 + 180 * (x["n"] / top) ** 0.5 for x in rs], alpha=0.7,
                   label=f"{pol} (ECE {rel.error():.3f}, {sum(rel.n)} tokens)")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_xlabel("predicted acceptance (gate)")
    ax.set_ylabel("observed acceptance")
    ax.set_title("Confidence gate: reliability")
    ax.legend(fontsize=7, loc="upper left")
    return _save(plt, fig, out / "gate_reliability.png")

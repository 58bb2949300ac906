"""``rakv bench --edits``: the edit trace (rakv/workloads/edits.py) replayed against /infill servers
on this machine, as an editor's completion client would send it: ``rakv serve`` (one arm per
policy) and llama.cpp's ``llama-server`` (``--cache-reuse 256``, with and without its draft ``-md``)
on the same GGUF files, started here on loopback, one at a time.

Interleaved: file by file, every arm on a server started afresh for that file (its cache holds
nothing from an earlier file or arm), the arms' order rotated per file and repeat. Each request is
sent whole and waited for (``stream: false``, as llama.vim does), its latency taken at the client.

Reported per arm, over the completion requests (warm-ups apart): latency p50 / p95 with bootstrap
CIs, the share of the prompt's tokens the server reused (its ``timings.cache_n`` over the prompt's
tokens; llama-server's ``tokens_cached`` counts the answer too) p50 and min, the same for the first
keystroke after each warm-up, and mismatches: completions whose text differs from the ``rakv-ar``
arm's (target-only greedy decoding) for the same request. Writes OUT/edits.json, OUT/edits.csv,
OUT/edits.md.
"""

from __future__ import annotations

import csv
import json
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from rakv import argtypes as A

ARMS_HELP = ("rakv (rakv serve with the first --policies, else adaptive) | rakv-ar (target-only greedy, no "
             "reuse: the exactness reference) | rakv-kv (target-only greedy through the prefix cache: the "
             "reference when rakv-ar is not run) | rakv:POLICY (e.g. rakv:joint:4) | llama (llama-server "
             "--cache-reuse 256 on --target's GGUF) | llama-md (with --draft's GGUF as -md)")
REFERENCE = "rakv-ar"
# the arms whose texts every other arm's are compared with, the first present: target-only greedy
# decoding, without the prefix cache (ar) or through it (kv: the same ids, tests/engine/test_exactness.py)
REFERENCES = (REFERENCE, "rakv-kv")
FIXED = {REFERENCE: "ar", "rakv-kv": "kv"}


@dataclass
class EditResult:
    arm: str
    file: str
    id: str
    kind: str
    key: int
    text: str
    latency_s: float
    prompt_tokens: int | None      # the prompt's tokens as the server built it
    reused_tokens: int | None      # of them, taken from its cache
    tokens_cached: int | None      # the server's own field, as it sent it
    predicted: int | None
    action: str = ""               # rakv serve's decision for the request: "r1 k0 argmin" (its ``rakv`` object)
    drafted: int | None = None     # the model draft's tokens (rakv serve)
    accepted: int | None = None
    copied: int | None = None      # n-gram copies from the prompt the gate verified in k = 0 rounds
    copies_accepted: int | None = None
    ok: bool = True
    error: str = ""

    @property
    def reused_share(self) -> float | None:
        if self.prompt_tokens and self.reused_tokens is not None:
            return self.reused_tokens / self.prompt_tokens
        return None


# ----------------------------------------------------------------------------- one request
def reuse_of(obj: dict) -> tuple[int | None, int | None]:
    """(prompt tokens, reused tokens) from an /infill answer: llama-server's ``timings`` (cache_n
    reused, prompt_n computed) or ``tokens_evaluated``; an OpenAI ``usage`` with
    ``prompt_tokens_details.cached_tokens`` otherwise."""
    t = obj.get("timings") or {}
    if "cache_n" in t and "prompt_n" in t:
        return int(t["cache_n"]) + int(t["prompt_n"]), int(t["cache_n"])
    u = obj.get("usage") or {}
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
    if u.get("prompt_tokens") is not None:
        return int(u["prompt_tokens"]), None if cached is None else int(cached)
    n = obj.get("tokens_evaluated")
    return (int(n) if n is not None else None), None


def decision_of(obj: dict) -> tuple:
    """(action, drafted, accepted, copied, copies accepted) from rakv serve's ``rakv`` object
    (("", None, ...) from another server)."""
    r = obj.get("rakv") or {}
    ds = r.get("decisions") or []
    act = " / ".join(f"r{d['action'].get('reuse')} k{d['action'].get('k')} {d.get('reason', '')}".strip()
                     for d in ds if isinstance(d, dict) and isinstance(d.get("action"), dict))
    return act, r.get("drafted"), r.get("accepted"), r.get("copied"), r.get("copies_accepted")


def infill(url: str, body: dict, timeout: float = 600.0) -> tuple[dict, float]:
    """One POST /infill; (the answer's JSON, latency s). An HTTP error: RuntimeError with its message."""
    req = urllib.request.Request(url + "/infill", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            obj = json.loads(r.read().decode("utf-8", "replace"))
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"HTTP {e.code}: {e.read().decode('utf-8', 'replace')[:200]}") from None
    return obj, time.perf_counter() - t0


def replay(url: str, arm: str, requests, timeout: float = 600.0) -> list[EditResult]:
    """Send a file's requests in order, each when the last answered."""
    out = []
    for rq in requests:
        try:
            obj, lat = infill(url, rq.body(), timeout)
            if "error" in obj:
                raise RuntimeError(str(obj["error"])[:200])
            p, c = reuse_of(obj)
            pred = (obj.get("timings") or {}).get("predicted_n", obj.get("tokens_predicted"))
            out.append(EditResult(arm, rq.file, rq.id, rq.kind, rq.key, obj.get("content", ""), lat, p, c,
                                  obj.get("tokens_cached"), None if pred is None else int(pred), *decision_of(obj)))
        except (OSError, RuntimeError, ValueError) as e:
            out.append(EditResult(arm, rq.file, rq.id, rq.kind, rq.key, "", 0.0, None, None, None, None,
                                  ok=False, error=f"{type(e).__name__}: {e}"[:200]))
    return out


# ----------------------------------------------------------------------------- the arms
def arm_names(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names:
        raise ValueError("--edits is empty")
    from rakv.config import Policy

    for n in names:
        if n.startswith("rakv:"):
            Policy.parse(n[5:])
        elif n not in ("rakv", *FIXED, "llama", "llama-md"):
            raise ValueError(f"--edits: unknown arm {n!r} ({ARMS_HELP})")
    return names


def server_specs(args, names: list[str]) -> list:
    """A ServerSpec per arm, on the same model files (one request at a time: -np 1 / --parallel 1)."""
    from .load import rakv_server
    from .peers.serving import llama_arm

    policy = (args.policies or ["adaptive"])[0]
    specs = []
    for n in names:
        if n.startswith("rakv"):
            pol = FIXED.get(n) or (n[5:] if n.startswith("rakv:") else policy)
            extra = ["--threads", str(args.threads)] if args.threads else []
            spec = rakv_server(args.target, args.draft or "none", 1, pol, extra, name=n)
        else:
            # 8192 context: llama-server keeps input_extra only within n_ctx - n_batch - 2 n_predict
            spec = llama_arm(args, n, "--edits", 1, ctx_per_slot=8192)
            spec.name = n
        specs.append(spec)
    return specs


def run_edits(specs, trace: dict, out: Path, repeats: int = 1, progress=print, meta: dict | None = None,
              together: bool = False) -> list[EditResult]:
    """Every (file, arm) on a fresh server, arms rotated per file and repeat; OUT written after each
    file (``meta``, the run's settings and machine, kept beside the results). ``together``: a file's
    servers all started at once and each request sent to every arm in turn (rotated), so a slow
    moment of the machine falls on every arm alike (the servers' memory at once)."""
    from .load import stop

    out.mkdir(parents=True, exist_ok=True)
    meta = {**(meta or {}), "servers": {s.name: s.argv for s in specs}, "interleave": "request" if together else "file"}
    results: list[EditResult] = []
    files = list(trace)
    for rep in range(repeats):
        for fi, f in enumerate(files):
            s = (fi + rep) % len(specs)
            order = specs[s:] + specs[:s]
            t0 = time.perf_counter()
            running = []
            try:
                for spec in (order if together else ()):
                    running.append((spec, *_start(spec, out, progress)))
                if together:
                    rs = _replay_together([(sp, url) for sp, _, url in running if url], trace[f])
                    results += rs
                    _report(progress, f, fi, len(files), rep, rs, t0)
            finally:
                for _, proc, _ in running:
                    if proc is not None:
                        stop(proc)
            for spec in (() if together else order):
                proc, url = _start(spec, out, progress)
                if proc is None:
                    continue
                t0 = time.perf_counter()
                try:
                    rs = replay(url, spec.name, trace[f])
                finally:
                    stop(proc)
                results += rs
                _report(progress, f, fi, len(files), rep, rs, t0)
            write_results(results, out, meta)
    write_results(results, out, meta)
    return results


def _start(spec, out: Path, progress):
    """(process, url) of a started server; (None, None) where it did not start (its log says why)."""
    try:
        return spec.start(out / "logs")
    except RuntimeError as e:
        progress(f"[edits] {spec.name}: {e}; skipped (log in {out / 'logs'})")
        return None, None


def _replay_together(servers: list, requests) -> list[EditResult]:
    """Each request to every server in turn, the order rotated per request."""
    out = []
    for i, rq in enumerate(requests):
        s = i % max(1, len(servers))
        for spec, url in servers[s:] + servers[:s]:
            out += replay(url, spec.name, [rq])
    return out


def _report(progress, f: str, fi: int, n_files: int, rep: int, rs: list[EditResult], t0: float) -> None:
    for arm in dict.fromkeys(r.arm for r in rs):
        mine = [r for r in rs if r.arm == arm]
        keys = [r for r in mine if r.ok and r.kind == "key"]
        shares = [r.reused_share for r in keys if r.reused_share is not None]
        progress(f"[edits] {f} ({fi + 1}/{n_files}, repeat {rep + 1}) {arm}: {len(keys)} completions, "
                 f"p50 {pct([r.latency_s for r in keys], 0.5):.2f} s, reused p50 {pct(shares, 0.5):.0%}, "
                 f"errors {sum(not r.ok for r in mine)}, {time.perf_counter() - t0:.0f} s")


# ----------------------------------------------------------------------------- the table
def pct(xs: list[float], q: float) -> float:
    from .load import pct as _pct

    return _pct(xs, q)


def quantile_ci(xs: list[float], q: float, n: int = 2000, seed: int = 0) -> tuple | None:
    """95% percentile-bootstrap CI of the q-quantile (seeded)."""
    import numpy as np

    v = np.asarray(xs, dtype=float)
    if v.size < 2:
        return None
    rng = np.random.default_rng(seed)
    qs = np.quantile(v[rng.integers(0, v.size, size=(n, v.size))], q, axis=1)
    return round(float(np.quantile(qs, 0.025)), 3), round(float(np.quantile(qs, 0.975)), 3)


def reference_arm(results: list[EditResult]) -> str | None:
    arms = {r.arm for r in results}
    return next((a for a in REFERENCES if a in arms), None)


def summary_rows(results: list[EditResult]) -> list[dict]:
    """One row per arm; ``mismatches``: completions whose text differs from the reference arm's
    (``reference_arm``) for the same request, of ``compared``; None without a reference arm."""
    ref_arm = reference_arm(results)
    ref = {(r.id, r.kind): r.text for r in results if r.arm == ref_arm and r.ok and r.kind == "key"}
    rows = []
    for arm in dict.fromkeys(r.arm for r in results):
        mine = [r for r in results if r.arm == arm]
        keys = [r for r in mine if r.ok and r.kind == "key"]
        warm = [r for r in mine if r.ok and r.kind == "warmup"]
        lat = [r.latency_s for r in keys]
        shares = [r.reused_share for r in keys if r.reused_share is not None]
        first = [r.reused_share for r in keys if r.key == 1 and r.reused_share is not None]
        compared = [r for r in keys if (r.id, r.kind) in ref]
        rows.append({"arm": arm, "completions": len(keys), "errors": sum(not r.ok for r in mine),
                     "latency_p50_s": round(pct(lat, 0.5), 3), "p50_ci": quantile_ci(lat, 0.5),
                     "latency_p95_s": round(pct(lat, 0.95), 3), "p95_ci": quantile_ci(lat, 0.95),
                     "warmup_p50_s": round(pct([r.latency_s for r in warm], 0.5), 3),
                     "reused_p50": round(pct(shares, 0.5), 3), "reused_min": round(min(shares), 3) if shares else None,
                     "first_key_reused_min": round(min(first), 3) if first else None,
                     "mismatches": (sum(r.text != ref[(r.id, r.kind)] for r in compared) if ref else None),
                     "compared": len(compared), "reference": ref_arm,
                     "actions": actions_of(keys), "drafted_accepted": _sums(keys, "drafted", "accepted"),
                     "copied_accepted": _sums(keys, "copied", "copies_accepted")})
    llama = [r["latency_p50_s"] for r in rows if r["arm"].startswith("llama") and r["completions"]]
    for r in rows:
        r["p50_vs_best_llama"] = round(r["latency_p50_s"] / min(llama), 3) if llama and r["completions"] else None
    return rows


def _sums(rs: list[EditResult], a: str, b: str) -> str | None:
    xs = [(getattr(r, a), getattr(r, b)) for r in rs if getattr(r, a) is not None]
    return f"{sum(x for x, _ in xs)}/{sum(y or 0 for _, y in xs)}" if xs else None


def actions_of(results: list[EditResult]) -> str | None:
    """How often each first decision was taken ("r1 k0 argmin: 10, r1 k4 probe: 2"); None for a
    server that does not say."""
    from collections import Counter

    c = Counter(r.action.split(" / ")[0] for r in results if r.action)
    return ", ".join(f"{a}: {n}" for a, n in c.most_common()) or None


def markdown(rows: list[dict]) -> str:
    cols = list(rows[0]) if rows else []
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join("-" if r[c] is None else str(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(out)


def write_results(results: list[EditResult], out: Path, meta: dict | None = None) -> None:
    rows = summary_rows(results)
    (out / "edits.json").write_text(json.dumps({"meta": meta or {}, "rows": rows,
                                                "results": [asdict(r) for r in results]}, indent=1))
    with open(out / "edits.csv", "w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=[*EditResult.__dataclass_fields__, "reused_share"])
        w.writeheader()
        for r in results:
            w.writerow({**asdict(r), "reused_share": r.reused_share})
    (out / "edits.md").write_text(markdown(rows) + "\n")


# ----------------------------------------------------------------------------- the CLI
def add_args(ap) -> None:
    g = ap.add_argument_group("the edit trace against /infill servers (--edits; rakv/workloads/edits.py)")
    g.add_argument("--edits", default=None, metavar="ARMS",
                   help=f"replay an editor's completion requests instead of the policy grid: comma-separated {ARMS_HELP}")
    g.add_argument("--edits-set", choices=("tuning", "heldout"), default="tuning",
                   help="which files to type (default tuning; heldout: the files no choice was tuned on)")
    g.add_argument("--edits-files", type=A.int_range(1, 100), default=None, help="only the set's first N files")
    g.add_argument("--edits-points", type=A.int_range(1, 100), default=None, help="cursor moves per file (default 3)")
    g.add_argument("--edits-keys", type=A.int_range(1, 100), default=None,
                   help="completion requests per typed line (default 4)")
    g.add_argument("--edits-together", action="store_true",
                   help="start a file's servers together and send each request to every arm in turn (the finest "
                        "interleaving; every server's memory at once); default: one server at a time, per file")


def check(args) -> None:
    if args.edits is not None:
        arm_names(args.edits)
        out = Path(args.out).expanduser()
        if out.exists() and not out.is_dir():
            raise ValueError(f"--out {args.out} is a file, not a folder")


def run_meta(args, trace: dict) -> dict:
    """What a figure from this run is tied to: the command, the date, the machine, the trace's settings."""
    import shlex

    from rakv.util.device import hardware_info
    from rakv.workloads import edits as E

    return {"command": shlex.join(["rakv", "bench", *sys.argv[2:]]) if sys.argv[1:2] == ["bench"] else None,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "hardware": hardware_info(), "set": args.edits_set,
            "files": list(trace), "requests": sum(len(v) for v in trace.values()),
            "client": {"n_prefix": E.N_PREFIX, "n_suffix": E.N_SUFFIX, "ring_chunks": E.RING_CHUNKS,
                       "ring_chunk_lines": E.RING_CHUNK_LINES,
                       "n_predict": next((r.n_predict for v in trace.values() for r in v if r.kind == "key"), None)},
            "target": args.target, "draft": args.draft, "threads": args.threads}


def run_cli(args) -> int:
    from rakv.workloads import edits as E

    names = arm_names(args.edits)
    trace = E.edit_trace(args.edits_set, points=args.edits_points or E.POINTS, keys=args.edits_keys or E.KEYS,
                         n_predict=args.max_new_tokens or E.N_PREDICT, files=args.edits_files)
    specs = server_specs(args, names)
    n = sum(len(v) for v in trace.values())
    print(f"[edits] {args.edits_set}: {len(trace)} files, {n} requests each x {len(specs)} arms x "
          f"{args.repeats or 1} repeats", file=sys.stderr, flush=True)
    out = Path(args.out)
    results = run_edits(specs, trace, out, repeats=args.repeats or 1,
                        progress=lambda m: print(m, file=sys.stderr, flush=True), meta=run_meta(args, trace),
                        together=args.edits_together)
    print(markdown(summary_rows(results)))
    return 0

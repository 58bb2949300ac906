"""``rakv advise --engine vllm``: the speculative_config a vLLM cost profile supports.

From a profile measured on the vLLM engine (``rakv calibrate --engine vllm``: t and V(k) at
batch 1, and at other batch sizes with ``--batch-sizes``) and, optionally, the acceptance of a
workload (a number, or a vLLM server's Prometheus ``/metrics``, a URL or a saved file), it prints

  * the ``speculative_config`` that installs the RAKV proposer (it picks k per request and step,
    0 included) and the environment variable that names the profile;
  * for vLLM's own fixed n-gram speculation, the k with the most expected tokens per ms at that
    acceptance, E_k(alpha) / V(k) against 1 / t (``num_speculative_tokens``; none where no k pays);
  * the crossover alpha*(k) per k: the acceptance below which k drafts a step cost more than
    plain steps;
  * per measured batch size, t, alpha*(k) and the best fixed n-gram k, and the schedule of those
    k as vLLM's ``num_speculative_tokens_per_batch_size`` in an n-gram ``speculative_config``.

No vLLM import: it reads files and prints JSON-able dicts.
"""

from __future__ import annotations

import json
import math
import os
import re
import urllib.request

from ..decide.policy import E, alpha_star
from ..decide.profile import load_vllm_profile, profile_batches, verify_costs
from .vllm_proposer import PROFILE_ENV, speculative_config

_LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> list[tuple[str, dict, float]]:
    """(name, labels, value) for every sample of a Prometheus text exposition."""
    out = []
    for ln in text.splitlines():
        if not ln or ln.startswith("#"):
            continue
        m = _LINE.match(ln)
        if not m:
            continue
        try:
            v = float(m.group(3))
        except ValueError:
            continue
        labels = dict(_LABEL.findall(m.group(2) or ""))
        out.append((m.group(1), labels, v))
    return out


def read_metrics(src: str, timeout: float = 5.0) -> str:
    """A /metrics text from a URL (a server's base URL gets /metrics appended) or a file."""
    if src.startswith(("http://", "https://")):
        url = src if src.rstrip("/").endswith("/metrics") else src.rstrip("/") + "/metrics"
        with urllib.request.urlopen(url, timeout=timeout) as r:        # noqa: S310 - the user's own server
            return r.read().decode("utf-8", "replace")
    with open(src, encoding="utf-8") as f:
        return f.read()


def spec_counters(samples) -> dict:
    """vLLM's speculative-decoding and prefix-cache counters, summed over engines and models:
    drafts, draft tokens, accepted tokens, accepted per position, prefix-cache queries and hits."""
    c = {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0, "per_pos": {}, "prefix_queries": 0.0,
         "prefix_hits": 0.0}
    names = {"vllm:spec_decode_num_drafts_total": "drafts", "vllm:spec_decode_num_draft_tokens_total": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens_total": "accepted",
             "vllm:prefix_cache_queries_total": "prefix_queries", "vllm:prefix_cache_hits_total": "prefix_hits"}
    for name, labels, v in samples:
        if name in names:
            c[names[name]] += v
        elif name == "vllm:spec_decode_num_accepted_tokens_per_pos_total":
            p = int(labels.get("position", 0))
            c["per_pos"][p] = c["per_pos"].get(p, 0.0) + v
    return c


def acceptance(c: dict) -> dict:
    """Per-token acceptance from the counters: position j's conditional rate a_j / a_(j-1)
    (a_0 = drafts; exact where every draft had the full length, an approximation where vLLM's
    n-gram proposed fewer) and the pooled rate sum a_j / sum a_(j-1); the mean accepted length."""
    D = c["drafts"]
    pos = [c["per_pos"].get(j, 0.0) for j in range(max(c["per_pos"], default=-1) + 1)]
    reach = [D] + pos[:-1]
    cond = [round(a / r, 4) if r > 0 else None for a, r in zip(pos, reach)]
    pooled = sum(pos) / sum(reach) if sum(reach) > 0 else None
    return {"per_position": cond, "alpha": None if pooled is None else round(pooled, 4),
            "mean_accepted": round(c["accepted"] / D, 4) if D else None,
            "prefix_hit_rate": round(c["prefix_hits"] / c["prefix_queries"], 4) if c["prefix_queries"] else None}


def best_fixed_k(V: list[float], alpha: float, ks=None) -> tuple[int, dict]:
    """The k (0: no speculation) with the most expected tokens per ms at acceptance alpha, and
    each k's predicted ms per token."""
    ks = ks if ks is not None else range(len(V))
    per = {k: V[k] / E(k, alpha) for k in ks}
    return min(per, key=per.get), {str(k): round(v, 3) for k, v in per.items()}


def schedule_ranges(best: dict[int, int]) -> list[list[int]]:
    """vLLM's ``num_speculative_tokens_per_batch_size`` from the best k at each measured batch
    size: inclusive ranges [start, end, k], sorted, not overlapping, the first starting at 1
    (vLLM 0.32's rules, ``vllm/v1/spec_decode/dynamic/utils.py``). Every batch size goes to its
    nearest measured one (``nearest_batch``: between measured a < b, up to isqrt(a b) is a's);
    neighbours with the same k are merged; the last range ends at the largest measured size and
    vLLM carries its k to every larger batch."""
    import math

    sizes = sorted(int(b) for b in best)
    if not sizes:
        raise ValueError("no measured batch size")
    out: list[list[int]] = []
    for i, b in enumerate(sizes):
        start = 1 if i == 0 else math.isqrt(sizes[i - 1] * b) + 1
        end = math.isqrt(b * sizes[i + 1]) if i + 1 < len(sizes) else b
        k = int(best[b])
        if out and out[-1][2] == k:
            out[-1][1] = end
        else:
            out.append([start, end, k])
    return out


def batch_advice(prof: dict, alpha: float | None, k_max: int = 8) -> dict:
    """Per measured batch size (``rakv calibrate --engine vllm --batch-sizes``): t, alpha*(k) at
    the measured k and, at acceptance ``alpha``, vLLM's best fixed n-gram k there (the most
    expected tokens per ms of a step, E_k(alpha) / V_B(k), against 1 / t_B); then the schedule
    of those k for ``num_speculative_tokens_per_batch_size`` and a speculative_config with it."""
    rows = profile_batches(prof)
    per = {}
    for B, row in rows.items():
        V = verify_costs(row, k_max)
        measured = sorted(int(k) for k in (row.get("V_ms") or {}) if 0 < int(k) <= k_max)
        stars = alpha_star(V)
        d = {"t_ms": round(V[0], 3), "alpha_star": {str(k): stars[str(k)] for k in measured}}
        if alpha is not None:
            k, _ = best_fixed_k(V, alpha, [0] + measured if measured else list(range(k_max + 1)))
            d["k"] = k
            d["ms_per_token"] = round(V[k] / (B * E(k, alpha)), 3)     # the batch's ms per generated token
        per[str(B)] = d
    out = {"batch_sizes": per}
    if alpha is not None:
        best = {int(B): d["k"] for B, d in per.items()}
        ranges = schedule_ranges(best)
        k_top = max(best.values())
        out["alpha"] = round(alpha, 4)
        out["num_speculative_tokens_per_batch_size"] = ranges
        out["speculative_config"] = ({"method": "ngram", "num_speculative_tokens": k_top, "prompt_lookup_min": 2,
                                      "prompt_lookup_max": 4, "num_speculative_tokens_per_batch_size": ranges}
                                     if k_top > 0 else None)
    return out


def advise(profile_path: str, alpha: float | None = None, metrics: str | None = None, k_max: int = 8) -> dict:
    prof = load_vllm_profile(profile_path)
    if not isinstance(prof, dict) or "t_ms" not in prof:
        raise ValueError("it has no t_ms")
    profile_batches(prof)                       # a malformed by_batch: ValueError here
    V = verify_costs(prof, k_max)
    out = {"engine": "vllm", "profile": os.path.abspath(profile_path), "t_ms": round(V[0], 3),
           "V_ms": {str(k): round(v, 3) for k, v in enumerate(V) if k},
           "alpha_star": alpha_star(V),
           "rakv": {"speculative_config": speculative_config(k_max), "env": {PROFILE_ENV: os.path.abspath(profile_path)}}}
    if metrics:
        acc = acceptance(spec_counters(parse_prometheus(read_metrics(metrics))))
        out["measured"] = acc
        if alpha is None:
            alpha = acc["alpha"]
    if alpha is not None and not math.isnan(alpha):
        ks = sorted(int(k) for k in (prof or {}).get("V_ms", {}))
        measured_ks = [0] + ks if ks else list(range(k_max + 1))
        k, per = best_fixed_k(V, alpha, [k for k in measured_ks if k <= k_max])
        out["alpha"] = round(alpha, 4)
        out["fixed"] = {"num_speculative_tokens": k, "ms_per_token": per,
                        "speculative_config": ({"method": "ngram", "num_speculative_tokens": k,
                                                "prompt_lookup_min": 2, "prompt_lookup_max": 4} if k else None)}
    out["per_batch"] = batch_advice(prof, alpha if alpha is not None and not math.isnan(alpha) else None, k_max)
    return out


def format_text(a: dict) -> str:
    lines = [f"vLLM cost profile {a['profile']}: t = {a['t_ms']} ms, "
             + ", ".join(f"V({k}) = {v}" for k, v in a["V_ms"].items())]
    lines.append("alpha*(k) (k drafts a step pay above it): "
                 + ", ".join(f"{k}: {'never' if s is None else s}" for k, s in a["alpha_star"].items()))
    if "measured" in a:
        m = a["measured"]
        lines.append(f"measured: acceptance {m['alpha']} (per position {m['per_position']}), "
                     f"mean accepted {m['mean_accepted']}, prefix-cache hit rate {m['prefix_hit_rate']}")
    if "fixed" in a:
        f = a["fixed"]
        lines.append(f"fixed n-gram at alpha = {a['alpha']}: "
                     + (f"num_speculative_tokens = {f['num_speculative_tokens']}" if f["num_speculative_tokens"]
                        else "no speculation (no k beats plain steps)")
                     + f"  (ms per token {f['ms_per_token']})")
        if f["speculative_config"]:
            lines.append("  speculative_config = " + json.dumps(f["speculative_config"]))
    pb = a.get("per_batch")
    if pb:
        lines.append("per batch size (a step's ms with B requests; k drafts each):")
        for B, d in pb["batch_sizes"].items():
            lines.append(f"  B = {B}: t = {d['t_ms']} ms, alpha*(k) "
                         + ", ".join(f"{k}: {'never' if s is None else s}" for k, s in d["alpha_star"].items())
                         + (f"; best fixed n-gram k at alpha = {pb['alpha']}: {d['k']} ({d['ms_per_token']} ms a "
                            "token of the batch)" if "k" in d else ""))
        if len(pb["batch_sizes"]) == 1:
            lines.append("  (one batch size measured: rakv calibrate --engine vllm --batch-sizes 1,2,4 times more)")
        if "num_speculative_tokens_per_batch_size" in pb:
            lines.append("  num_speculative_tokens_per_batch_size = "
                         + json.dumps(pb["num_speculative_tokens_per_batch_size"])
                         + "  (inclusive batch-size ranges; vLLM carries the last k to larger batches)")
            lines.append("  speculative_config = " + (json.dumps(pb["speculative_config"]) if pb["speculative_config"]
                                                      else "none (no k beats plain steps at any batch size)"))
            lines.append("  (vLLM 0.32 applies the schedule to its own proposers, n-gram here; a custom_class "
                         "proposer such as the RAKV one below picks its own k)")
    r = a["rakv"]
    lines.append("the RAKV proposer (k per request and step, 0 included):")
    lines.append("  " + " ".join(f"{k}={v}" for k, v in r["env"].items()))
    lines.append("  speculative_config = " + json.dumps(r["speculative_config"]))
    return "\n".join(lines)

"""Calibrate a vLLM engine for the RAKV proposer, and run the proposer against vLLM's own arms.

Run with the Python that has vLLM (``docs/vllm.md``):

    python -m rakv.integrations.vllm_run calibrate --target DIR --out vllm-profile.json
    python -m rakv.integrations.vllm_run bench --target DIR --profile vllm-profile.json --out DIR

Both use one engine whose proposer is ``SwitchProposer``: the arms (plain, vLLM's n-gram lookup
at fixed k, the RAKV proposer, and calibration's k rejected drafts) are switched between
requests through a control file, so they run interleaved on one engine and one machine state.
``bench --separate ARM`` instead starts an engine configured as a user would (no speculation, or
vLLM's own ``method: ngram``), for checking that the switched arms cost what those do.

``calibrate --batch-sizes 1,2,4`` also times steps with B requests generated together (the
profile's ``by_batch``: ms of one engine step, B rows each verifying k drafts). ``bench --mode
batched|both`` also sends all prompts of a class in one ``generate`` call, one arm a call. The
CLI runs these: ``rakv calibrate --engine vllm`` and ``rakv bench --peer vllm`` (docs/vllm.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

from .vllm_env import (ARMS, ARMS_HELP, MODES, _int_list, _profile_draft, _with_this_rakv,  # noqa: F401
                       check_arms, check_target, run_in_vllm_python, vllm_python)


def _cpu_s() -> float:
    """CPU seconds of this process and its children (vLLM's engine core and workers), user + system."""
    import psutil

    me = psutil.Process()
    tot = 0.0
    for p in [me] + me.children(recursive=True):
        try:
            c = p.cpu_times()
            tot += c.user + c.system
        except psutil.Error:
            pass
    return tot


def make_llm(target: str, spec: dict | None, max_model_len: int = 2048, mem: float | None = None, block_size=None,
             max_num_seqs: int | None = None):
    """An eager fp32 engine; max_model_len at most the model's own (config.json), ``mem`` the share
    of host memory vLLM's CPU backend reserves (default RAKV_VLLM_MEM, else 0.2); ``max_num_seqs``
    only when given (vLLM's CPU default for ``LLM`` is 256)."""
    from vllm import LLM

    try:
        with open(os.path.join(target, "config.json")) as f:
            own = json.load(f).get("max_position_embeddings")
        if own:
            max_model_len = min(max_model_len, int(own))
    except (OSError, ValueError):
        pass
    mem = float(os.environ.get("RAKV_VLLM_MEM", 0.2)) if mem is None else mem
    kw = dict(model=target, enforce_eager=True, max_model_len=max_model_len, dtype="float32", seed=0,
              gpu_memory_utilization=mem, disable_log_stats=False)
    if block_size:
        kw["block_size"] = block_size
    if max_num_seqs:
        kw["max_num_seqs"] = int(max_num_seqs)
    if spec:
        kw["speculative_config"] = spec
    return LLM(**kw)


def switch_spec(k_max: int) -> dict:
    from .vllm_proposer import speculative_config

    return speculative_config(k_max, cls="SwitchProposer")


def _control_path() -> str:
    """The control file's path, in the environment before the engine starts (its workers inherit it)."""
    if not os.environ.get("RAKV_VLLM_CONTROL"):
        fd, path = tempfile.mkstemp(prefix="rakv-vllm-ctl-")
        os.close(fd)
        os.environ["RAKV_VLLM_CONTROL"] = path
    return os.environ["RAKV_VLLM_CONTROL"]


class Switch:
    """The control file SwitchProposer reads."""

    def __init__(self, path: str):
        self.path = path

    def set(self, mode: str) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            f.write(mode)
        os.replace(tmp, self.path)
        time.sleep(0.002)       # a distinct mtime


def _gen(llm, prompt, max_tokens: int, ignore_eos: bool = False):
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    w0, c0 = time.perf_counter(), _cpu_s()
    out = llm.generate([prompt], sp, use_tqdm=False)[0]
    return list(out.outputs[0].token_ids), time.perf_counter() - w0, _cpu_s() - c0


def _gen_many(llm, prompts: list, max_tokens: int, ignore_eos: bool = False):
    """All ``prompts`` (texts or {"prompt_token_ids": [...]}) in one ``llm.generate`` call (vLLM
    batches them): their output ids, the call's wall and CPU seconds."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    w0, c0 = time.perf_counter(), _cpu_s()
    outs = llm.generate(list(prompts), sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], time.perf_counter() - w0, _cpu_s() - c0


COUNTERS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
            "vllm:spec_decode_num_accepted_tokens": "accepted", "vllm:prefix_cache_queries": "prefix_queries",
            "vllm:prefix_cache_hits": "prefix_hits"}


def counters(llm) -> dict:
    """vLLM's own speculative-decoding and prefix-cache counters now (summed over its labels):
    drafts, draft tokens, accepted tokens, accepted per position, prefix-cache queries and hits."""
    c = {v: 0 for v in COUNTERS.values()}
    c["per_pos"] = []
    try:
        metrics = llm.get_metrics()
    except Exception:          # noqa: BLE001 - counters are extra; a run does not fail on them
        return c
    for m in metrics:
        if m.name in COUNTERS:
            c[COUNTERS[m.name]] += int(getattr(m, "value", 0) or 0)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            vals, have = [int(v) for v in (getattr(m, "values", None) or [])], c["per_pos"]
            n = max(len(vals), len(have))
            c["per_pos"] = [(have[i] if i < len(have) else 0) + (vals[i] if i < len(vals) else 0) for i in range(n)]
    return c


def counters_delta(before: dict, after: dict) -> dict:
    d = {k: after[k] - before[k] for k in COUNTERS.values()}
    n = max(len(before["per_pos"]), len(after["per_pos"]))
    a = after["per_pos"] + [0] * (n - len(after["per_pos"]))
    b = before["per_pos"] + [0] * (n - len(before["per_pos"]))
    d["per_pos"] = [x - y for x, y in zip(a, b)]
    return d


def machine() -> dict:
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    return {"cpu": model or platform.processor(), "cores": os.cpu_count(), "load": os.getloadavg(),
            "python": sys.version.split()[0]}


# ---------------------------------------------------------------------------------- calibrate
def calibration_prompts(ids: list[int], batch: int) -> list[dict]:
    """``batch`` prompts of the same length as ``ids``: ``ids`` itself, then its tail rotated by
    1, 2, ... tokens behind its first token (so no two share a prefix-cache block)."""
    head, tail = ids[:1], ids[1:]
    out = []
    for b in range(batch):
        r = b % max(1, len(tail))
        out.append({"prompt_token_ids": head + tail[r:] + tail[:r]})
    return out


def calibrate(target: str, ks=(0, 1, 2, 4, 8), tokens: int = 32, repeats: int = 3, prompt: str | None = None,
              batch_sizes=(1,), log=None, draft: str | None = None, draft_numerics: str = "q8") -> dict:
    """Time vLLM steps that verify k rejected drafts (k = 0: a plain step), interleaved over k and
    batch sizes; per (B, k) the median over repeats of (ms for 1 + tokens outputs - ms for 1) /
    tokens, with B same-length prompts generated together (one ``llm.generate`` call): the ms of
    one engine step in which each of the B requests verifies k drafts. Batch 1 gives the
    top-level ``t_ms`` / ``V_ms`` (as before); other sizes go to ``by_batch``. With ``draft`` (a
    rakv model spec) the model draft's acceptance on this engine is measured too (``draft``)."""
    import vllm

    if draft:           # before the engine starts: its worker builds the proposer and loads the draft
        os.environ["RAKV_VLLM_DRAFT"], os.environ["RAKV_VLLM_DRAFT_NUMERICS"] = draft, draft_numerics
        if not os.environ.get("RAKV_VLLM_STATS"):
            fd, stats_path = tempfile.mkstemp(prefix="rakv-vllm-stats-", suffix=".json")
            os.close(fd)
            os.environ["RAKV_VLLM_STATS"] = stats_path
    sizes = sorted({int(b) for b in batch_sizes} | {1})
    ctl = Switch(_control_path())
    ctl.set("plain")
    llm = make_llm(target, switch_spec(max(ks)), max_num_seqs=max(sizes) if max(sizes) > 256 else None)
    prompt = prompt or ("The following is a short story about a lighthouse keeper who finds a message "
                        "in a bottle. It begins on a stormy night in late autumn, when")
    ids = list(llm.get_tokenizer().encode(prompt))
    batches = {B: calibration_prompts(ids, B) for B in sizes}
    per = {(B, k): [] for B in sizes for k in ks}
    cpu = {(B, k): [] for B in sizes for k in ks}
    _gen(llm, prompt, 4)        # warm
    for r in range(repeats):
        order = [(B, k) for B in sizes for k in ks]
        if r % 2:
            order.reverse()
        for B, k in order:
            ctl.set(f"junk:{k}" if k else "plain")
            _, w1, c1 = _gen_many(llm, batches[B], 1, True)
            _, wn, cn = _gen_many(llm, batches[B], tokens + 1, True)
            per[(B, k)].append((wn - w1) / tokens * 1e3)
            cpu[(B, k)].append((cn - c1) / tokens * 1e3)
            if log:
                log(f"calibrate r{r} batch {B} k {k}: {per[(B, k)][-1]:.2f} ms a step")

    def row(B):
        med = {k: statistics.median(per[(B, k)]) for k in ks}
        return {"t_ms": round(med[0], 3), "V_ms": {str(k): round(med[k], 3) for k in ks if k > 0},
                "cpu_ms": {str(k): round(statistics.median(cpu[(B, k)]), 3) for k in ks},
                "samples_ms": {str(k): [round(x, 3) for x in per[(B, k)]] for k in ks}}

    out = {"engine": "vllm", "vllm": vllm.__version__, "target": target, "batch": 1, "eager": True, **row(1)}
    if len(sizes) > 1:
        out["batch_sizes"] = sizes
        out["by_batch"] = {str(B): row(B) for B in sizes if B > 1}
        out["by_batch_unit"] = "ms of one engine step in which each of the B requests verifies k drafts"
    out.update({"tokens": tokens, "repeats": repeats, "prompt_chars": len(prompt), "prompt_tokens": len(ids),
                "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine()})
    if draft:
        out["draft"] = calibrate_draft(llm, ctl, draft, draft_numerics, log=log)
    return out


DRAFT_K = 4                 # the fixed k at which a model draft's acceptance is measured
DRAFT_PROMPTS = 4           # shipped chat prompts it is measured on (never the held-out ones)
DRAFT_TOKENS = 48


def calibrate_draft(llm, ctl, spec: str, numerics: str, log=None) -> dict:
    """The model draft's per-token acceptance on this engine: the ``draft:K`` arm on shipped chat
    prompts; from vLLM's own counters, accepted / judged (the accepted drafts and each round's
    first rejected one). Its d and prefill cost as the worker measured them (the proposer's stats)."""
    import rakv.workloads as W

    tok = llm.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": c}], tokenize=False, add_generation_prompt=True)
               if getattr(tok, "chat_template", None) else c for c in W.chat_prompts("chat")[:DRAFT_PROMPTS]]
    ctl.set(f"draft:{DRAFT_K}")
    before = counters(llm)
    for p in prompts:
        _gen(llm, p, DRAFT_TOKENS)
    c = counters_delta(before, counters(llm))
    per = list(c.get("per_pos") or [])
    judged = c["drafts"] + sum(per[: DRAFT_K - 1])
    alpha = round(c["accepted"] / judged, 4) if judged else None
    ctl.set("plain")
    _gen(llm, "Hello", 2)     # one more step: the switch writes its counters every few steps
    costs = {}
    try:
        with open(os.environ["RAKV_VLLM_STATS"]) as f:
            costs = (json.load(f).get(f"draft:{DRAFT_K}") or {}).get("draft_costs") or {}
    except (OSError, ValueError, KeyError):
        pass
    if log:
        log(f"calibrate draft {spec} ({numerics}): alpha {alpha} at k {DRAFT_K} over {c['drafts']} drafts; {costs}")
    return {"spec": spec, "numerics": numerics, "alpha": alpha, "k": DRAFT_K, "drafts": c["drafts"],
            "draft_tokens": c["draft_tokens"], "accepted": c["accepted"], "prompts": f"chat[:{DRAFT_PROMPTS}]",
            "tokens": DRAFT_TOKENS, **costs}


# ---------------------------------------------------------------------------------- workload
def workload(n_copy: int = 5, n_chat: int = 5, tokenizer=None) -> list[dict]:
    """Copy-heavy prompts (rakv's ``repetitive`` workload: lists, code, tables to copy or continue,
    raw text) and open prompts (``chat-heldout``, through the model's chat template), alternating."""
    import rakv.workloads as W

    src = W.repetitive_source(0)
    copies = [src.contexts[i] + src.suffixes[i % len(src.suffixes)] for i in range(n_copy)]
    chats = W.chat_prompts("chat-heldout")[:n_chat]
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        chats = [tokenizer.apply_chat_template([{"role": "user", "content": c}], tokenize=False,
                                               add_generation_prompt=True) for c in chats]
    out = []
    for i in range(max(n_copy, n_chat)):
        if i < n_copy:
            out.append({"kind": "copy", "prompt": copies[i]})
        if i < n_chat:
            out.append({"kind": "chat", "prompt": chats[i]})
    return out


def fit_context(prompts: list[dict], tokenizer, max_model_len: int, max_tokens: int, reserve: int = 0) -> int:
    """A prompt whose tokens, ``max_tokens`` new ones and ``reserve`` more exceed the engine's
    context keeps its last tokens (as {"prompt_token_ids": ...}; ``cut_from`` records its length):
    how many were cut. (``bench`` reserves k_max + 1: within k_max tokens of max_model_len vLLM
    0.32 counted drafts on the plain arm, which proposes none: 5 drafts, 15 tokens on the tiny
    test model at 500 + 12 of 512 tokens.)"""
    keep = max(1, max_model_len - max_tokens - reserve)
    cut = 0
    for p in prompts:
        ids = tokenizer.encode(p["prompt"])
        if len(ids) > keep:
            p["prompt"], p["cut_from"] = {"prompt_token_ids": list(ids[-keep:])}, len(ids)
            cut += 1
    return cut


def _rotated(arms, i: int) -> list:
    j = i % len(arms)
    return list(arms[j:]) + list(arms[:j])


def bench(target: str, arms=ARMS, repeats: int = 2, max_tokens: int = 96, n_copy: int = 5, n_chat: int = 5,
          k_max: int = 8, separate: str | None = None, log=print, mode: str = "one") -> dict:
    """Every prompt through every arm, ``repeats`` times; vLLM's own counters (drafts, accepted,
    prefix-cache hits) read before and after every ``generate`` call. Before timing, every arm is
    warmed and every prompt sent once (so all arms find it in the prefix cache alike).

    ``mode`` one: each prompt alone (batch 1), arms interleaved per prompt (order rotated);
    batched: all prompts of a class (copy, chat) in one ``generate`` call (batch = their number),
    one arm per call (the switch is per engine), arms rotated per class and repeat; both: one,
    then batched, on the same engine."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}")
    ctl = Switch(_control_path())
    ctl.set("plain")
    if separate:       # one arm, on an engine configured as a user would
        arms = (separate,)
        if separate == "plain":
            spec = None
        elif separate.startswith("ngram:"):
            lo, hi = (int(x) for x in os.environ.get("RAKV_VLLM_NGRAM", "2,4").split(","))
            spec = {"method": "ngram", "num_speculative_tokens": int(separate.split(":")[1]),
                    "prompt_lookup_min": lo, "prompt_lookup_max": hi}
        elif separate == "rakv":
            from .vllm_proposer import speculative_config

            spec = speculative_config(k_max)
        else:
            raise ValueError(f"unknown arm {separate!r}")
    else:
        spec = switch_spec(k_max)
    log(f"vllm: starting an engine on {target} (arms {', '.join(arms)}; this takes a while)")
    t0 = time.perf_counter()
    llm = make_llm(target, spec)
    start_s = time.perf_counter() - t0
    prompts = workload(n_copy, n_chat, llm.get_tokenizer())
    cut = fit_context(prompts, llm.get_tokenizer(), llm.model_config.max_model_len, max_tokens, k_max + 1)
    if cut:
        log(f"vllm: {cut} prompts cut to their last tokens to fit the context of {llm.model_config.max_model_len}")
    for arm in arms:           # warm every arm (vLLM's n-gram lookup is compiled by numba on its first call)
        if not separate:
            ctl.set(arm)
        _gen(llm, "Hello Hello Hello Hello", 4)
    # every prompt once (one token, plain), so that every arm finds it in vLLM's prefix cache: else
    # the first arm on a prompt pays the prefill the later ones skip (full 128-token blocks only)
    ctl.set("plain")
    _gen_many(llm, [p["prompt"] for p in prompts], 1)
    log(f"vllm: engine ready in {start_s:.1f} s; {len(prompts)} prompts (in its prefix cache now), {repeats} "
        f"repeats, mode {mode}")

    def timed(arm, batch):
        if not separate:
            ctl.set(arm)
        c0 = counters(llm)
        ids, w, c = _gen_many(llm, [p["prompt"] for p in batch], max_tokens)
        return ids, w, c, counters_delta(c0, counters(llm))

    rows, batched = [], []
    if mode in ("one", "both"):
        for r in range(repeats):
            for i, p in enumerate(prompts):
                for arm in _rotated(arms, i + r):
                    (ids,), w, c, d = timed(arm, [p])
                    rows.append({"repeat": r, "prompt": i, "kind": p["kind"], "arm": arm, "wall_s": round(w, 4),
                                 "cpu_s": round(c, 4), "n": len(ids), "ids": ids, "counters": d})
                    log(f"r{r} p{i} {p['kind']:4} {arm:8} n={len(ids):3} wall={w:.3f} cpu={c:.3f} "
                        f"drafted={d['draft_tokens']} accepted={d['accepted']} prefix_hits={d['prefix_hits']}")
    if mode in ("batched", "both"):
        kinds = [k for k in ("copy", "chat") if any(p["kind"] == k for p in prompts)]
        for r in range(repeats):
            for ci, kind in enumerate(kinds):
                idx = [i for i, p in enumerate(prompts) if p["kind"] == kind]
                for arm in _rotated(arms, ci + r):
                    ids, w, c, d = timed(arm, [prompts[i] for i in idx])
                    n = sum(len(x) for x in ids)
                    batched.append({"repeat": r, "kind": kind, "arm": arm, "batch": len(idx), "prompts": idx,
                                    "wall_s": round(w, 4), "cpu_s": round(c, 4), "n": n, "ids": ids, "counters": d})
                    log(f"batched r{r} {kind:4} {arm:8} batch={len(idx)} n={n:4} wall={w:.3f} cpu={c:.3f} "
                        f"tok/s={n / w if w else 0:.1f} drafted={d['draft_tokens']} accepted={d['accepted']}")
    return {"start_s": round(start_s, 1), "rows": rows, "batched": batched, "metrics": counters(llm),
            "machine": machine(), "separate": separate, "max_tokens": max_tokens, "k_max": k_max, "mode": mode,
            "arms": list(arms), "target": target, "profile": os.environ.get("RAKV_VLLM_PROFILE"), "prompts_cut": cut,
            "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def _sum_counters(rows) -> dict:
    tot = {v: 0 for v in COUNTERS.values()}
    for x in rows:
        for k in tot:
            tot[k] += (x.get("counters") or {}).get(k, 0)
    return tot


def _acceptance(c: dict) -> dict:
    """Per arm from vLLM's counters: accepted / drafted tokens, mean accepted tokens a draft, the
    prefix cache's hit rate (tokens)."""
    return {"drafted": c["draft_tokens"], "accepted": c["accepted"], "drafts": c["drafts"],
            "acceptance": round(c["accepted"] / c["draft_tokens"], 4) if c["draft_tokens"] else None,
            "mean_accepted": round(c["accepted"] / c["drafts"], 3) if c["drafts"] else None,
            "prefix_hits": c["prefix_hits"], "prefix_queries": c["prefix_queries"],
            "prefix_hit_rate": round(c["prefix_hits"] / c["prefix_queries"], 4) if c["prefix_queries"] else None}


def summarize(res: dict, base: str = "plain") -> dict:
    """One at a time, per arm and prompt kind: summed per-prompt medians of wall and CPU seconds,
    tokens, tokens/s, and the ratio to ``base``; vLLM's counters summed over the arm's calls;
    greedy ids compared with ``base`` per prompt."""
    from collections import defaultdict

    by = defaultdict(list)
    ids = {}
    for x in res["rows"]:
        by[(x["arm"], x["prompt"], x["kind"])].append(x)
        ids.setdefault((x["arm"], x["prompt"]), x["ids"])
    arms = sorted({a for a, _, _ in by}, key=lambda a: (a != base, a))
    out = {}
    for arm in arms:
        for kind in ("copy", "chat", "all"):
            keys = [k for k in by if k[0] == arm and (kind == "all" or k[2] == kind)]
            w = sum(statistics.median(x["wall_s"] for x in by[k]) for k in keys)
            c = sum(statistics.median(x["cpu_s"] for x in by[k]) for k in keys)
            n = sum(by[k][0]["n"] for k in keys)
            out.setdefault(arm, {})[kind] = {"wall_s": round(w, 3), "cpu_s": round(c, 3), "tokens": n,
                                             "tokens_per_s": round(n / w, 2) if w else None}
        same = [ids[(arm, p)] == ids.get((base, p)) for (a, p) in ids if a == arm and (base, p) in ids]
        out[arm]["ids_equal_base"] = f"{sum(same)}/{len(same)}"
        out[arm]["vllm"] = _acceptance(_sum_counters(x for x in res["rows"] if x["arm"] == arm))
    for arm in arms:
        for kind in ("copy", "chat", "all"):
            b = out.get(base, {}).get(kind)
            if b:
                o = out[arm][kind]
                o["wall_vs_base"] = round(b["wall_s"] / o["wall_s"], 3) if o["wall_s"] else None
                o["cpu_vs_base"] = round(b["cpu_s"] / o["cpu_s"], 3) if o["cpu_s"] else None
    return out


def summarize_batched(res: dict, base: str = "plain") -> dict:
    """Batched, per arm and class: the median over repeats of a call's wall and CPU seconds, its
    tokens, tokens/s, the ratio to ``base``; vLLM's counters summed over the arm's calls; greedy
    ids against ``base``'s batched ids and against the one-at-a-time ``base`` (when it ran)."""
    from collections import defaultdict

    by = defaultdict(list)
    for x in res.get("batched", []):
        by[(x["arm"], x["kind"])].append(x)
    one = {}
    for x in res.get("rows", []):
        if x["arm"] == base:
            one.setdefault(x["prompt"], x["ids"])
    arms = sorted({a for a, _ in by}, key=lambda a: (a != base, a))
    out = {}
    for arm in arms:
        per, same_b, same_1 = {}, [], []
        for kind in ("copy", "chat"):
            xs = by.get((arm, kind))
            if not xs:
                continue
            w = statistics.median(x["wall_s"] for x in xs)
            c = statistics.median(x["cpu_s"] for x in xs)
            n = xs[0]["n"]
            per[kind] = {"batch": xs[0]["batch"], "wall_s": round(w, 3), "cpu_s": round(c, 3), "tokens": n,
                         "tokens_per_s": round(n / w, 2) if w else None}
            b = by.get((base, kind))
            if b:
                same_b += [a == z for a, z in zip(xs[0]["ids"], b[0]["ids"])]
            if one:
                same_1 += [a == one.get(i) for a, i in zip(xs[0]["ids"], xs[0]["prompts"]) if i in one]
        w = sum(v["wall_s"] for v in per.values())
        c = sum(v["cpu_s"] for v in per.values())
        n = sum(v["tokens"] for v in per.values())
        per["all"] = {"wall_s": round(w, 3), "cpu_s": round(c, 3), "tokens": n,
                      "tokens_per_s": round(n / w, 2) if w else None}
        per["ids_equal_base"] = f"{sum(same_b)}/{len(same_b)}"
        if same_1:
            per["ids_equal_base_one_at_a_time"] = f"{sum(same_1)}/{len(same_1)}"
        per["vllm"] = _acceptance(_sum_counters(x for x in res.get("batched", []) if x["arm"] == arm))
        out[arm] = per
    for arm in arms:
        for kind in ("copy", "chat", "all"):
            b, o = out.get(base, {}).get(kind), out[arm].get(kind)
            if b and o:
                o["wall_vs_base"] = round(b["wall_s"] / o["wall_s"], 3) if o["wall_s"] else None
                o["cpu_vs_base"] = round(b["cpu_s"] / o["cpu_s"], 3) if o["cpu_s"] else None
    return out


def _f(x, fmt="{:.2f}"):
    return "-" if x is None else fmt.format(x)


def format_summary(res: dict) -> str:
    """The arms side by side (markdown): tokens/s, wall and CPU seconds, their ratio to plain,
    vLLM's acceptance counters, prefix-cache hits, ids equal plain."""
    m = res.get("machine", {})
    lines = [f"# vLLM arms on {res.get('target')} ({res.get('measured')}; {m.get('cpu')}, {m.get('cores')} cores, "
             f"load {', '.join(f'{x:.1f}' for x in m.get('load', []))} at the end)", "",
             f"max {res.get('max_tokens')} new tokens, greedy; profile {res.get('profile') or 'none (default costs)'}; "
             f"engine start {res.get('start_s')} s", ""]
    base = res.get("separate") or "plain"
    if res.get("summary"):
        lines += ["## One at a time (batch 1): per arm, the sum over prompts of each prompt's median", "",
                  "| arm | tok/s | wall s | CPU s | plain/arm wall | plain/arm CPU | copy: wall / CPU s | "
                  "chat: wall / CPU s | drafted | accepted | acceptance | accepted a draft | prefix-cache hits | "
                  "ids = plain |", "|" + "---|" * 14]
        for arm, v in res["summary"].items():
            a, acc = v["all"], v["vllm"]
            lines.append(f"| {arm} | {_f(a['tokens_per_s'])} | {a['wall_s']:.2f} | {a['cpu_s']:.2f} | "
                         f"{_f(a.get('wall_vs_base'), '{:.3f}')} | {_f(a.get('cpu_vs_base'), '{:.3f}')} | "
                         f"{v['copy']['wall_s']:.2f} / {v['copy']['cpu_s']:.2f} | "
                         f"{v['chat']['wall_s']:.2f} / {v['chat']['cpu_s']:.2f} | {acc['drafted']} | {acc['accepted']} | "
                         f"{_f(acc['acceptance'], '{:.3f}')} | {_f(acc['mean_accepted'])} | "
                         f"{acc['prefix_hits']}/{acc['prefix_queries']} | {v['ids_equal_base']} |")
        lines.append("")
    if res.get("summary_batched"):
        lines += ["## Batched: all prompts of a class in one generate call, one arm a call (median over repeats)",
                  "", "| arm | class | batch | tok/s | wall s | CPU s | plain/arm wall | plain/arm CPU | drafted | "
                  "accepted | acceptance | prefix-cache hits | ids = batched plain | ids = plain one at a time |",
                  "|" + "---|" * 14]
        for arm, v in res["summary_batched"].items():
            acc = v["vllm"]
            for kind in ("copy", "chat", "all"):
                o = v.get(kind)
                if not o:
                    continue
                tail = (f"{acc['drafted']} | {acc['accepted']} | {_f(acc['acceptance'], '{:.3f}')} | "
                        f"{acc['prefix_hits']}/{acc['prefix_queries']} | "
                        f"{v['ids_equal_base']} | {v.get('ids_equal_base_one_at_a_time', '-')} |") if kind == "all" \
                    else "| | | | | |"
                lines.append(f"| {arm} | {kind} | {o.get('batch', '')} | {_f(o['tokens_per_s'])} | {o['wall_s']:.2f} | "
                             f"{o['cpu_s']:.2f} | {_f(o.get('wall_vs_base'), '{:.3f}')} | "
                             f"{_f(o.get('cpu_vs_base'), '{:.3f}')} | " + tail)
        lines.append("")
    lines.append(f"(base: {base}; CPU s: the driver, vLLM's engine core and its worker; ids compared per prompt)")
    return "\n".join(lines)


class _Parser(argparse.ArgumentParser):
    def error(self, message):          # one line through main's guard, not usage + exit
        raise ValueError(message)


def main(argv=None) -> int:
    ap = _Parser(prog="python -m rakv.integrations.vllm_run")
    sub = ap.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    c = sub.add_parser("calibrate")
    c.add_argument("--target", required=True)
    c.add_argument("--out", required=True)
    c.add_argument("--k", default="0,1,2,4,8")
    c.add_argument("--batch-sizes", default="1", help="batch sizes timed (1 is always timed: the top-level fields)")
    c.add_argument("--tokens", type=int, default=32)
    c.add_argument("--repeats", type=int, default=3)
    c.add_argument("--draft", help="a model draft for the proposer (a rakv model spec): its acceptance is measured too")
    c.add_argument("--draft-numerics", default="q8", choices=("q8", "fp32"))
    b = sub.add_parser("bench")
    b.add_argument("--target", required=True)
    b.add_argument("--profile", help="the RAKV proposer's cost profile (sets RAKV_VLLM_PROFILE)")
    b.add_argument("--out", required=True, help="a JSON file")
    b.add_argument("--md", help="also write the side-by-side summary (markdown) here")
    b.add_argument("--arms", default=",".join(ARMS))
    b.add_argument("--separate", help="one arm on an engine configured as a user would: plain, ngram:K, rakv")
    b.add_argument("--mode", choices=MODES, default="one",
                   help="one: each prompt alone (batch 1); batched: each class's prompts in one generate call; both")
    b.add_argument("--repeats", type=int, default=2)
    b.add_argument("--max-tokens", type=int, default=96)
    b.add_argument("--copy", type=int, default=5)
    b.add_argument("--chat", type=int, default=5)
    b.add_argument("--k-max", type=int, default=8)
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")      # stdout: the results only
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "auto")
    err = lambda s: print(s, file=sys.stderr, flush=True)       # noqa: E731
    try:
        a = ap.parse_args(argv)
        check_target(a.target)
        if a.cmd == "calibrate":
            ks = tuple(sorted(set(_int_list(a.k, "--k", 0)) | {0}))
            sizes = _int_list(a.batch_sizes, "--batch-sizes", 1)
            prof = calibrate(a.target, ks, a.tokens, a.repeats, batch_sizes=sizes, log=err, draft=a.draft,
                             draft_numerics=a.draft_numerics)
            with open(a.out, "w") as f:
                json.dump(prof, f, indent=1)
            print(json.dumps({k: prof[k] for k in ("t_ms", "V_ms", "cpu_ms") + (("by_batch",) if "by_batch" in prof
                                                                               else ())}))
            return 0
        arms = check_arms(a.arms.split(","), a.profile)
        if a.separate:
            check_arms([a.separate], a.profile)
        big = [x for x in arms + ((a.separate,) if a.separate else ()) if x.startswith(("ngram:", "draft:"))
               and int(x.split(":")[1]) > a.k_max]
        if big:
            raise ValueError(f"arm {big[0]} drafts more than --k-max {a.k_max}")
        if a.profile:
            from ..decide.profile import load_vllm_profile, profile_batches

            profile_batches(load_vllm_profile(a.profile))         # a bad profile: one line, before the engine
            os.environ["RAKV_VLLM_PROFILE"] = os.path.abspath(a.profile)
        os.environ.setdefault("RAKV_VLLM_STATS", a.out + ".proposer.json")
        res = bench(a.target, arms, a.repeats, a.max_tokens, a.copy, a.chat, a.k_max, a.separate, log=err, mode=a.mode)
        base = "plain" if not a.separate else a.separate
        res["summary"] = summarize(res, base) if res["rows"] else {}
        res["summary_batched"] = summarize_batched(res, base) if res["batched"] else {}
        with open(a.out, "w") as f:
            json.dump(res, f)
        text = format_summary(res)
        if a.md:
            with open(a.md, "w") as f:
                f.write(text + "\n")
        print(text)
        return 0
    except KeyboardInterrupt:
        err("rakv: interrupted")
        return 130
    except Exception as e:          # noqa: BLE001 - one line (RAKV_VLLM_DEBUG=1: the traceback)
        if os.environ.get("RAKV_VLLM_DEBUG"):
            raise
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        err(f"rakv: error: {type(e).__name__ + ': ' if not isinstance(e, (ValueError, OSError)) else ''}{msg}")
        return 2


if __name__ == "__main__":
    sys.exit(main())

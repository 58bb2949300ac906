"""Calibrate a vLLM engine for the RAKV proposer, and run the proposer against vLLM's own arms.

Run with the Python that has vLLM (``docs/vllm.md``):

    python -m rakv.integrations.vllm_run calibrate --target DIR --out vllm-profile.json
    python -m rakv.integrations.vllm_run bench --target DIR --profile vllm-profile.json --out DIR

Both use one engine whose proposer is ``SwitchProposer``: the arms (plain, vLLM's n-gram lookup
at fixed k, the RAKV proposer, and calibration's k rejected drafts) are switched between
requests through a control file, so they run interleaved on one engine and one machine state.
``bench --separate ARM`` instead starts an engine configured as a user would (no speculation, or
vLLM's own ``method: ngram``), for checking that the switched arms cost what those do.
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


def make_llm(target: str, spec: dict | None, max_model_len: int = 2048, mem: float | None = None, block_size=None):
    """An eager fp32 engine; max_model_len at most the model's own (config.json), ``mem`` the share
    of host memory vLLM's CPU backend reserves (default RAKV_VLLM_MEM, else 0.2)."""
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
def calibrate(target: str, ks=(0, 1, 2, 4, 8), tokens: int = 32, repeats: int = 3, prompt: str | None = None) -> dict:
    """Time vLLM steps that verify k rejected drafts (k = 0: a plain step), batch 1, interleaved
    over k; per k the median over repeats of (ms for 1 + tokens outputs - ms for 1) / tokens."""
    import vllm

    ctl = Switch(_control_path())
    ctl.set("plain")
    llm = make_llm(target, switch_spec(max(ks)))
    prompt = prompt or ("The following is a short story about a lighthouse keeper who finds a message "
                        "in a bottle. It begins on a stormy night in late autumn, when")
    per = {k: [] for k in ks}
    cpu = {k: [] for k in ks}
    _gen(llm, prompt, 4)        # warm
    for r in range(repeats):
        order = list(ks) if r % 2 == 0 else list(reversed(ks))
        for k in order:
            ctl.set(f"junk:{k}" if k else "plain")
            _, w1, c1 = _gen(llm, prompt, 1, True)
            ids, wn, cn = _gen(llm, prompt, tokens + 1, True)
            per[k].append((wn - w1) / tokens * 1e3)
            cpu[k].append((cn - c1) / tokens * 1e3)
    med = {k: statistics.median(v) for k, v in per.items()}
    return {"engine": "vllm", "vllm": vllm.__version__, "target": target, "batch": 1, "eager": True,
            "t_ms": round(med[0], 3), "V_ms": {str(k): round(med[k], 3) for k in ks if k > 0},
            "cpu_ms": {str(k): round(statistics.median(v), 3) for k, v in cpu.items()},
            "samples_ms": {str(k): [round(x, 3) for x in v] for k, v in per.items()},
            "tokens": tokens, "repeats": repeats, "prompt_chars": len(prompt),
            "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine()}


# ---------------------------------------------------------------------------------- workload
def workload(n_copy: int = 5, n_chat: int = 5, tokenizer=None) -> list[dict]:
    """Copy-heavy prompts (rakv's ``repetitive`` workload: lists, code, tables to copy or continue,
    raw text) and open prompts (``chat-heldout``, through the model's chat template), alternating."""
    from rakv.bench import workloads as W

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


ARMS = ("plain", "ngram:1", "ngram:2", "ngram:4", "ngram:8", "rakv")


def bench(target: str, arms=ARMS, repeats: int = 2, max_tokens: int = 96, n_copy: int = 5, n_chat: int = 5,
          k_max: int = 8, separate: str | None = None, log=print) -> dict:
    """Every prompt through every arm, arms interleaved per prompt (order rotated), ``repeats``
    times; per (arm, prompt) the median wall and CPU seconds and the output ids."""
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
    t0 = time.perf_counter()
    llm = make_llm(target, spec)
    start_s = time.perf_counter() - t0
    prompts = workload(n_copy, n_chat, llm.get_tokenizer())
    _gen(llm, "Hello", 4)       # warm
    rows = []
    for r in range(repeats):
        for i, p in enumerate(prompts):
            order = list(arms[(i + r) % len(arms):]) + list(arms[:(i + r) % len(arms)])
            for arm in order:
                if not separate:
                    ctl.set(arm)
                ids, w, c = _gen(llm, p["prompt"], max_tokens)
                rows.append({"repeat": r, "prompt": i, "kind": p["kind"], "arm": arm, "wall_s": round(w, 4),
                             "cpu_s": round(c, 4), "n": len(ids), "ids": ids})
                log(f"r{r} p{i} {p['kind']:4} {arm:8} n={len(ids):3} wall={w:.3f} cpu={c:.3f}")
    metrics = {}
    try:
        for m in llm.get_metrics():
            if m.name.startswith(("vllm:spec_decode", "vllm:prefix_cache")):
                metrics[m.name] = getattr(m, "values", None) or getattr(m, "value", None)
    except Exception as e:        # noqa: BLE001 - metrics are extra
        metrics["error"] = str(e)
    return {"start_s": round(start_s, 1), "rows": rows, "metrics": metrics, "machine": machine(),
            "separate": separate, "max_tokens": max_tokens, "k_max": k_max,
            "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def summarize(res: dict, base: str = "plain") -> dict:
    """Per arm and prompt kind: summed per-prompt medians of wall and CPU seconds, tokens, and the
    ratio to ``base``; greedy ids compared with ``base`` per prompt."""
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
            out.setdefault(arm, {})[kind] = {"wall_s": round(w, 3), "cpu_s": round(c, 3), "tokens": n}
        same = [ids[(arm, p)] == ids.get((base, p)) for (a, p) in ids if a == arm and (base, p) in ids]
        out[arm]["ids_equal_base"] = f"{sum(same)}/{len(same)}"
    for arm in arms:
        for kind in ("copy", "chat", "all"):
            b = out.get(base, {}).get(kind)
            if b:
                o = out[arm][kind]
                o["wall_vs_base"] = round(b["wall_s"] / o["wall_s"], 3) if o["wall_s"] else None
                o["cpu_vs_base"] = round(b["cpu_s"] / o["cpu_s"], 3) if o["cpu_s"] else None
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rakv.integrations.vllm_run")
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("calibrate")
    c.add_argument("--target", required=True)
    c.add_argument("--out", required=True)
    c.add_argument("--k", default="0,1,2,4,8")
    c.add_argument("--tokens", type=int, default=32)
    c.add_argument("--repeats", type=int, default=3)
    b = sub.add_parser("bench")
    b.add_argument("--target", required=True)
    b.add_argument("--profile", help="the RAKV proposer's cost profile (sets RAKV_VLLM_PROFILE)")
    b.add_argument("--out", required=True, help="a JSON file")
    b.add_argument("--arms", default=",".join(ARMS))
    b.add_argument("--separate", help="one arm on an engine configured as a user would: plain, ngram:K, rakv")
    b.add_argument("--repeats", type=int, default=2)
    b.add_argument("--max-tokens", type=int, default=96)
    b.add_argument("--copy", type=int, default=5)
    b.add_argument("--chat", type=int, default=5)
    b.add_argument("--k-max", type=int, default=8)
    a = ap.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "auto")
    if a.cmd == "calibrate":
        prof = calibrate(a.target, tuple(int(x) for x in a.k.split(",")), a.tokens, a.repeats)
        with open(a.out, "w") as f:
            json.dump(prof, f, indent=1)
        print(json.dumps({k: prof[k] for k in ("t_ms", "V_ms", "cpu_ms")}))
        return 0
    if a.profile:
        os.environ["RAKV_VLLM_PROFILE"] = os.path.abspath(a.profile)
    os.environ.setdefault("RAKV_VLLM_STATS", a.out + ".proposer.json")
    res = bench(a.target, tuple(a.arms.split(",")), a.repeats, a.max_tokens, a.copy, a.chat, a.k_max, a.separate,
                log=lambda s: print(s, file=sys.stderr, flush=True))
    res["summary"] = summarize(res, "plain" if not a.separate else a.separate)
    with open(a.out, "w") as f:
        json.dump(res, f)
    print(json.dumps(res["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

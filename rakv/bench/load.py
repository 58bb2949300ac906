"""A closed-loop load generator for OpenAI-compatible servers on this machine (``rakv bench --load``).

N clients, each sending its next request when its last one ends, against ``rakv serve`` and
llama.cpp's ``llama-server`` started on the same model files, at each client count, the servers and
counts interleaved. Bounded in count (``--load-requests`` a run) and time (``--load-time-limit``),
loopback only (every server here is started on 127.0.0.1 by this module).

Every request streams (server-sent events), so its time to first token is measured where the
client sees it; a request's tokens are the server's usage count (or its chunks where it sends none).
Reported per server and client count: aggregate tokens/s (all output tokens over the run's wall
time), the same while every client was busy (``steady``: a closed loop of N requests ends in a
drain where fewer clients are left), latency and TTFT p50 / p99, and how many answers differ from
the same prompt's answer at one client (a server whose text changes with concurrency shows it here).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from rakv.util.paths import child_env, env_text

HOST = "127.0.0.1"


@dataclass
class Answer:
    prompt: int
    text: str
    tokens: int
    ttft_s: float
    latency_s: float
    ok: bool = True
    error: str = ""
    sent: int = -1          # its place in the order the clients sent (0: the first), -1 unknown
    start_s: float = 0.0    # sent, s after its run began
    end_s: float = 0.0      # its last byte, s after its run began


@dataclass
class LoadRun:
    server: str
    clients: int
    wall_s: float
    answers: list[Answer] = field(default_factory=list)
    steady_tokens: float = 0.0    # tokens that arrived while every client was busy (``steady_window``)
    steady_s: float = 0.0         # ... that window's length (s)

    @property
    def tokens(self) -> int:
        return sum(a.tokens for a in self.answers if a.ok)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def steady_tok_s(self) -> float:
        """Tokens/s while every client was busy: the server at the load asked of it, without the
        drain that ends a closed loop of N requests (its last requests run with fewer beside them:
        a server whose requests finish at different times, copies and drafts speeding some, spends
        longer there than one whose equal-length requests all end in the same step)."""
        return self.steady_tokens / self.steady_s if self.steady_s > 0 else 0.0


def steady_window(marks: list[list[float]], tokens: list[int], until: float) -> float:
    """Tokens that arrived by ``until``: each answer's ``tokens`` spread evenly over its chunks'
    arrival times ``marks`` (a chunk may carry several tokens)."""
    got = 0.0
    for ts, n in zip(marks, tokens):
        if ts:
            got += n * sum(1 for t in ts if t <= until) / len(ts)
    return got


def pct(xs: list[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation; nan for no data."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    i = (len(s) - 1) * q
    lo = int(i)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (i - lo)


# ----------------------------------------------------------------------------- one request
def stream_completion(url: str, prompt: str, max_tokens: int, api_key: str | None = None,
                      timeout: float = 600.0, extra: dict | None = None,
                      marks: list[float] | None = None) -> tuple[str, int, float, float]:
    """(text, tokens, ttft s, latency s) of one streamed /v1/completions request, greedy; each text
    chunk's arrival (``time.perf_counter()``) appended to ``marks`` when given."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **(extra or {})}
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(), headers=headers)
    t0 = time.perf_counter()
    ttft, text, chunks, usage = None, [], 0, None
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            obj = json.loads(data)
            if "error" in obj:
                raise RuntimeError(obj["error"].get("message", "error"))
            for ch in obj.get("choices") or ():
                piece = ch.get("text") or ""
                if piece:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    if marks is not None:
                        marks.append(time.perf_counter())
                    text.append(piece)
                    chunks += 1
            if obj.get("usage"):
                usage = obj["usage"].get("completion_tokens")
            timings = obj.get("timings")                 # llama-server's last chunk
            if timings and usage is None and timings.get("predicted_n") is not None:
                usage = int(timings["predicted_n"])
    latency = time.perf_counter() - t0
    return "".join(text), int(usage if usage is not None else chunks), ttft if ttft is not None else latency, latency


def answer_lengths(text: str, n_prompts: int, seed: int = 0) -> list[int]:
    """``--load-lengths MIN:MAX``: each prompt's max_tokens, drawn uniformly from MIN..MAX by a
    seeded generator, so every server is asked the same length for the same prompt (equal lengths
    put a batch's requests in lockstep waves: they start together and end in the same step)."""
    parts = text.strip().split(":")
    try:
        lo, hi = (int(x) for x in parts)
    except ValueError:
        raise ValueError(f"--load-lengths: expected MIN:MAX, e.g. 32:96 (got {text!r})") from None
    if not 1 <= lo <= hi <= 100_000:
        raise ValueError(f"--load-lengths: need 1 <= MIN <= MAX <= 100000 (got {text!r})")
    import random

    rng = random.Random(seed)
    return [rng.randint(lo, hi) for _ in range(n_prompts)]


def closed_loop(url: str, prompts: list[str], clients: int, n_requests: int, max_tokens: int | list[int],
                time_limit_s: float, api_key: str | None = None, server: str = "", offset: int = 0) -> LoadRun:
    """``clients`` threads, each sending the next prompt (in order, round robin over ``prompts``
    from prompt ``offset`` on; ``max_tokens`` one for all or one a prompt) when its last answer
    ended, until ``n_requests`` were sent or ``time_limit_s`` passed. The run's steady window ends
    when the first client finds nothing left to send (``LoadRun.steady_tok_s``)."""
    lock = threading.Lock()
    sent = [0]
    answers: list[Answer] = []
    marks: list[list[float]] = []
    idle: list[float] = []                  # when each client found nothing left to send
    t0 = time.perf_counter()
    deadline = t0 + time_limit_s

    def client():
        while True:
            with lock:
                if sent[0] >= n_requests or time.perf_counter() > deadline:
                    idle.append(time.perf_counter())
                    return
                i = sent[0]
                sent[0] += 1
            p = (i + offset) % len(prompts)
            ts: list[float] = []
            ta = time.perf_counter()
            try:
                mt = max_tokens[p] if isinstance(max_tokens, list) else max_tokens
                text, n, ttft, lat = stream_completion(url, prompts[p], mt, api_key, marks=ts)
                a = Answer(p, text, n, ttft, lat, sent=i)
            except (OSError, RuntimeError, ValueError) as e:
                a = Answer(p, "", 0, 0.0, 0.0, ok=False, error=f"{type(e).__name__}: {e}"[:200], sent=i)
                ts = []
            a.start_s, a.end_s = round(ta - t0, 4), round(time.perf_counter() - t0, 4)
            with lock:
                answers.append(a)
                marks.append(ts)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(time_limit_s + 600)
    wall = time.perf_counter() - t0
    until = min(idle) if idle else t0 + wall
    steady = steady_window(marks, [a.tokens if a.ok else 0 for a in answers], until)
    return LoadRun(server, clients, wall, answers, steady_tokens=steady, steady_s=until - t0)


# ----------------------------------------------------------------------------- servers
def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 900.0, api_key: str | None = None) -> None:
    """Until GET /v1/models answers (the model loaded); the server's death or the timeout: RuntimeError."""
    t_end = time.time() + timeout_s
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    while time.time() < t_end:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(urllib.request.Request(url + "/v1/models", headers=headers), timeout=5):
                return
        except (OSError, urllib.error.URLError):
            time.sleep(0.5)
    raise RuntimeError(f"the server at {url} was not ready after {timeout_s:.0f} s")


@dataclass
class ServerSpec:
    """How to start one server to measure: a name, its command (``{port}`` filled in), its log."""

    name: str
    argv: list[str]
    env: dict = field(default_factory=dict)

    def start(self, log_dir: Path) -> tuple[subprocess.Popen, str]:
        port = free_port()
        argv = [a.replace("{port}", str(port)) for a in self.argv]
        log_dir.mkdir(parents=True, exist_ok=True)
        log = open(log_dir / f"{self.name.replace(' ', '_').replace('/', '_')}.log", "ab")
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=child_env(self.env),
                                stdin=subprocess.DEVNULL)
        url = f"http://{HOST}:{port}"
        try:
            wait_ready(url, proc)
        except BaseException:
            stop(proc)
            raise
        return proc, url


def started(spec: ServerSpec, out: Path, progress, tag: str, what: str = ""):
    """``spec``'s server up, (proc, url), or None with one line saying why it was skipped (its log
    in OUT/logs/ says more)."""
    progress(f"[{tag}] starting {spec.name}{what} ...")
    try:
        return spec.start(out / "logs")
    except RuntimeError as e:
        progress(f"[{tag}] {spec.name}: {e}; skipped (log in {out / 'logs'})")
        return None


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def rakv_server(target: str, draft: str, parallel: int, policy: str = "adaptive", extra: list[str] | None = None,
                name: str | None = None) -> ServerSpec:
    argv = [sys.executable, "-m", "rakv", "serve", "--target", target, "--draft", draft, "--policy", policy,
            "--parallel", str(parallel), "--host", HOST, "--port", "{port}", *(extra or [])]
    return ServerSpec(name or f"rakv {policy} -np {parallel}", argv)


def llama_server_binary() -> str | None:
    """llama.cpp's llama-server: $RAKV_LLAMA_SERVER, on PATH, or where scripts/build_llama_cpp.sh puts it."""
    env = env_text("RAKV_LLAMA_SERVER")
    if env:
        return env if os.access(env, os.X_OK) else None
    found = shutil.which("llama-server")
    if found:
        return found
    from rakv.util.paths import cache_dir

    for p in sorted((cache_dir() / "llama.cpp").glob("*/build/bin/llama-server")):
        if os.access(p, os.X_OK):
            return str(p)
    return None


def llama_server(binary: str, gguf: str, parallel: int, draft_gguf: str | None = None, threads: int = 2,
                 ctx_per_slot: int = 2048) -> ServerSpec:
    """llama-server with continuous batching over ``parallel`` slots (and its draft model ``-md``)."""
    argv = [binary, "-m", gguf, "-np", str(parallel), "-c", str(ctx_per_slot * parallel), "-t", str(threads),
            "--host", HOST, "--port", "{port}", "-cb", "--cache-reuse", "256"]
    if draft_gguf:
        argv += ["-md", draft_gguf, "-td", str(threads)]          # (its own draft lengths)
    return ServerSpec(f"llama-server -np {parallel}" + (" -md" if draft_gguf else ""), argv)


# ----------------------------------------------------------------------------- the table
def summary_rows(runs: list[LoadRun]) -> list[dict]:
    """One row per (server, clients): tok/s, latency / TTFT p50 p99, errors, and answers whose text
    differs from that server's one-client answer to the same prompt."""
    solo: dict[tuple[str, int], str] = {}
    for r in runs:
        if r.clients == 1:
            for a in r.answers:
                if a.ok:
                    solo.setdefault((r.server, a.prompt), a.text)
    rows = []
    for r in runs:
        ok = [a for a in r.answers if a.ok]
        diff = sum(1 for a in ok if (r.server, a.prompt) in solo and a.text != solo[(r.server, a.prompt)])
        later = [a.ttft_s for a in ok if after_opening(a, r.clients)]
        rows.append({"server": r.server, "clients": r.clients, "requests": len(r.answers), "errors": len(r.answers) - len(ok),
                     "tokens": r.tokens, "wall_s": round(r.wall_s, 2), "tok_s": round(r.tok_s, 2),
                     "tok_s_steady": round(r.steady_tok_s, 2),
                     "latency_p50_s": round(pct([a.latency_s for a in ok], 0.5), 3),
                     "latency_p99_s": round(pct([a.latency_s for a in ok], 0.99), 3),
                     "ttft_p50_s": round(pct([a.ttft_s for a in ok], 0.5), 3),
                     "ttft_p99_s": round(pct([a.ttft_s for a in ok], 0.99), 3),
                     "ttft_p50_later_s": round(pct(later, 0.5), 3),
                     "ttft_p99_later_s": round(pct(later, 0.99), 3),
                     "differ_from_one_client": diff})
    return rows


def after_opening(a: Answer, clients: int) -> bool:
    """Was ``a`` sent after the opening wave? A closed loop's first ``clients`` requests arrive in
    the same millisecond by construction (every client starts at once), so their prompts share the
    first steps and their TTFT is the whole wave's prefill, not what a request meets later."""
    return a.sent >= clients


def markdown(rows: list[dict]) -> str:
    cols = list(rows[0]) if rows else []
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(out)


def run_load(specs: list[ServerSpec], prompts: list[str], clients: list[int], n_requests: int,
             max_tokens: int | list[int], time_limit_s: float, out: Path, repeats: int = 1,
             progress=print) -> list[LoadRun]:
    """Every (server, client count) on a server started afresh (never two at a time: they would
    share the cores; fresh: a run never finds the prompts an earlier run left in its prefix cache).
    The servers run one after another at each client count, in an order rotated over ``repeats``
    (the counts reversed every other repeat): the arms a ratio compares run minutes apart, so a
    slow period of the machine does not fall on one arm only. Writes OUT/load.json and OUT/load.md."""
    out.mkdir(parents=True, exist_ok=True)
    runs: list[LoadRun] = []
    failed: set[str] = set()
    for rep in range(repeats):
        cs = clients if rep % 2 == 0 else list(reversed(clients))
        for i, c in enumerate(cs):
            r0 = (rep + i) % len(specs)
            for spec in specs[r0:] + specs[:r0]:
                if spec.name in failed:
                    continue
                up = started(spec, out, progress, "load", f" for {c} clients")
                if up is None:
                    failed.add(spec.name)
                    continue
                proc, url = up
                try:
                    stream_completion(url, "Hello", 4)                        # warm-up (not timed)
                    r = closed_loop(url, prompts, c, n_requests, max_tokens, time_limit_s, server=spec.name)
                finally:
                    stop(proc)
                runs.append(r)
                progress(f"[load] {spec.name}: {c} clients, {len(r.answers)} requests, {r.tok_s:.1f} tok/s")
                write_results(runs, out)                  # after every run: an interrupted bench keeps them
    write_results(runs, out)
    return runs


def block_size(clients: int, waves: int = 2) -> int:
    """Requests a server gets in one block of an alternating run (``run_alternating``): ``waves``
    waves of its clients (two by default, at least 4 requests), so each block is short and still
    mostly at full concurrency. Each block opens on an idle server and ends in a drain, so more
    waves a block (``--load-block-waves``) weigh both less, at the price of arms further apart."""
    return max(4, max(1, int(waves)) * clients)


def run_alternating(specs: list[ServerSpec], prompts: list[str], clients: list[int], n_requests: int,
                    max_tokens: int | list[int], time_limit_s: float, out: Path, progress=print,
                    waves: int = 2) -> list[LoadRun]:
    """At each client count every server started afresh and up at once (idle ones sleep; fresh: a
    server never finds the prompts an earlier count left in its prefix cache), taking turns in
    blocks of ``block_size`` requests, the same prompts to each in a block, their order rotated
    block by block, until each has had ``n_requests``: the arms a ratio compares run seconds apart,
    on a host whose speed drifts within a minute (docs/serve.md). A server's run is its blocks together
    (answers and wall time summed; each block opens with a wave of its clients, left out of the
    later-TTFT columns); OUT/load.json keeps each block's tokens/s ("blocks")."""
    out.mkdir(parents=True, exist_ok=True)
    runs: list[LoadRun] = []
    blocks: list[dict] = []
    for c in clients:
        procs: list[tuple[ServerSpec, object, str]] = []
        try:
            for spec in specs:
                up = started(spec, out, progress, "load", f" for {c} clients")
                if up is None:
                    continue
                procs.append((spec, *up))
                stream_completion(up[1], "Hello", 4)                      # warm-up (not timed)
            size = block_size(c, waves)
            acc = {spec.name: LoadRun(spec.name, c, 0.0) for spec, _, _ in procs}
            for b, start in enumerate(range(0, n_requests, size)):
                n = min(size, n_requests - start)
                r0 = b % max(1, len(procs))
                for spec, _, url in procs[r0:] + procs[:r0]:
                    r = closed_loop(url, prompts, c, n, max_tokens, time_limit_s, server=spec.name, offset=start)
                    a = acc[spec.name]
                    a.answers += r.answers
                    a.wall_s += r.wall_s
                    a.steady_tokens += r.steady_tokens
                    a.steady_s += r.steady_s
                    blocks.append({"server": spec.name, "clients": c, "block": b, "tok_s": round(r.tok_s, 3),
                                   "steady_tok_s": round(r.steady_tok_s, 3)})
                progress(f"[load] {c} clients, block {b + 1}: " + ", ".join(
                    f"{x['server']} {x['tok_s']:.1f}" for x in blocks if x["clients"] == c and x["block"] == b))
        finally:
            for _, proc, _ in procs:
                stop(proc)
        for spec, _, _ in procs:
            runs.append(acc[spec.name])
            progress(f"[load] {spec.name}: {c} clients, {len(acc[spec.name].answers)} requests, "
                     f"{acc[spec.name].tok_s:.1f} tok/s")
        write_results(runs, out, blocks)
    return runs


def paired_blocks(blocks: list[dict], key: str = "tok_s", draws: int = 2000, seed: int = 0) -> list[dict]:
    """The first server of an alternating run against each other one, at each client count: the
    median of their blocks' ratios (``key``: tok_s or steady_tok_s; a block gives both servers the
    same prompts seconds apart) and its bootstrap 95% interval (``draws`` resamples of the blocks,
    seeded: the same blocks give the same interval; ``metrics.bootstrap_ci``)."""
    import statistics

    from .metrics import bootstrap_ci

    by: dict[tuple[int, int], dict[str, float]] = {}
    order: list[str] = []
    for b in blocks:
        by.setdefault((b["clients"], b["block"]), {})[b["server"]] = b.get(key, 0.0)
        if b["server"] not in order:
            order.append(b["server"])
    rows = []
    if not order:
        return rows
    ref = order[0]
    for c in sorted({c for c, _ in by}):
        for other in order[1:]:
            rs = [v[ref] / v[other] for (cc, _), v in sorted(by.items())
                  if cc == c and v.get(ref, 0) > 0 and v.get(other, 0) > 0]
            if not rs:
                continue
            lo, hi = bootstrap_ci(rs, draws, seed, stat="median")
            rows.append({"clients": c, "server": ref, "against": other, "key": key, "blocks": len(rs),
                         "median": round(statistics.median(rs), 4), "ci95": [round(lo, 4), round(hi, 4)]})
    return rows


def write_results(runs: list[LoadRun], out: Path, blocks: list[dict] | None = None) -> None:
    rows = summary_rows(runs)
    paired = [r for key in ("tok_s", "steady_tok_s") for r in paired_blocks(blocks or [], key)]
    (out / "load.json").write_text(json.dumps({"rows": rows, "runs": [
        {"server": r.server, "clients": r.clients, "wall_s": r.wall_s, "steady_tokens": r.steady_tokens,
         "steady_s": r.steady_s, "answers": [a.__dict__ for a in r.answers]} for r in runs],
        **({"blocks": blocks, "paired": paired} if blocks else {})}, indent=1))
    (out / "load.md").write_text(markdown(rows) + "\n")
    if paired:
        (out / "paired.md").write_text(markdown([{**r, "ci95": f"[{r['ci95'][0]}, {r['ci95'][1]}]"}
                                                 for r in paired]) + "\n")


# ----------------------------------------------------------------------------- a load that changes
def parse_trace(text: str) -> list[tuple[int, int]]:
    """``--load-trace 1:8,8:32,2:8``: phases of (clients, requests), run one after another on one server."""
    phases = []
    for part in (x.strip() for x in text.split(",") if x.strip()):
        try:
            c, n = (int(x) for x in part.split(":"))
        except ValueError:
            raise ValueError(f"--load-trace {text!r}: expected clients:requests pairs, e.g. 1:8,8:32,2:8") from None
        if not (1 <= c <= 64 and 1 <= n <= 100_000):
            raise ValueError(f"--load-trace {text!r}: clients between 1 and 64, requests between 1 and 100000")
        phases.append((c, n))
    if not phases:
        raise ValueError(f"--load-trace {text!r}: no phase")
    return phases


def trace_rows(runs: list[tuple[str, int, LoadRun]], phases: list[tuple[int, int]]) -> list[dict]:
    """One row per (server, phase) and one per server over the whole trace (phase ``all``): tokens
    over the phases' wall time summed over the repeats, and answers whose text differs from the
    first server's answer to the same prompt (every server here decodes greedily: 0 for an exact one)."""
    first: dict[int, str] = {}
    for name, _, r in runs:
        if name == runs[0][0]:
            for a in r.answers:
                if a.ok:
                    first.setdefault(a.prompt, a.text)
    rows = []
    for name in dict.fromkeys(n for n, _, _ in runs):
        mine = [(i, r) for n, i, r in runs if n == name]
        for i in [*range(len(phases)), None]:
            rs = [r for j, r in mine if i is None or j == i]
            ok = [a for r in rs for a in r.answers if a.ok]
            tokens, wall = sum(a.tokens for a in ok), sum(r.wall_s for r in rs)
            st_tokens, st_s = sum(r.steady_tokens for r in rs), sum(r.steady_s for r in rs)
            rows.append({"server": name, "phase": "all" if i is None else i + 1,
                         "clients": "-".join(str(c) for c, _ in phases) if i is None else phases[i][0],
                         "requests": sum(len(r.answers) for r in rs), "errors": sum(len(r.answers) for r in rs) - len(ok),
                         "tokens": tokens, "wall_s": round(wall, 2), "tok_s": round(tokens / wall, 2) if wall > 0 else 0.0,
                         "tok_s_steady": round(st_tokens / st_s, 2) if st_s > 0 else 0.0,
                         "differ_from_first_server": sum(1 for a in ok if a.prompt in first and a.text != first[a.prompt])})
    return rows


def run_trace(specs: list[ServerSpec], prompts: list[str], phases: list[tuple[int, int]], max_tokens: int | list[int],
              time_limit_s: float, out: Path, repeats: int = 1, progress=print) -> list[dict]:
    """Each server started afresh once a repeat and driven through ``phases`` in order (each phase's
    clients closed-loop over its requests, the prompts going on where the last phase stopped), the
    servers in rotated order over ``repeats``. Writes OUT/trace.json and OUT/trace.md."""
    out.mkdir(parents=True, exist_ok=True)
    runs: list[tuple[str, int, LoadRun]] = []
    for rep in range(repeats):
        for spec in specs[rep % len(specs):] + specs[: rep % len(specs)]:
            up = started(spec, out, progress, "trace")
            if up is None:
                continue
            proc, url = up
            try:
                stream_completion(url, "Hello", 4)                            # warm-up (not timed)
                offset = 0
                for i, (c, n) in enumerate(phases):
                    r = closed_loop(url, prompts, c, n, max_tokens, time_limit_s, server=spec.name, offset=offset)
                    offset += n
                    runs.append((spec.name, i, r))
                    progress(f"[trace] {spec.name}: phase {i + 1}, {c} clients, {len(r.answers)} requests, "
                             f"{r.tok_s:.1f} tok/s")
            finally:
                stop(proc)
            write_trace(runs, phases, out)
    write_trace(runs, phases, out)
    return trace_rows(runs, phases) if runs else []


def write_trace(runs, phases, out: Path) -> None:
    rows = trace_rows(runs, phases) if runs else []
    (out / "trace.json").write_text(json.dumps({"phases": phases, "rows": rows, "runs": [
        {"server": n, "phase": i + 1, "clients": r.clients, "wall_s": r.wall_s, "steady_tokens": r.steady_tokens,
         "steady_s": r.steady_s, "answers": [a.__dict__ for a in r.answers]}
        for n, i, r in runs]}, indent=1))
    (out / "trace.md").write_text(markdown(rows) + "\n")

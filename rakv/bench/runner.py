"""Run every policy ("arm") on the same request streams, interleaved, and write one CSV row per
execution.

Fairness of reuse: each engine arm gets its own Engine (own prefix cache, own controller) per
stream and repeat; every arm sees the same requests in the same order. Policies are interleaved
per request: request i runs every arm once, in an order rotated by i (and by the repeat), then
request i+1 — so drift (other processes, thermal) hits all arms alike. Models are loaded once and
shared. Each adaptive arm gets its own copy of the cost profile once per run and keeps it across
streams and repeats, as a running tool keeps its profile: what it learned online (cost scales,
request-level acceptance, output-length share) carries over, while its prefix cache and per-round
state start fresh with every stream. (With --resume, learning restarts from the calibrated profile.)
A warm-up pass (every arm on one request, throwaway engines) is run first and not recorded.

Acceptance columns of an engine execution (``EXEC_COLUMNS``): ``drafted`` / ``accepted`` count the
draft's own rounds (``RequestEnd``); ``lookup_drafted`` / ``lookup_accepted`` the n-gram copies the
confidence gate verified (rounds with ``draft_source == "lookup"``, k = 0 rounds included: what
``rakv generate --json`` calls ``copied`` / ``copies_accepted``; 0 without any); ``rounds`` every
decoding round after the first token; ``mean_accept_len`` = 1 + (accepted + lookup_accepted) / rounds,
tokens per round with the copies counted (``rakv.records.accept_len``); ``alpha_req`` the draft's own
acceptance (copies are not the draft's).
"""

from __future__ import annotations

import copy
import csv
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from rakv.config import Policy, RakvConfig
from rakv.engine import Engine
from rakv.util.acceptance import judged
from rakv.records import Decision, Round, accept_len
from rakv.session import Session
from rakv.workloads import Request, TurnBuilder

from .peers import PEERS, Peer, peer_of

now = time.perf_counter
cpu_clock = time.thread_time

EXEC_COLUMNS = [
    "rep", "cell", "index", "workload", "kind", "context_id", "bucket", "gen", "prompt_tokens", "policy",
    "order", "latency_ms", "ttft_ms", "tokens_per_s", "output_tokens", "drafted", "accepted", "rounds",
    "mean_accept_len", "alpha_req", "hit_tokens", "exact_repeat", "reuse", "k", "mean_k", "predicted_ms",
    "match", "first_diff", "stopped", "explore_ms", "cpu_share", "gate_stops", "gate_tokens", "lookup_drafted", "lookup_accepted",
    "alpha_decided", "turn", "ids_from", "previous_tokens", "kept_tokens",
    "decode_tps", "peer_prompt_tokens", "peer_wall_ms", "text_match",
]
GATE_ARMS = ("adaptive:gate", "adaptive:nogate")     # per request, with / without the confidence gate
ADAPTIVE_ARMS = ("adaptive", "adaptive:request", "adaptive:round") + GATE_ARMS
CAND_COLUMNS = ["rep", "cell", "index", "policy", "reuse", "k", "predicted_ms", "feasible", "chosen"]


@dataclass(frozen=True)
class Arm:
    name: str                  # ar | kv | spec:K | joint:K | adaptive:request | adaptive:round | a peer's arm
    peer: Peer | None = None   # the peer that runs it (rakv.bench.peers); None: an engine policy
    policy: str = ""           # engine policy string
    granularity: str = "round"

    @property
    def action(self) -> tuple[int, int] | None:
        """(r, k) of a fixed engine policy (None for adaptive and peers)."""
        if self.peer or self.policy.startswith("adaptive"):
            return None
        p = Policy.parse(self.policy)
        return int(p.reuse), p.k


def default_arm_names(k_set, peers: bool, draft) -> list[str]:
    ks = [k for k in k_set if k > 0]
    names = ["ar", "kv"] + [f"spec:{k}" for k in ks] + [f"joint:{k}" for k in ks]
    if ks and not _no_draft(draft):
        names += ["adaptive:request", "adaptive:round"]
    elif not ks:
        names += ["adaptive:request"]
    if _no_draft(draft):
        names = [n for n in names if not (n.startswith(("spec:", "joint:")))]
    if peers:
        names += [a for p in PEERS for a in p.default_arms(draft)]
    return names


def _no_draft(draft) -> bool:
    return getattr(draft, "name", "none") == "none"


def parse_arms(names: list[str], draft) -> list[Arm]:
    """Policy names -> arms; 'adaptive' means both granularities; 'ar' is always included (first)."""
    arms: list[Arm] = []
    for raw in names:
        n = raw.strip().lower()
        if not n:
            continue
        if n == "adaptive":
            new = [Arm("adaptive:request", policy="adaptive", granularity="request"),
                   Arm("adaptive:round", policy="adaptive", granularity="round")]
        elif n in ("adaptive:request", "adaptive:round"):
            new = [Arm(n, policy="adaptive", granularity=n.split(":")[1])]
        elif n in GATE_ARMS:      # per request, with / without the gate
            new = [Arm(n, policy=n, granularity="request")]
        elif (peer := peer_of(n)) is not None:
            why = peer.why_not(n, draft)
            if why:
                raise ValueError(why)
            new = [Arm(n, peer=peer)]
        else:
            p = Policy.parse(n)
            if p.k > 0 and _no_draft(draft):
                raise ValueError(f"policy {n} needs a draft; --draft is 'none'")
            new = [Arm(p.name, policy=p.name)]
        arms += [a for a in new if a not in arms]
    if not any(a.name == "ar" for a in arms):
        arms.insert(0, Arm("ar", policy="ar"))
    return arms


# ----------------------------------------------------------------------------- one execution
class Collector:
    """Engine callback: keeps the per-request decision and the rounds of the current request."""

    def __init__(self):
        self.decision: Decision | None = None
        self.rounds: list[Round] = []

    def reset(self) -> None:
        self.decision, self.rounds = None, []

    def __call__(self, rec) -> None:
        if isinstance(rec, Decision) and rec.round == -1:
            self.decision = rec
        elif isinstance(rec, Round) and rec.kind != "prefill":
            self.rounds.append(rec)


@dataclass
class Slot:
    """An arm's engine for one stream and repeat (None for peers)."""

    arm: Arm
    engine: Engine | None = None
    collector: Collector = field(default_factory=Collector)


def make_slots(arms, session: Session, learned: dict | None = None) -> list[Slot]:
    """Fresh engines over the session's models for one stream, each with the session's config
    set to its arm's policy. ``learned`` maps an adaptive arm to the copy of the session's profile it
    keeps across streams (None: a throwaway copy, as for the warm-up)."""
    slots = []
    for arm in arms:
        s = Slot(arm)
        if not arm.peer:
            cfg = session.config.with_(policy=arm.policy, granularity=arm.granularity)
            prof = None
            if arm.policy.startswith("adaptive"):
                if learned is None:
                    prof = copy.deepcopy(session.profile)
                else:
                    if arm.name not in learned:
                        learned[arm.name] = copy.deepcopy(session.profile)
                    prof = learned[arm.name]
            s.engine = session.new_engine(s.collector, config=cfg, profile=prof)
        slots.append(s)
    return slots


def alpha_of(rounds: list[Round]) -> float | None:
    """Per-request acceptance, the engine's definition: sum a / sum (a + [a < drafted])."""
    acc = trials = 0
    for r in rounds:
        if r.drafted > 0 and not r.draft_source:      # the model draft's rounds, not n-gram lookups
            acc += r.accepted
            trials += r.accepted + (1 if r.accepted < r.drafted else 0)
    return acc / trials if trials else None


def copy_columns(rounds: list[Round]) -> dict:
    """The gate's n-gram copies of one execution (k = 0 rounds included), apart from the draft's own
    drafted / accepted: tokens verified and accepted (0 and 0 without any)."""
    looked = [r for r in rounds if r.draft_source == "lookup"]
    return {"lookup_drafted": sum(r.drafted for r in looked), "lookup_accepted": sum(r.accepted for r in looked)}


def gate_columns(rounds: list[Round]) -> dict:
    """The confidence gate's rounds of one execution: stop reasons counted, and every judged drafted
    token as "predicted:outcome" (accepted 1 / first rejected 0), for its reliability diagram."""
    out = copy_columns(rounds)
    gated = [r for r in rounds if r.draft_stop]
    if not gated:
        return out
    stops: dict[str, int] = {}
    toks = []
    for r in gated:
        stops[r.draft_stop] = stops.get(r.draft_stop, 0) + 1
        toks += [f"{p:.3f}:{int(ok)}" for p, ok in judged(r.draft_pred, r.drafted, r.accepted)]
    return {"gate_stops": " ".join(f"{k}:{v}" for k, v in sorted(stops.items())), "gate_tokens": " ".join(toks), **out}


def run_engine(slot: Slot, req: Request) -> tuple[dict, list[dict]]:
    slot.collector.reset()
    end = slot.engine.generate(req.prompt if req.prompt is not None else list(req.ids), req.gen)
    rounds = slot.collector.rounds
    a = alpha_of(rounds)
    copies = copy_columns(rounds)["lookup_accepted"]
    row = dict(latency_ms=end.latency_ms, ttft_ms=end.ttft_ms, tokens_per_s=end.tokens_per_s,
               output_tokens=len(end.output_ids), drafted=end.drafted, accepted=end.accepted,
               rounds=end.rounds, mean_accept_len=accept_len(end.accepted + copies, end.rounds),
               alpha_req="" if a is None else round(a, 4), hit_tokens=end.hit_tokens,
               exact_repeat=int(end.exact_repeat), reuse=end.action["reuse"], k=end.action["k"],
               mean_k=round(sum(r.k for r in rounds) / len(rounds), 3) if rounds else 0,
               predicted_ms="" if end.predicted_ms is None else round(end.predicted_ms, 3),
               stopped=end.stopped, explore_ms=round(end.explore_ms, 3), _ids=end.output_ids,
               decode_tps=decode_tps(len(end.output_ids), end.latency_ms, end.ttft_ms), **gate_columns(rounds))
    cands = []
    dec = slot.collector.decision
    if slot.arm.policy.startswith("adaptive") and dec is not None:
        row["alpha_decided"] = round(dec.alpha, 4)        # the acceptance estimate the decision used
        for c in dec.candidates:
            cands.append(dict(policy=slot.arm.name, reuse=c["reuse"], k=c["k"], predicted_ms=c["predicted_ms"],
                              feasible=int(bool(c["feasible"])),
                              chosen=int(c["reuse"] == dec.action["reuse"] and c["k"] == dec.action["k"])))
    return row, cands


def decode_tps(n: int, latency_ms: float, ttft_ms: float | None):
    """Tokens after the first over the time after the first: the decode rate, prompt excluded."""
    if ttft_ms is None or n < 2 or latency_ms <= ttft_ms:
        return ""
    return round((n - 1) / ((latency_ms - ttft_ms) / 1e3), 3)


def same_text(theirs: str, ours: str) -> bool:
    """Do two outputs agree as far as the shorter goes? (llama-speculative-simple can run past N, and
    either side may stop at an end of generation first.)"""
    a, b = (theirs or "").strip(), (ours or "").strip()
    if not a or not b:
        return a == b
    return a.startswith(b) or b.startswith(a)


def turn_columns(req: Request) -> dict:
    """A conversation turn's ids: how they were built, the conversation before, how much of it they keep."""
    c = getattr(req.prompt, "conversation", None)
    if not c:
        return {}
    return {"ids_from": c["ids_from"], "previous_tokens": c["previous_tokens"], "kept_tokens": c["kept_tokens"]}


def first_diff(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return -1 if len(a) == len(b) else min(len(a), len(b))


# ----------------------------------------------------------------------------- the loop
class Progress:
    """One-line progress bar on stderr with an ETA."""

    def __init__(self, total: int, enabled: bool = True):
        self.total, self.done, self.t0, self.enabled = max(1, total), 0, now(), enabled

    def tick(self, what: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        f = self.done / self.total
        el = now() - self.t0
        eta = el / self.done * (self.total - self.done)
        w = 28
        bar = "#" * int(f * w) + "." * (w - int(f * w))
        sys.stderr.write(f"\r[rakv] bench [{bar}] {self.done}/{self.total} {f * 100:5.1f}% "
                         f"{_hms(el)} elapsed, ETA {_hms(eta)}  {what[:40]:<40}")
        if self.done >= self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def _hms(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class CsvOut:
    def __init__(self, path: Path, columns: list[str], keep: list[dict] | None = None):
        """A CSV flushed per write; ``keep`` rows (from a resumed run) are written first."""
        self.f = open(path, "w", newline="", encoding="utf-8")
        self.w = csv.DictWriter(self.f, fieldnames=columns, extrasaction="ignore")
        self.w.writeheader()
        if keep:
            self.write(keep)

    def write(self, rows: list[dict]) -> None:
        self.w.writerows(rows)
        self.f.flush()

    def close(self) -> None:
        self.f.close()


@dataclass
class BenchContext:
    session: Session           # the models, the bench's config and the calibrated profile
    arms: list[Arm]
    lookup_k: int
    raw: bool = False          # chat and conversation workloads: without the chat template

    @property
    def target(self):
        return self.session.target

    @property
    def draft(self):
        return self.session.draft

    @property
    def config(self) -> RakvConfig:
        return self.session.config

    @property
    def profile(self):
        return self.session.profile


NOT_COMPARED = -1    # "match" of an arm that is exact in distribution only (rejection verify, a sampling peer)


def token_exact(sampling, peer: bool, numerics: str = "fp32") -> bool:
    """Must this arm give ar's very tokens? Greedy: every arm, but a peer only in fp32 numerics
    (under q8 transformers' forward runs its own attention and norms around the q8 linears: another
    computation than the engine's). Sampled: the engine's arms under seeded verification (a peer
    samples with its own generator; rejection is exact in distribution)."""
    if peer and numerics != "fp32":
        return False
    return sampling is None or sampling.greedy or (not peer and sampling.verify == "seeded")


def williams_orders(n: int) -> list[list[int]]:
    """A Williams design: n orders of n arms (2n when n is odd) in which every arm runs right
    after every other arm equally often. With the orders merely rotated each arm always ran right
    after the same one, so whatever an execution leaves behind (caches, predictors, the allocator)
    fell on one arm only (docs/bench.md#how-a-run-works)."""
    base, lo, hi = [0], 1, n - 1
    for j in range(1, n):
        if j % 2:
            base.append(lo)
            lo += 1
        else:
            base.append(hi)
            hi -= 1
    orders = [[(b + r) % n for b in base] for r in range(n)]
    return orders + [o[::-1] for o in orders] if n % 2 else orders


def arm_order(n: int, index: int, rep: int) -> list[int]:
    """The order of the n arms for request ``index`` of repeat ``rep``: the Williams design's
    orders in turn (so a stream of n or 2n requests balances who runs after whom)."""
    orders = williams_orders(n)
    return orders[(index + rep) % len(orders)]


def run_request(ctx: BenchContext, slots: list[Slot], req: Request, rep: int, cell: str,
                progress: Progress | None) -> tuple[list[dict], list[dict]]:
    """Run every arm once on ``req`` (in ``arm_order``), then check exactness against ar."""
    rows, cands = [], []
    for pos, slot in enumerate(slots[i] for i in arm_order(len(slots), req.index, rep)):
        c0, w0 = cpu_clock(), now()
        if slot.arm.peer:
            row, cc = slot.arm.peer.run(slot.arm.name, req, ctx), []
        else:
            row, cc = run_engine(slot, req)
        wall = now() - w0
        # the main thread's CPU time over wall time: ~1 on a quiet machine (it computes or spins
        # through every forward); lower when another process took the CPU during this execution
        row["cpu_share"] = round(min(1.0, (cpu_clock() - c0) / wall), 3) if wall > 0 else ""
        if slot.arm.peer and slot.arm.peer.own_process:
            row["cpu_share"] = ""          # another process computes: this thread's share says nothing
        base = dict(rep=rep, cell=cell, index=req.index, workload=req.workload, kind=req.kind,
                    context_id=req.context_id, bucket=req.bucket, gen=req.gen, prompt_tokens=len(req.ids),
                    policy=slot.arm.name, order=pos, turn=req.turn, **turn_columns(req))
        rows.append({**base, **row})
        cands += [{**dict(rep=rep, cell=cell, index=req.index), **c} for c in cc]
        if progress:
            progress.tick(f"{cell} #{req.index} {slot.arm.name}")
    ref = next(r["_ids"] for r in rows if r["policy"] == "ar")
    peers = {s.arm.name: s.arm.peer for s in slots if s.arm.peer}
    ref_text = None
    for r in rows:
        d = first_diff(r["_ids"], ref)
        r["match"], r["first_diff"] = int(d < 0), ("" if d < 0 else d)
        if not token_exact(ctx.config.sampling, r["policy"] in peers, getattr(ctx.target, "numerics", "fp32")):
            r["match"] = NOT_COMPARED
        if r["policy"] in peers and peers[r["policy"]].compare == "text":   # another program's arithmetic
            if ref_text is None:
                ref_text = ctx.target.tokenizer.decode(ref, skip_special_tokens=True).strip()
            r["match"], r["text_match"] = NOT_COMPARED, int(same_text(r.get("_text", ""), ref_text))
    rows.sort(key=lambda r: [s.arm.name for s in slots].index(r["policy"]))
    return rows, cands


def warm_up(ctx: BenchContext, req: Request) -> None:
    """Every arm once on one request with throwaway engines; nothing is recorded."""
    slots = make_slots(ctx.arms, ctx.session)
    w = Request(req.index, req.workload, req.kind, req.bucket, min(req.gen, 8), req.ids, req.context_id)
    run_request(ctx, slots, w, 0, "warmup", None)


def completed_cells(out_dir: Path, streams: dict[str, list[Request]], n_arms: int) -> tuple[set, list, list]:
    """For --resume: the (rep, cell) streams already complete in out_dir, and their rows.

    A stream is the unit of resumption (its engines' cache state is built along it), so a
    partly-run stream is dropped and run again from its start."""
    rows, cands = [], []
    for name, into in (("executions.csv", rows), ("candidates.csv", cands)):
        f = out_dir / name
        if f.exists():
            with open(f, newline="", encoding="utf-8") as fh:
                into.extend(csv.DictReader(fh))
    count: dict[tuple[str, str], int] = {}
    for r in rows:
        count[(r["rep"], r["cell"])] = count.get((r["rep"], r["cell"]), 0) + 1
    done = {key for key, n in count.items() if key[1] in streams and n == len(streams[key[1]]) * n_arms}
    keep = [r for r in rows if (r["rep"], r["cell"]) in done]
    keep_c = [r for r in cands if (r["rep"], r["cell"]) in done]
    return done, keep, keep_c


def run_streams(ctx: BenchContext, streams: dict[str, list[Request]], repeats: int, out_dir: Path,
                show_progress: bool = True, resume: bool = False) -> tuple[int, int]:
    """All cells x repeats; returns (executions, mismatches). Rows are flushed per request.
    With ``resume``, streams already complete in out_dir are kept and skipped."""
    total = sum(len(s) for s in streams.values()) * repeats * len(ctx.arms)
    first = next((s[0] for s in streams.values() if s), None)
    if first is None:
        raise ValueError("no requests to run")
    done, keep, keep_c = completed_cells(out_dir, streams, len(ctx.arms)) if resume else (set(), [], [])
    warm_up(ctx, first)
    ex = CsvOut(out_dir / "executions.csv", EXEC_COLUMNS, keep)
    ca = CsvOut(out_dir / "candidates.csv", CAND_COLUMNS, keep_c)
    progress = Progress(total - len(keep), show_progress)
    n_exec = len(keep)
    n_bad = sum(1 for r in keep if str(r.get("match")) not in ("True", "1", "true", str(NOT_COMPARED)))
    learned: dict = {}
    try:
        for rep in range(repeats):
            for cell, stream in streams.items():
                if (str(rep), cell) in done:
                    continue
                slots = make_slots(ctx.arms, ctx.session, learned)
                turns = TurnBuilder(ctx.target.tokenizer, ctx.target.eos_ids, ctx.raw) if any(
                    r.turn for r in stream) else None
                for req in stream:
                    if turns is not None:     # a conversation's turn: its ids follow the answers before it
                        req = turns.prepare(req)
                    rows, cands = run_request(ctx, slots, req, rep, cell, progress)
                    if turns is not None:
                        turns.answered(next(r["_ids"] for r in rows if r["policy"] == "ar"))
                    ex.write(rows)
                    ca.write(cands)
                    n_exec += len(rows)
                    n_bad += sum(1 for r in rows if not r["match"])
    finally:
        ex.close()
        ca.close()
    return n_exec, n_bad

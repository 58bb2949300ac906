"""Calibration: measure every term of the cost model on this machine by running the pair.

Prefill curves, steps against context, the verify per k and the draft's steps are timed in one
interleaved rounds loop, checked for spread and for the share of CPU this process got (a busy
machine is measured again, bounded, or flagged ``contended``), and the acceptance prior alpha0 is
measured on prose and code. ``load_or_calibrate`` reuses a saved profile when its fingerprint
matches; ``check_profile`` times a few terms now against the saved ones.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Callable

import torch

from .. import decoding as dec
from ..util.device import clock
from ..util.meter import SHARE_QUIET, Meter, Timing, check_enabled, cpu_clock, is_quiet, time_reps
from .policy import batch_vs, lookup_vs
from .profile import CostProfile, _usable, interp, pair_fingerprint, profile_path, save_profile

now = clock          # synchronizes CUDA / MPS before reading the time


CAL_TEXT = (
    "The history of the city begins with a small settlement on the river. Over the centuries it "
    "grew into a centre of trade, with markets, bridges and a cathedral. In the nineteenth century "
    "the railway arrived, and factories were built along the banks. Today the city is known for its "
    "university, its museums and its parks, and for the festival held every summer. "
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(add(i, i))\n"
)


def _median_ms(fn: Callable[[], None], reps: int) -> float:
    return time_reps(fn, reps).value


def calibration_ids(tokenizer, n: int, vocab: int) -> list[int]:
    if tokenizer is not None:
        ids = tokenizer(CAL_TEXT, add_special_tokens=False)["input_ids"]
    else:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab, (256,), generator=g).tolist()
    out = []
    while len(out) < n:
        out.extend(ids)
    return out[:n]


# The calibration's grid: few points and repeats, chosen so the demo pair calibrates in seconds
# on a quiet 2-core machine. Prefill tokens dominate its time (under q8 numerics a prefill row
# costs about a decode step), so lengths stay short and the curves extrapolate linearly past them
# (online refinement corrects the prefill's scale). What the cost model needs stays: prefill in
# length (3 points) and the step by context (2), checked to rise; V(k) for every k up to k_max; d;
# medians of repeats with a spread check (a noisy term is measured again, rakv/util/meter.py).
GRID = {
    "full": {"reps": 3, "pf_ns": [8, 32, 128], "ctxs": [16, 128], "n_steps": 8, "v_reps": 4,
             "alpha_rounds": 6, "regime_reps": 3},
    "quick": {"reps": 2, "pf_ns": [8, 32, 128], "ctxs": [16, 128], "n_steps": 5, "v_reps": 3,
              "alpha_rounds": 4, "regime_reps": 2},
}


def calibration_grid(target, k_max: int, quick: bool) -> dict:
    """The sizes and repeats one calibration measures (``GRID``, cut to the model's context)."""
    g = dict(GRID["quick" if quick else "full"])
    maxpos = target.max_positions or 2048
    g["pf_ns"] = [n for n in g["pf_ns"] if n < maxpos // 2]
    g["ctxs"] = [c for c in g["ctxs"] if c + 16 < maxpos]
    g["keys"] = list(range(0, k_max + 1)) + sorted({k for k in lookup_vs(k_max) + batch_vs(k_max) if k > k_max})
    return g


def estimate_s(g: dict, step_ms: float, token_ms: float, draft_ms: float = 0.0, has_dmodel: bool = False) -> float:
    """Seconds the calibration of grid ``g`` should take, from one target step (``step_ms``), the
    prefill cost per token (``token_ms``) and one draft step (``draft_ms``), timed just before.
    Counts every forward it runs; a margin for Python, re-measuring and the regime figures."""
    pf_tok = g["reps"] * sum(g["pf_ns"]) + g["pf_ns"][0] + sum(g["ctxs"]) + max(g["ctxs"]) + 3 * 64 + 128
    steps = len(g["ctxs"]) * g["n_steps"] + 4 * g["regime_reps"] + 8
    keys = g["keys"]
    verify = (g["v_reps"] + 1) * sum(step_ms * (1 + 0.08 * k) for k in keys)
    drafts = 0.0
    if has_dmodel:
        pf_tok_d = g["reps"] * sum(g["pf_ns"]) + g["pf_ns"][0] + sum(g["ctxs"]) + max(g["ctxs"]) + 3 * 64
        drafts = (pf_tok_d * token_ms * draft_ms / max(step_ms, 1e-9)
                  + (len(g["ctxs"]) * g["n_steps"] + (g["v_reps"] + 1) * sum(k for k in keys if k <= 8)
                     + 3 * g["alpha_rounds"] * 4) * draft_ms)
    alpha = (3 if has_dmodel else 1) * g["alpha_rounds"] * step_ms * 1.3
    ms = pf_tok * token_ms + steps * step_ms + verify + drafts + alpha
    return 1.25 * ms / 1e3


def _quick_timings(model, dmodel, ids) -> tuple[float, float, float]:
    """(target step ms at a short context, target prefill ms per token, draft step ms): the figures
    the up-front estimate scales from (a few forwards, after the warm-up)."""
    def step_ms(m):      # the fastest of a few (a first call can pay one-time costs)
        cache = dec.DynamicCache()
        dec.prefill(m, ids[:16], cache)
        dec.decode_one(m, ids[16], cache)
        return min(time_reps(lambda: (dec.decode_one(m, ids[17], cache), dec.rollback(cache, 1)), 4).ms)

    t = step_ms(model)
    p = min(time_reps(lambda: dec.prefill(model, ids[:32], dec.DynamicCache()), 2).ms) / 32
    d = step_ms(dmodel) if dmodel is not None else 0.0
    return t, p, d


def calibrate(target, draft, k_max: int = 8, progress: Callable[[float, str], None] | None = None,
              quick: bool = False, meter: Meter | None = None, say: Callable[[str], None] | None = None) -> CostProfile:
    """Measure every term of the cost model on this machine. ``draft`` is a DraftSource.

    Every term goes through a Meter (rakv/util/meter.py): noisy terms are measured again, prefill and
    step curves must rise with length, and the profile's ``quality`` says how clean it all was
    (``contended`` when the machine was busy). ``say`` gets one line with the up-front estimate
    ("calibrating: about N s"); ``progress(frac, what)`` follows each term."""
    t_start = now()
    meter = meter or Meter()
    g = calibration_grid(target, k_max, quick)
    reps, pf_ns, ctxs = g["reps"], g["pf_ns"], g["ctxs"]
    ids = calibration_ids(target.tokenizer, max(pf_ns + ctxs) + max([k_max, *batch_vs(k_max)]) + 32, target.vocab_size)
    dmodel = draft.lm.model if draft.has_model else None
    steps = len(pf_ns) * (2 if dmodel is not None else 1) + len(ctxs) * (2 if dmodel is not None else 1) + 1 + 2
    done = 0
    phases: dict[str, float] = {}
    phases_cpu: dict[str, float] = {}          # main-thread CPU seconds: ~ the wall time a quiet machine takes
    t_phase = [now(), cpu_clock()]

    def phase(name: str):
        t, c = now(), cpu_clock()
        phases[name] = round(phases.get(name, 0.0) + t - t_phase[0], 2)
        phases_cpu[name] = round(phases_cpu.get(name, 0.0) + c - t_phase[1], 2)
        t_phase[0], t_phase[1] = t, c

    def tick(what: str):
        nonlocal done
        done += 1
        if progress:
            progress(min(1.0, done / steps), what)

    def pf_cost(model, n, name):
        def run():
            dec.prefill(model, ids[:n], dec.DynamicCache())

        def timing():
            if n == pf_ns[0]:
                run()   # warm-up of the curve, excluded (later lengths run warm)
            return time_reps(run, reps)
        return meter.measure(f"{name}@{n}", timing).value

    def step_cost(model, ctx, name, n_steps=g["n_steps"]):
        def timing():
            cache = dec.DynamicCache()
            dec.prefill(model, ids[:ctx], cache)
            it = iter(range(ctx, ctx + n_steps))
            for _ in range(2):                                 # the first steps run cold: excluded
                dec.decode_one(model, ids[next(it)], cache)
            return time_reps(lambda: dec.decode_one(model, ids[next(it)], cache), n_steps - 2)
        return meter.measure(f"{name}@{ctx}", timing).value

    def curve(model, xs, name, cost):
        pts = []
        for x in xs:
            pts.append([x, cost(model, x, name)])
            tick(f"{'target' if model is target.model else 'draft'} {name} {x}")
        return meter.monotone(name, pts, lambda i: cost(model, pts[i][0], name))

    prof = CostProfile()
    model = target.model
    dec.prefill(model, ids[:16], dec.DynamicCache())   # global warm-up
    if dmodel is not None:
        dec.prefill(dmodel, ids[:16], dec.DynamicCache())
    step_ms, token_ms, draft_ms = _quick_timings(model, dmodel, ids)
    est = estimate_s(g, step_ms, token_ms, draft_ms, dmodel is not None)
    if say:
        say(f"calibrating: about {max(1, round(est))} s (a target step takes {step_ms:.1f} ms here"
            + (f", a draft step {draft_ms:.1f} ms" if dmodel is not None else "") + ")")
    phase("warm-up")
    prof.T_pf = curve(model, pf_ns, "T_pf", pf_cost)
    prof.t = curve(model, ctxs, "t", step_cost)
    phase("target curves")
    V_ctx = min(128, max(ctxs))
    prof.V_ctx = V_ctx
    if dmodel is not None:
        prof.D_pf = curve(dmodel, pf_ns, "D_pf", pf_cost)
        prof.d = curve(dmodel, ctxs, "d", step_cost)
        phase("draft curves")
    # Verify costs and the draft step as *ratios to a target step*, measured interleaved in one
    # loop (rotated order) so that machine drift or a neighbour's load hits them all alike.
    ratios = interleaved_ratios(model, dmodel, ids, V_ctx, k_max, reps=g["v_reps"], tick=tick, meter=meter,
                                extra=sorted(set(lookup_vs(k_max) + batch_vs(k_max))))
    phase("verify ratios")
    t_ref = interp(prof.t, V_ctx)
    # a verify of k+1 tokens does a step's work and more: a ratio below 1 is noise (docs/controller.md),
    # and calibration's ratios are what the controller keeps
    prof.V.update({str(k): max(1.0, r) * t_ref for k, r in ratios.items() if k not in ("d", "d2")})
    if dmodel is not None:
        d_ref = interp(prof.d, V_ctx)
        prof.d = [[c, ms * ratios["d"] * t_ref / d_ref] for c, ms in prof.d]
        prof.d2_ratio = round(min(8.0, max(1.0, ratios["d2"] / ratios["d"])), 4) if ratios.get("d") else 1.0
    else:
        prof.d = [[16, 0.02], [1024, 0.05]] if draft.name == "ngram" else []
    # clone/store cost per token (KV copy) and lookup cost
    cache = dec.DynamicCache()
    dec.prefill(model, ids[:128], cache)
    prof.clone_ms_per_token = _median_ms(lambda: dec.kv_of(cache, 128), 5) / 128
    from .gate import AcceptMap

    amap = AcceptMap()
    prof.alpha0 = measure_alpha(target, draft, ids, k=4, rounds=g["alpha_rounds"], amap=amap)
    prof.accept_map = amap.counts()
    tick("acceptance")
    phase("acceptance")
    prof.quality = meter.quality()
    prof.regime = regime_figures(target, prof, reps=g["regime_reps"])
    phase("regime")
    prof.calibration_s = now() - t_start
    prof.quality["estimate_s"] = round(est, 1)
    prof.quality["phases_s"] = phases
    prof.quality["phases_cpu_s"] = phases_cpu
    prof.calibrated_at = time.strftime("%Y-%m-%dT%H:%M:%S")
    return prof


def regime_figures(target, prof: CostProfile, reps: int = 5) -> dict:
    """Where this machine's step sits: against the weight-streaming floor, V(k)/t, d/t, ISA, threads.

    The floor is measured, not computed from a bandwidth figure: one pass over all of the target's
    linear layers on 1 row (``fastpath.linear_floor_ms``; the weights stream from memory as in a
    step), with whatever kernel the forward uses (packed oneDNN on the fast path).
    """
    from ..util.device import isa_flags, model_device, threads_info
    from ..kernels.fastpath import is_enabled, linear_floor_ms, one_row_kernel

    model = target.model
    ctx = prof.V_ctx
    t = interp(prof.t, ctx)
    floor = linear_floor_ms(model, rows=1, reps=reps)
    floor_v4 = linear_floor_ms(model, rows=5, reps=reps)
    d = interp(prof.d, ctx) if prof.d else 0.0
    return {
        "device": str(model_device(model)), "fast": is_enabled(model), "one_row_kernel": one_row_kernel(model),
        "lean": _backend_name(target).startswith("lean"), "backend": _backend_name(target),
        "block_layers": target.blockq.get("layers", 0),
        **threads_info(), "isa": isa_flags(),
        "ctx": ctx, "step_ms": round(t, 3),
        "floor_ms": round(floor, 3), "floor_method": "one pass over all linear layers, 1 row (measured)",
        "step_over_floor": round(t / floor, 3) if floor > 0 else None,
        "floor5_ms": round(floor_v4, 3),
        "V_over_t": {k: round(prof.V[k] / t, 3) for k in sorted(prof.V, key=int)} if t > 0 else {},
        "d_over_t": round(d / t, 3) if t > 0 and d > 0 else None,
        "d2_over_d": round(prof.d2_ratio, 3) if d > 0 else None,
    }


def interleaved_ratios(model, dmodel, ids, ctx: int, k_max: int, reps: int, tick=None,
                       meter: Meter | None = None, extra: list[int] = ()) -> dict:
    """Costs as the engine pays them, as ratios to a 1-token target forward at context ``ctx``.

    One "round" of key k (1..k_max) is what a speculative round does: k consecutive 1-token
    draft forwards, then a (k+1)-token target verify (both rolled back after). Key 0 is a plain
    target step. All keys run interleaved in a rotated order, so drift or a neighbour's load hits
    them alike. Measured in the loop, not in isolation: a lone draft forward after a target
    forward runs cold and costs more than the steps of a real drafting run (docs/controller.md).
    Keys in ``extra`` (past k_max) time the verify alone: n-gram lookups, which draft nothing.
    Returns {k: V(k)/t} and (with a draft model) "d": median draft ms per drafted token / t, and
    "d2": the draft's 2-token forward / t.
    The whole block is measured again (``meter``) when its timings are noisy.
    """
    meter = meter or Meter(check=False)
    out = meter.measure_many("V", lambda: _interleaved_block(model, dmodel, ids, ctx, k_max, reps, extra))
    if tick:
        tick("verify/step ratios")
    return out


def _interleaved_block(model, dmodel, ids, ctx: int, k_max: int, reps: int, extra=()) -> tuple[dict, dict]:
    base = dec.DynamicCache()
    dec.prefill(model, ids[:ctx], base)
    dbase = None
    if dmodel is not None:
        dbase = dec.DynamicCache()
        dec.prefill(dmodel, ids[:ctx], dbase)
    keys = list(range(0, k_max + 1)) + [k for k in extra if k > k_max]
    xs: dict = {key: Timing() for key in keys}
    ds, d2 = Timing(), Timing()

    def once(k):
        if k == 0:
            t0, c0 = now(), cpu_clock()
            dec.decode_one(model, ids[ctx], base)
            ms = (now() - t0, cpu_clock() - c0)
            dec.rollback(base, 1)
            return ms, None
        d_ms = None
        if dbase is not None and k <= k_max:
            if k == 1:      # the 2-token step that opens a round after a fully accepted one (after a verify, as there)
                t0, c0 = now(), cpu_clock()
                dec.prefill(dmodel, ids[ctx: ctx + 2], dbase)
                d2.add(now() - t0, cpu_clock() - c0)
                dec.rollback(dbase, 2)
            t0, c0 = now(), cpu_clock()
            for i in range(k):      # q_i = draft(x_{<ctx+i})
                dec.decode_one(dmodel, ids[ctx + i], dbase)
            d_ms = ((now() - t0) / k, (cpu_clock() - c0) / k)
            dec.rollback(dbase, k)
        toks = ids[ctx: ctx + k + 1]
        t0, c0 = now(), cpu_clock()
        dec.verify(model, toks, base)
        ms = (now() - t0, cpu_clock() - c0)
        dec.rollback(base, k + 1)
        return ms, d_ms

    for key in keys:       # warm-up, excluded
        once(key)
    for r in range(reps):
        order = keys[r % len(keys):] + keys[: r % len(keys)]
        for key in order:
            ms, d_ms = once(key)
            xs[key].add(*ms)
            if d_ms is not None:
                ds.add(*d_ms)
    t1 = xs[0].value
    out = {key: v.value / t1 for key, v in xs.items() if key != 0}
    timings = {("t@ratio" if key == 0 else f"V{key}"): v for key, v in xs.items()}
    if ds.ms:
        out["d"] = ds.value / t1
        timings["d@ratio"] = ds
    if d2.ms:
        out["d2"] = d2.value / t1
        timings["d2@ratio"] = d2
    return out, timings


# prompts for a model draft's acceptance prior: plain prose, history prose and code (the kinds of
# text the workloads hold). The target continues each freely; one text alone gave 0.67 where the
# WikiText-2, HumanEval and repetitive workloads measure 0.78-0.88, and each run starts from it.
ALPHA_TEXTS = (
    CAL_TEXT.split(" def ")[0],
    "The river flows through the valley past old mills and farms. In spring the water rises and "
    "the meadows flood, and birds return to nest along the banks. Farmers in the region grow "
    "wheat, barley and apples, and",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n"
    "    a, b = 0, 1\n    for _ in range(n - 1):\n        a, b = b, a + b\n    return b\n\n\n"
    "def is_prime(n):\n",
)


def measure_alpha(target, draft, ids, k: int = 4, rounds: int = 8, amap=None, sampling=None) -> float:
    """Per-token acceptance of the draft over a few rounds (greedy, or at ``sampling``'s setting),
    pooled over the prompts; with ``amap`` (rakv.gate.AcceptMap) each drafted token's confidence
    and outcome go into it too."""
    if not draft.proposes:
        return 0.0
    tok = target.tokenizer
    if draft.has_model:
        # a model draft costs real time per drafted token: measure on text that does not repeat
        prompts = ([tok(t, add_special_tokens=False)["input_ids"][:64] for t in ALPHA_TEXTS]
                   if tok is not None else [ids[:64]])
    else:
        # n-gram lookup (free to draft): the calibration text cycles and this prompt ends where it
        # starts to repeat, a deliberately optimistic prior (drafting rounds then correct it; a
        # pessimistic one would only be corrected by probes)
        period = len(tok(CAL_TEXT, add_special_tokens=False)["input_ids"]) if tok is not None else 256
        prompts = [ids[: max(16, min(period + 16, len(ids) - rounds * (k + 1) - 2))]]
    acc = trials = 0
    for prompt in prompts:
        a, n = _accept_rounds(target, draft, prompt, k, rounds, amap, sampling)
        acc, trials = acc + a, trials + n
    return acc / trials if trials else 0.0


def _accept_rounds(target, draft, prompt, k: int, rounds: int, amap=None, sampling=None) -> tuple[int, int]:
    """(accepted, trials) over ``rounds`` rounds of k drafts after ``prompt``, verified as the
    engine does at ``sampling``'s setting (greedy when None)."""
    from ..decoding import sampling as S
    from ..util.acceptance import trials as round_trials
    from .gate import recording_gate

    s = sampling if sampling is not None and not sampling.greedy else None
    draft.sampling = s
    draft.begin(prompt, None, False)
    cache = dec.DynamicCache()
    logits = dec.prefill(target.model, prompt, cache)
    seq = list(prompt) + [dec.argmax(logits) if s is None else S.sample(logits, s, 0)]
    acc = trials = 0
    for _ in range(rounds):
        gate = recording_gate(amap, k) if amap is not None else None
        pos = len(seq) - len(prompt)                 # the output position of the first draft
        proposal = draft.propose(seq, k, gate)
        prop = proposal.tokens
        if not prop:
            logits = dec.decode_one(target.model, seq[-1], cache)
            seq.append(dec.argmax(logits) if s is None else S.sample(logits, s, pos))
            trials += 1
            continue
        logits = dec.verify(target.model, [seq[-1]] + prop, cache)
        if s is None:
            pred = torch.argmax(logits, dim=-1).tolist()
            a = dec.accept(prop, pred)
        elif s.verify == "seeded":
            pred = S.sample_rows(logits, s, list(range(pos, pos + len(prop) + 1)), prop)
            a = S.accept_seeded(prop, pred)
        else:
            a, nxt = S.accept_rejection(logits, proposal.q_logits, prop, s, pos)
            pred = prop[:a] + [nxt]
        if gate is not None:
            amap.observe(gate.confs, gate.preds, a)
        dec.rollback(cache, len(prop) - a)
        seq += prop[:a] + [pred[a]]
        draft.commit(seq)
        acc += a
        trials += round_trials(a, len(prop))
    draft.end()
    draft.sampling = None
    return acc, trials


def alpha_prior(profile, target, draft, sampling, ids=None) -> float:
    """The acceptance prior at a sampling setting: calibration's alpha0 when greedy; otherwise
    measured once at that setting (a few rounds on the calibration texts, seed 0) and kept in the
    profile's ``alpha_by_setting`` (acceptance falls with temperature: the greedy prior would
    overrate drafting)."""
    from dataclasses import replace

    if sampling is None or sampling.greedy:
        return profile.alpha0
    key = sampling.key()
    known = profile.alpha_by_setting.get(key)
    if isinstance(known, dict) and isinstance(known.get("alpha0"), (int, float)):
        return float(known["alpha0"])
    if ids is None:
        V = int(target.model.config.vocab_size)
        ids = calibration_ids(target.tokenizer, 256, V)
    a0 = measure_alpha(target, draft, ids, k=4, rounds=4, sampling=replace(sampling, seed=0))
    profile.alpha_by_setting[key] = {"alpha0": round(a0, 5)}
    return a0


def _backend_name(lm) -> str:
    from ..backends import backend_of

    return (getattr(lm, "backend", None) or backend_of(lm.model)).name


def load_or_calibrate(target, draft, cache: Path, k_max: int = 8, force: bool = False,
                      quick: bool = False, progress=None, log=None) -> tuple[CostProfile, bool]:
    """The profile for this machine + pair, calibrating if missing or the fingerprint changed.

    A malformed profile is reported (naming the file) and measured again. Calibration runs under a
    lock per profile: a second process for the same pair waits and then loads what the first saved
    (two calibrations at once would also measure each other's load)."""
    from ..util.filelock import file_lock

    say = log or (lambda m: print(f"[rakv] {m}", file=sys.stderr, flush=True))
    fp = pair_fingerprint(target, draft)
    path = profile_path(cache, fp)
    if not force:
        prof = _usable(path, fp, k_max, say)
        if prof is not None:
            if prof.contended:      # used at once: no probe, no wait before the first token
                say("the saved cost profile was measured on a busy machine; using it now (refined as requests "
                    "run), and measuring it again after a run on a quiet machine (or: rakv calibrate)")
            return prof, False
    with file_lock(path.with_suffix(".lock"),
                   on_wait=lambda: say("another process is calibrating this pair; waiting for its profile ...")):
        if not force:
            again = _usable(path, fp, k_max, lambda m: None)    # saved meanwhile by that process?
            if again is not None and (prof is None or again.calibrated_at != prof.calibrated_at):
                return again, False
        say(f"calibrating costs for this machine, pair, numerics and threads (one time; profile {path.name}) ...")
        meter = Meter()
        busy = busy_now(target)
        if busy:
            say(f"the machine is busy ({busy}): a quick calibration, saved marked contended and measured "
                "again on a later run when the machine is quiet")
            meter.note(f"busy when calibration started: {busy}")
        prof = calibrate(target, draft, k_max=k_max, progress=progress, quick=quick or bool(busy), meter=meter,
                         say=say)
        prof.fingerprint = fp
        if prof.contended:
            say("calibration ran on a busy machine (" + "; ".join(prof.quality.get("reasons", [])) + "): the "
                "profile is saved marked contended, and a later run on a quiet machine measures again")
        try:
            save_profile(prof, path)
        except OSError as e:     # a read-only cache dir: run on the profile in memory
            say(f"cannot save the cost profile to {path} ({e.strerror or e}); using it for this run only")
            prof.read_only = True     # and no save of what this run learns either (warned once)
    return prof, True


def remeasure_if_quiet(prof: CostProfile, target, draft, cache: Path, k_max: int = 8, progress=None,
                       log=None) -> CostProfile | None:
    """After a run that used a profile flagged contended: a short probe of target steps (a second or
    less), and if the machine is quiet now, the calibration again, announced with its estimate and
    saved for the next run. Returns the new profile, or None (not contended, still busy, checks off)."""
    say = log or (lambda m: print(f"[rakv] {m}", file=sys.stderr, flush=True))
    if prof is None or not prof.contended or not check_enabled() or getattr(prof, "read_only", False):
        return None
    probe = quiet_probe(target)
    if not is_quiet(probe):
        say(f"the cost profile stays marked contended (the machine is still busy: CPU share {probe.share:.0%})")
        return None
    say("the machine is quiet now: measuring the contended cost profile again for the next run (Ctrl-C skips)")
    try:
        new, _ = load_or_calibrate(target, draft, cache, k_max=k_max, force=True, progress=progress, log=log)
    except KeyboardInterrupt:
        say("skipped: the contended profile stays")
        return None
    return new


def busy_now(target) -> str | None:
    """Why the machine looks busy right now (a short probe of target steps), or None if quiet.
    A busy machine gets a quick calibration: full repeats would only measure the load, slowly."""
    if not check_enabled():
        return None
    # Another process shows as a low CPU share. A high spread alone is not enough: a shared host
    # can give quiet probes a wide spread at a full CPU share (docs/controller.md).
    for _ in range(2):          # twice: one bad probe on a quiet machine is not enough to say busy
        probe = quiet_probe(target)
        if probe.share >= SHARE_QUIET:
            return None
    return f"CPU share {probe.share:.0%}, spread {probe.spread:.0%}"


def quiet_probe(target, n: int = 8) -> Timing:
    """A short timing of target steps (~n forwards at a short context) to tell a quiet machine."""
    ids = calibration_ids(target.tokenizer, 16 + n + 1, target.vocab_size)
    cache = dec.DynamicCache()
    dec.prefill(target.model, ids[:16], cache)
    it = iter(range(16, 16 + n + 1))
    dec.decode_one(target.model, ids[next(it)], cache)
    return time_reps(lambda: dec.decode_one(target.model, ids[next(it)], cache), n)


def check_profile(prof: CostProfile, target, draft, reps: int = 5) -> tuple[list[dict], float]:
    """A few quick terms measured now (target step, V(4), prefill of 32, the draft's step) against
    what the profile predicts (with its learned scales); also the CPU share seen now."""
    ctx = prof.V_ctx
    ids = calibration_ids(target.tokenizer, ctx + 48, target.vocab_size)
    model, meter = target.model, Meter(check=False)
    dmodel = draft.lm.model if draft.has_model else None
    dec.prefill(model, ids[:16], dec.DynamicCache())      # warm-up
    rows = []

    def row(term, predicted, timing):
        t = meter.measure(term, timing)
        rows.append({"term": term, "profile_ms": round(predicted, 3), "now_ms": round(t.value, 3),
                     "ratio": round(t.value / predicted, 3) if predicted > 0 else float("nan"),
                     "spread": round(t.spread, 3)})

    def pf():
        return time_reps(lambda: dec.prefill(model, ids[:32], dec.DynamicCache()), reps)

    def at_ctx(m, n_tok):
        cache = dec.DynamicCache()
        dec.prefill(m, ids[:ctx], cache)
        fwd = dec.decode_one if n_tok == 1 else (lambda mm, _t, c: dec.verify(mm, ids[ctx: ctx + n_tok], c))

        def once():
            fwd(m, ids[ctx], cache)
            dec.rollback(cache, n_tok)
        once()
        return time_reps(once, reps)

    row("step@%d" % ctx, prof.step(ctx), lambda: at_ctx(model, 1))
    row("V(4)@%d" % ctx, prof.verify(4, ctx), lambda: at_ctx(model, 5))
    row("prefill 32", prof.T(32), pf)
    if dmodel is not None and prof.d:
        row("draft step@%d" % ctx, prof.draft_step(ctx), lambda: at_ctx(dmodel, 1))
    return rows, meter.quality()["cpu_share"]


def text_progress(prefix: str = "calibrate"):
    """A one-line progress bar on stderr."""
    def show(frac: float, what: str):
        w = 30
        n = int(frac * w)
        sys.stderr.write(f"\r[rakv] {prefix} [{'#' * n}{'.' * (w - n)}] {frac * 100:5.1f}% {what:<24}")
        if frac >= 1.0:
            sys.stderr.write("\n")
        sys.stderr.flush()
    return show

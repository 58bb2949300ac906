"""The engine: one request = lookup -> decide (r, k) -> prefill -> rounds -> end.

It owns the target, the draft source, the prefix cache and the controller, and reports every
step through ``callback(record)`` with the plain-Python records of ``rakv.records``. Controls
(budget, K, policy, granularity, force) may be changed from another thread between decisions;
``stop()`` ends the running request within one round.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import asdict, dataclass, field

import torch

from . import decoding as dec
from .device import clock, hardware_info, versions_info
from .config import Policy, RakvConfig
from .controller import AlphaEWMA, Choice, Controller, Situation
from .costs import CostProfile
from .drafts import MAX_MATCH, DraftSource, ModelDraft, NgramDraft, NoDraft, history_match, prefill_with_reuse
from .gate import LOOKUP_ALPHA, AcceptMap, RoundGate, Trusted, judged, request_trust
from .models import LoadedModel, model_info
from .prefix_cache import PrefixCache
from .prompts import EncodedPrompt, encode_prompt
from .records import CacheLookup, Candidate, Decision, RequestEnd, RequestStart, Round, RunHeader

now = clock          # synchronizes CUDA / MPS before reading the time


class EngineError(ValueError):
    """Bad input to the engine (empty prompt, too long, ...); the message is one clear line."""


@dataclass
class _Request:
    """One request's state while it runs (the phases below pass it along)."""

    rid: int
    ids: list[int]
    N: int
    policy: Policy
    k_set: tuple
    force: tuple | None
    budget: int
    has_draft: bool
    draft_model: bool
    reuse: int = 0
    k: int = 0
    per_round: bool = False
    t0: float = 0.0
    ttft: float = 0.0
    pf: object = None
    cache: object = None
    out: list[int] = field(default_factory=list)
    stopped: str = ""
    drafted: int = 0
    accepted: int = 0
    lk_hits: float = 0.0         # this request's judged lookup tokens: accepted, and the pooled map's prediction
    lk_pred: float = 0.0
    rounds: int = 0
    forward_ms: float = 0.0
    book_ms: float = 0.0
    explore_ms: float = 0.0


def learned_state(p: CostProfile) -> dict:
    """The state a profile carries from earlier sessions, beside what calibration measured: it
    starts the controller, so it is shown (run header, CLI log) and bounded (evidence capped,
    online scales clipped per measurement)."""
    return {"alpha0": p.alpha0, "alpha_learned": p.alpha_learned, "alpha_trials": p.alpha_trials,
            "out_frac": p.out_frac, "scale": {k: round(v, 3) for k, v in sorted(p.scale.items())}}


def verify_accept(model, cache, pending: int, drafts: list[int]) -> tuple[list[int], int]:
    """Verify [pending, d_1..d_k] in one forward; accept a drafts + one target token; roll back."""
    logits = dec.verify(model, [pending] + drafts, cache)      # [k+1, V]
    pred = torch.argmax(logits, dim=-1).tolist()
    a = dec.accept(drafts, pred)
    dec.rollback(cache, len(drafts) - a)
    return drafts[:a] + [pred[a]], a


def gate_k_max(k: int, rq: "_Request", remaining: int, k_top: int) -> int:
    """With the gate, a drafting round may go to k_top (the largest k of K; lookup_k for an n-gram
    draft, which drafts for free): the gate, not an average acceptance, decides where each round
    stops (probes and fixed policies keep their k)."""
    if rq.policy.gate and rq.k > 0 and k == min(rq.k, remaining - 1):
        return max(k, min(k_top, remaining - 1))
    return k


def use_lookup(tokens: list[int], lookup: RoundGate | None, model: RoundGate, alpha: float) -> bool:
    """A gated drafting round takes the n-gram lookup instead of the model draft when the lookup's
    tokens per ms (nothing to draft: C_j = V(j)) beat what the model draft can expect at alpha."""
    return bool(tokens) and lookup.rate(len(tokens)) >= model.expected_rate(alpha)


def cut_at_eos(emitted: list[int], prov: list[str], eos, remaining: int):
    """EOS inside the accepted run ends the output there; never exceed ``remaining``."""
    cut, hit = len(emitted), False
    for i, tok in enumerate(emitted):
        if tok in eos:
            cut, hit = i + 1, True
            break
    cut = min(cut, remaining)
    return emitted[:cut], prov[:cut], hit


class Engine:
    def __init__(self, target: LoadedModel, draft: DraftSource | None, config: RakvConfig = RakvConfig(),
                 callback=None, profile: CostProfile | None = None):
        self.target = target
        self.draft = draft or NoDraft()
        self.config = config
        self.callback = callback or (lambda rec: None)
        self.store = PrefixCache(config.budget_bytes, config.bucket_tokens, config.history_tokens)
        self.policy = Policy.parse(config.policy)
        self.k_set = tuple(config.k_set)
        self.granularity = config.granularity
        self.force = config.force_action
        self.chat_template = config.chat_template
        self.profile = profile
        self.controller = Controller(profile, self.k_set, config.alpha_decay, config.probe_every,
                                     config.alpha_prior, explore_share=config.explore_share) if profile is not None else None
        self.alpha = self.controller.alpha if self.controller else AlphaEWMA(
            config.alpha_prior if config.alpha_prior is not None else 0.5, config.alpha_decay)
        if self.policy.adaptive and self.controller is None:
            raise EngineError("the adaptive policy needs a cost profile (run calibration)")
        # draft confidence -> chance of acceptance, for the gate (prior: the calibration's counts)
        self.accept_map = AcceptMap(self.alpha.value, profile.accept_map if profile is not None else None)
        # the n-gram side draft of k = 0 rounds under the gate (its own map unless it is the draft)
        self.lookup = self.draft if isinstance(self.draft, NgramDraft) else NgramDraft()
        self.lookup_map = self.accept_map if self.lookup is self.draft else AcceptMap(LOOKUP_ALPHA)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._next_id = 0
        self._running = False
        self._pending_budget: int | None = None
        self._open_request: int | None = None
        self.decide_ms_total = 0.0
        self.t0 = now()

    # ------------------------------------------------------------------ controls (any thread)
    def set_budget_mib(self, mib: float) -> None:
        """Safe from any thread: applied now when idle, else at the next request's decision."""
        if not math.isfinite(mib) or mib < 0:
            raise EngineError("budget must be a finite number >= 0")
        with self._lock:
            self._pending_budget = int(mib * 1024 * 1024)
            if not self._running:
                self._apply_budget()

    def _apply_budget(self) -> None:   # caller holds the lock
        if self._pending_budget is not None:
            self.store.set_budget(self._pending_budget)
            self._pending_budget = None

    def set_k_set(self, ks) -> None:
        ks = tuple(sorted({int(k) for k in ks}))
        if not ks or any(k < 0 for k in ks):
            raise EngineError("K must be a non-empty set of k >= 0")
        with self._lock:
            self.k_set = ks

    def set_policy(self, text: str) -> None:
        p = Policy.parse(text)
        if p.adaptive and self.controller is None:
            raise EngineError("the adaptive policy needs a cost profile (run calibration)")
        with self._lock:
            self.policy = p

    def set_granularity(self, g: str) -> None:
        if g not in ("request", "round"):
            raise EngineError("granularity is 'request' or 'round'")
        self.granularity = g

    def set_force(self, action: tuple[int, int] | None) -> None:
        self.force = action

    def set_chat_template(self, on: bool) -> None:
        """Apply the chat template to the next text prompts (False: raw text)."""
        self.chat_template = bool(on)

    def stop(self) -> None:
        self._stop.set()

    # ------------------------------------------------------------------ records
    def _emit(self, rec) -> None:
        rec.t = round(now() - self.t0, 6)
        self.callback(rec)

    def header(self) -> RunHeader:
        c = self.config
        h = RunHeader(target=model_info(self.target),
                      draft={"name": self.draft.name, "key": self.draft.key, "has_model": self.draft.has_model},
                      dtype=str(next(self.target.model.parameters()).dtype).replace("torch.", ""),
                      device=c.device, threads=torch.get_num_threads(), hardware=hardware_info(),
                      versions=versions_info(), settings=asdict(c),
                      started=time.strftime("%Y-%m-%dT%H:%M:%S"),
                      learned=learned_state(self.profile) if self.profile is not None else {})
        self._emit(h)
        return h

    # ------------------------------------------------------------------ tokenization
    def encode(self, prompt) -> list[int]:
        return self.encode_prompt(prompt).ids

    def encode_prompt(self, prompt) -> EncodedPrompt:
        """Text -> ids through ``rakv.prompts`` (chat template unless raw); ids pass through."""
        if isinstance(prompt, EncodedPrompt):        # built by the caller (a conversation's turn)
            enc = prompt
        elif isinstance(prompt, str):
            if not prompt.strip():
                raise EngineError("empty prompt")
            tok = self.target.tokenizer
            if tok is None:
                raise EngineError("this target has no tokenizer: pass token ids")
            enc = encode_prompt(tok, prompt, raw=not self.chat_template)
        else:
            enc = EncodedPrompt([int(x) for x in prompt], False, 0)
        ids = enc.ids
        if not ids:
            raise EngineError("empty prompt")
        V = int(self.target.model.config.vocab_size)
        if min(ids) < 0 or max(ids) >= V:
            raise EngineError(f"token id out of range [0, {V})")
        return enc

    def decode_text(self, ids: list[int]) -> str:
        tok = self.target.tokenizer
        return tok.decode(ids, skip_special_tokens=True) if tok is not None else ""

    # ------------------------------------------------------------------ one request
    def generate(self, prompt, max_new_tokens: int | None = None, prompt_text: str | None = None) -> RequestEnd:
        """Run one request. A ``stop()`` issued before or during it ends it (within one round);
        an exception after the request started still emits a RequestEnd with stopped="error"."""
        with self._lock:
            self._running = True
            self._apply_budget()
        try:
            return self._generate(prompt, max_new_tokens, prompt_text)
        except Exception as e:
            if self._open_request is not None:
                self._emit(RequestEnd(request_id=self._open_request, stopped="error",
                                      text=f"{type(e).__name__}: {e}"))
            raise
        finally:
            self._open_request = None
            self._stop.clear()
            with self._lock:
                self._running = False
                self._apply_budget()

    def _generate(self, prompt, max_new_tokens, prompt_text) -> RequestEnd:
        rq = self._start(prompt, max_new_tokens, prompt_text)
        choice = self._decide(rq)
        self._prefill(rq)
        try:
            while not rq.stopped:
                self._round(rq)
        finally:
            self.draft.end()
            self.lookup.end()
        if rq.reuse:       # what this request generated, for later requests' n-gram lookups
            self.store.history.add(rq.ids + rq.out)
        if rq.reuse and getattr(prompt, "keep_answer", False):
            self._store_answer(rq)
        return self._finish(rq, choice)

    # ---- phases of one request (each reports its own records)
    def _start(self, prompt, max_new_tokens, prompt_text) -> "_Request":
        """Validate, tokenize, snapshot the controls, emit RequestStart."""
        N = self.config.max_new_tokens if max_new_tokens is None else int(max_new_tokens)
        if N < 1:
            raise EngineError("max_new_tokens must be >= 1")
        enc = self.encode_prompt(prompt)
        ids = enc.ids
        P = len(ids)
        maxpos = self.target.max_positions
        if maxpos is not None and P + N > maxpos:
            raise EngineError(f"prompt ({P} tokens) + max_new_tokens ({N}) exceeds the model's context of {maxpos}")
        with self._lock:
            policy, k_set, force, budget = self.policy, self.k_set, self.force, self.store.budget
        rq = _Request(rid=self._next_id, ids=ids, N=N, policy=policy, k_set=k_set, force=force, budget=budget,
                      has_draft=not isinstance(self.draft, NoDraft), draft_model=isinstance(self.draft, ModelDraft))
        self._next_id += 1
        self._open_request = rq.rid
        text = prompt if isinstance(prompt, str) else (prompt_text or "")
        self._emit(RequestStart(request_id=rq.rid, prompt=text, prompt_ids=ids, prompt_tokens=P,
                                max_new_tokens=N, policy=policy.name, templated=enc.templated,
                                template_prefix=enc.template_prefix, conversation=enc.conversation))
        rq.t0 = now()
        return rq

    def _decide(self, rq: "_Request") -> Choice | None:
        """The per-request action (r, k): the controller's argmin, or the fixed policy's."""
        policy, ctl = rq.policy, self.controller
        choice = None
        if ctl is not None:
            s = self._situation(rq.ids, rq.N, rq.budget, rq.has_draft, rq.draft_model, peek=policy.adaptive)
            if policy.adaptive:
                choice = ctl.decide(s, rq.k_set, rq.force)
            else:
                r, k = int(policy.reuse), policy.k
                c = round(ctl.cost(s, r, k, self.alpha.value), 3)
                ok, why = ctl.feasible(s, r, k)
                stars = {str(k): ctl.alpha_star(s, r, k)} if k > 0 else {}
                choice = Choice(r, k, c, [Candidate(r, k, c, ok, why)], self.alpha.value, stars, "fixed")
            rq.reuse, rq.k = choice.reuse, choice.k
            self._emit(Decision(request_id=rq.rid, candidates=[asdict(c) for c in choice.candidates],
                                action={"reuse": rq.reuse, "k": rq.k}, alpha=choice.alpha,
                                alpha_star=choice.alpha_star, reason=choice.reason, decide_ms=choice.decide_ms,
                                explore_balance_ms=round(ctl.explore_balance, 3), copy=choice.copy))
        else:
            rq.reuse, rq.k = int(policy.reuse), policy.k
            self._emit(Decision(request_id=rq.rid, candidates=[asdict(Candidate(rq.reuse, rq.k, 0.0))],
                                action={"reuse": rq.reuse, "k": rq.k}, alpha=self.alpha.value, reason="fixed"))
        if rq.k > 0 and not rq.has_draft:
            raise EngineError(f"k={rq.k} needs a draft (--draft is 'none')")
        rq.per_round = policy.adaptive and self.granularity == "round" and rq.force is None
        self._last_k = rq.k
        return choice

    def _prefill(self, rq: "_Request") -> None:
        """Target prompt KV (through the prefix cache when r = 1) and the first token."""
        P = len(rq.ids)
        pf = prefill_with_reuse(self.target, rq.ids, self.store if rq.reuse else None)
        t1 = dec.argmax(pf.logits)
        rq.ttft = (now() - rq.t0) * 1e3
        self._emit_lookup(rq.rid, "target", pf.hit, P, pf.stored, pf.lookup_ms, pf.forward_ms)
        if self.profile is not None and pf.forward_ms > 0:
            self.profile.observe("T", self.profile.T(P - pf.hit.usable), pf.forward_ms)
        if self.controller is not None:
            self.controller.earn(rq.ttft)
        rq.pf, rq.cache, rq.out = pf, pf.cache, [t1]
        rq.forward_ms = pf.forward_ms
        self._emit(Round(request_id=rq.rid, index=0, kind="prefill", emitted=[t1],
                         provenance=["stored" if pf.hit.exact else "target"], verify_ms=round(pf.forward_ms, 3),
                         round_ms=round(rq.ttft, 3), context=P, alpha=self.alpha.value))
        self.draft.begin(rq.ids, self.store, bool(rq.reuse))
        if self.lookup is not self.draft:
            self.lookup.begin(rq.ids, self.store, bool(rq.reuse))
        rq.stopped = "eos" if t1 in self.target.eos_ids else ""
        self._check_end(rq)

    def _check_end(self, rq: "_Request") -> None:
        if not rq.stopped and len(rq.out) >= rq.N:
            rq.stopped = "max_new_tokens"
        if not rq.stopped and self._stop.is_set():
            rq.stopped = "stop"

    def _round_k(self, rq: "_Request", seq: list[int], remaining: int) -> int:
        """This round's k: the request's, a per-round decision, or a priced probe at k = 0."""
        if rq.per_round:
            return self._decide_round(rq.rid, rq.rounds + 1, rq.reuse, seq, remaining, rq.draft_model, rq.has_draft)
        if not (rq.policy.adaptive and rq.k == 0 and rq.has_draft):
            return rq.k
        td = now()
        ctl = self.controller
        if not ctl.probe_possible(len(seq), remaining, rq.k_set):
            return 0
        behind = self._draft_behind(seq, rq.reuse, rq.draft_model)
        k = ctl.maybe_probe(len(seq), remaining, rq.k_set, behind, rq.draft_model)
        if k:
            self._emit(Decision(request_id=rq.rid, round=rq.rounds + 1, action={"reuse": int(rq.reuse), "k": k},
                                alpha=self.alpha.value, reason="probe",
                                alpha_star=ctl.round_alpha_star(len(seq), rq.k_set),
                                decide_ms=round((now() - td) * 1e3, 4),
                                explore_cost_ms=round(ctl.probe_predicted_ms, 3),
                                explore_balance_ms=round(ctl.explore_balance, 3)))
        return k

    def _gate(self, rq: "_Request", seq: list[int], k: int) -> RoundGate | None:
        """The round's confidence gate (policy adaptive:gate and a cost profile), else None."""
        p = self.profile
        if not (rq.policy.gate and p is not None and k > 0):
            return None
        ctx = len(seq)
        behind = self._draft_behind(seq, rq.reuse, rq.draft_model)
        amap = self.accept_map
        if self.lookup is self.draft:      # an n-gram draft: this request's judged copies scale the map
            amap = Trusted(amap, request_trust(rq.lk_hits, rq.lk_pred))
        return RoundGate(amap, k, p.draft_step(ctx) if rq.draft_model else 0.0, self._V(ctx, k),
                         sunk=self.controller.catchup_ms(behind, rq.draft_model, ctx))

    def _k_top(self, rq: "_Request", source) -> int:
        """The longest draft a gated round may verify: max(K), or lookup_k for n-gram lookup."""
        top = max(rq.k_set)
        return max(top, self.config.lookup_k) if isinstance(source, NgramDraft) else top

    def _V(self, ctx: int, k: int) -> list[float]:
        """V(j) for j = 0..k at context ctx (V(0) = t: a plain step), as the gate reads them."""
        return [self.profile.step(ctx)] + [self.profile.verify(j, ctx) for j in range(1, k + 1)]

    def _lookup(self, rq: "_Request", seq: list[int], remaining: int) -> tuple[list[int], float, RoundGate | None]:
        """A k = 0 round under the gate: the n-gram continuation costs ~nothing to look up, so verify
        the part of it whose expected tokens per ms beat a plain step (often none)."""
        p = self.profile
        k_max = min(self._k_top(rq, self.lookup), remaining - 1)
        if not (rq.policy.gate and p is not None and rq.force is None and k_max >= 1):
            return [], 0.0, None
        gate = RoundGate(Trusted(self.lookup_map, request_trust(rq.lk_hits, rq.lk_pred)), k_max, 0.0,
                         self._V(len(seq), k_max))
        prop = self.lookup.propose(seq, k_max, gate)
        if not prop.tokens:
            return [], prop.ms, None
        return prop.tokens[: gate.verify_length(len(prop.tokens))], prop.ms, gate

    def _draft(self, rq: "_Request", seq: list[int], k: int, gate: RoundGate | None = None):
        """Draft up to k tokens (a model draft first catches up); reports the draft's prompt lookup."""
        prop = self.draft.propose(seq, k, gate)
        if prop.prefill is not None:
            h = prop.prefill
            self._emit_lookup(rq.rid, "draft", h.hit, len(rq.ids), h.stored, h.lookup_ms, h.ms)
            if self.profile is not None and h.ms > 0:     # the draft's prompt prefill, as paid in a request
                self.profile.observe("D", self.profile.D(len(rq.ids) - h.hit.usable), h.ms)
        return prop

    def _round(self, rq: "_Request") -> None:
        """One round: k = 0 is a plain step; k > 0 drafts, verifies k+1 tokens, accepts, rolls back."""
        t_round = now()
        seq = rq.ids + rq.out
        remaining = rq.N - len(rq.out)
        k = min(self._round_k(rq, seq, remaining), remaining - 1)
        drafts: list[int] = []
        draft_ms = catch_ms = 0.0
        catch_tok = fed = n_fwd = 0
        fwd_ms = 0.0                # the draft's forwards of this round alone (no prompt prefill)
        gate = self._gate(rq, seq, gate_k_max(k, rq, remaining, self._k_top(rq, self.draft))) if k > 0 else None
        lookup = k == 0 and rq.policy.gate
        # (a probe keeps the model draft: it is there to measure the model draft's acceptance)
        if lookup or (gate is not None and rq.k > 0 and self.lookup is not self.draft):
            lk, lk_ms, lk_gate = self._lookup(rq, seq, remaining)
            lookup = lookup or use_lookup(lk, lk_gate, gate, self.alpha.value)
            if lookup:
                drafts, draft_ms, gate = lk, lk_ms, lk_gate
        if k > 0 and not lookup:
            prop = self._draft(rq, seq, gate.k_max if gate else k, gate)
            drafts, draft_ms, catch_tok, catch_ms = prop.tokens, prop.ms, prop.catchup_tokens, prop.catchup_ms
            fed, n_fwd, fwd_ms = prop.fed, len(prop.tokens), prop.forward_ms
        proposed = bool(drafts) and not lookup
        if gate is not None and drafts and not lookup:
            drafts = drafts[: gate.verify_length(len(drafts))]
        tv = now()
        if drafts:
            emitted, a = verify_accept(self.target.model, rq.cache, seq[-1], drafts)
            prov = ["draft"] * a + ["target"]
        else:
            emitted, a = [dec.argmax(dec.decode_one(self.target.model, seq[-1], rq.cache))], 0
            prov = ["target"]
        verify_ms = (now() - tv) * 1e3
        emitted, prov, eos = cut_at_eos(emitted, prov, self.target.eos_ids, remaining)
        rq.out.extend(emitted)
        if eos:
            rq.stopped = "eos"
        if proposed:
            self.draft.commit(rq.ids + rq.out)
        m = len(drafts)
        if gate is not None and m:
            if lookup or self.lookup is self.draft:      # n-gram copies: the request's trust in them
                for c, ok in judged(gate.confs, m, a):
                    rq.lk_pred += self.lookup_map.p(c)
                    rq.lk_hits += ok
            (self.lookup_map if lookup else self.accept_map).observe(gate.confs[:m], gate.preds[:m], a)
        if not lookup:           # a request's drafted / accepted count the model draft's rounds
            rq.drafted += m
            rq.accepted += a
        rq.rounds += 1
        round_ms = (now() - t_round) * 1e3
        explore = 0.0
        if self.controller is not None:
            # a lookup's acceptance is not the model draft's alpha: the controller sees a k = 0 round
            explore = self.controller.observe_round(0 if lookup else m, a, round_ms, len(emitted), len(seq))
            self._observe_costs("spec" if drafts else "ar", m, len(seq), verify_ms, fwd_ms, catch_tok,
                                rq.draft_model and not lookup, fed, n_fwd)
        else:
            self.alpha.update(a, m)
        rq.explore_ms += explore
        fwd = verify_ms + (draft_ms if rq.draft_model else 0.0)
        rq.forward_ms += fwd
        rq.book_ms += max(0.0, round_ms - fwd)
        self._emit(Round(request_id=rq.rid, index=rq.rounds, kind="spec" if drafts else "ar", k=k, drafted=m,
                         accepted=a, emitted=emitted, provenance=prov, draft_ms=round(draft_ms, 3),
                         verify_ms=round(verify_ms, 3), catchup_tokens=catch_tok, catchup_ms=round(catch_ms, 3),
                         round_ms=round(round_ms, 3), context=len(seq), alpha=round(self.alpha.value, 5),
                         explore_ms=round(explore, 3),
                         draft_conf=[round(c, 4) for c in gate.confs] if gate else [],
                         draft_pred=[round(c, 4) for c in gate.preds] if gate else [],
                         draft_stop=gate.stop if gate else "",
                         draft_source="lookup" if lookup and gate else ""))
        self._check_end(rq)

    def _finish(self, rq: "_Request", choice: Choice | None) -> RequestEnd:
        latency = (now() - rq.t0) * 1e3
        out, pf = rq.out, rq.pf
        end = RequestEnd(request_id=rq.rid, output_ids=out, text=self.decode_text(out), prompt_tokens=len(rq.ids),
                         hit_tokens=pf.hit.q if rq.reuse else 0, exact_repeat=bool(pf.hit.exact),
                         action={"reuse": int(rq.reuse), "k": int(rq.k)}, latency_ms=round(latency, 3),
                         ttft_ms=round(rq.ttft, 3),
                         tokens_per_s=round(len(out) / (latency / 1e3), 3) if latency else 0.0,
                         drafted=rq.drafted, accepted=rq.accepted, rounds=rq.rounds,
                         alpha_ewma=round(self.alpha.value, 5),
                         predicted_ms=None if choice is None else choice.predicted_ms,
                         stopped=rq.stopped, forward_ms=round(rq.forward_ms, 3), bookkeeping_ms=round(rq.book_ms, 3),
                         explore_ms=round(rq.explore_ms, 3))
        if self.controller is not None:
            self.controller.end_request(len(out), rq.N, rq.stopped)
        self._open_request = None
        self._emit(end)
        return end

    # ------------------------------------------------------------------ conversations (rakv.chat)
    def _store_answer(self, rq: "_Request") -> None:
        """A conversation's turn: store the KV of prompt + answer, so the next turn (these ids, then
        the new message) hits all of them. The request's cache holds every position but the last
        token's (pending): one step feeds it; its logits are stored as the next-token logits."""
        ids = rq.ids + rq.out
        t0 = now()
        dec.crop_to(rq.cache, len(ids) - 1)         # drafts accepted past an EOS are not the answer
        logits = dec.decode_one(self.target.model, rq.out[-1], rq.cache)
        if dec.kv_nbytes(rq.cache, len(ids)) + logits.numel() * logits.element_size() <= self.store.budget:
            self.store.store(self.target.key, ids, dec.kv_of(rq.cache, len(ids)), logits.clone())
        rq.forward_ms += (now() - t0) * 1e3

    def _emit_lookup(self, rid, model, hit, P, stored, lookup_ms, prefill_ms) -> None:
        st = self.store.stats
        self._emit(CacheLookup(request_id=rid, model=model, bucket=hit.bucket, hit_tokens=hit.q,
                               reused_tokens=hit.usable, exact_repeat=hit.exact, prompt_tokens=P,
                               bytes_used=st.bytes_used, budget=st.budget, entries=st.entries,
                               evictions=st.evictions, stored=stored, lookup_ms=round(lookup_ms, 4),
                               prefill_ms=round(prefill_ms, 3)))

    # ------------------------------------------------------------------ helpers
    def _situation(self, ids, N, budget, has_draft, draft_model, peek: bool) -> Situation:
        P = len(ids)
        q = qd = 0
        exact = exact_d = False
        if peek:
            h = self.store.peek(self.target.key, ids)
            q, exact = h.q, h.exact
            if draft_model:
                hd = self.store.peek(self.draft.key, ids)
                qd, exact_d = hd.q, hd.q == P
        V = int(self.target.model.config.vocab_size)
        copy = peek and exact and isinstance(self.draft, NgramDraft) and self._copies_whole(ids, N)
        entry = P * self.target.kv_bytes_per_token() + 4 * V
        dentry = P * self.draft.lm.kv_bytes_per_token() if draft_model else 0
        return Situation(P=P, N=N, q=q, exact=exact, qd=qd, exact_d=exact_d, entry_bytes=entry,
                         draft_entry_bytes=dentry, budget=budget, has_draft=has_draft, draft_model=draft_model,
                         copy=copy)

    def _copies_whole(self, ids, N: int) -> bool:
        """Does the history hold an earlier output of exactly this prompt, N tokens or up to EOS?"""
        h = self.store.history
        if not len(h):
            return False
        follow, m = history_match(ids, N, self.draft.sizes, h.tokens)
        return m >= min(len(ids), MAX_MATCH) and bool(follow) and (
            len(follow) >= N or follow[-1] in self.target.eos_ids)

    def _draft_behind(self, seq, reuse, draft_model) -> int:
        """Tokens a model draft must read before it can draft after ``seq`` (its catch-up)."""
        if not draft_model:
            return 0
        if self.draft.cache is not None:
            return len(seq) - len(self.draft.cached)
        # the draft has not seen the prompt yet: its prefill (minus a cached prefix) is due
        hd = self.store.peek(self.draft.key, self.draft.prompt) if (reuse and self.draft.reuse) else None
        return len(seq) - (hd.usable if hd is not None else 0)

    def _decide_round(self, rid, index, reuse, seq, remaining, draft_model, has_draft) -> int:
        with self._lock:
            ks_now = self.k_set
        behind = self._draft_behind(seq, reuse, draft_model)
        td = now()
        k_new, reason, costs = self.controller.decide_round(len(seq), remaining, ks_now, behind,
                                                            has_draft, draft_model)
        dms = (now() - td) * 1e3
        self.decide_ms_total += dms
        if reason == "probe" or k_new != self._last_k:
            self._emit(Decision(request_id=rid, round=index,
                                candidates=[asdict(Candidate(int(reuse), kk, round(v * remaining, 3)))
                                            for kk, v in costs.items()],
                                action={"reuse": int(reuse), "k": k_new}, alpha=self.alpha.value,
                                alpha_star=self.controller.round_alpha_star(len(seq), ks_now),
                                reason=reason, decide_ms=round(dms, 4)))
        self._last_k = k_new
        return k_new

    def _observe_costs(self, kind, m, ctx, verify_ms, draft_ms, catch_tok, draft_model, fed=1, n_fwd=0) -> None:
        """Refine the profile from one round: t from a plain step; a speculative round of m as one
        term R{m}, its draft forwards (``draft_ms``: ``n_fwd`` of them, the first reading ``fed`` =
        1 or 2 tokens, the prompt's prefill left out) and verify together. A model draft's round
        that caught up first is not a round of m: skipped."""
        p = self.profile
        if kind == "ar":
            p.observe("t", p.step(ctx), verify_ms)
        elif not draft_model:
            p.observe(f"R{m}", p.verify(m, ctx), verify_ms)
        elif catch_tok == 0 and n_fwd > 0:
            p.observe(f"R{m}", p.round_forwards(m, ctx, n_fwd, fed), draft_ms + verify_ms)


def make_draft(spec: str, target: LoadedModel, config: RakvConfig) -> DraftSource:
    """--draft: a model (hub id / dir / .gguf), 'int8', 'layers:L', 'ngram' or 'none'."""
    from .models import check_same_tokenizer, int8_copy, layers_copy, load_model

    s = (spec or "none").strip()
    if s == "none":
        return NoDraft()
    if s == "ngram":
        return NgramDraft(config.ngram_sizes)
    if s == "int8":
        return ModelDraft(int8_copy(target))
    if s.startswith("layers:"):
        try:
            L = int(s.split(":", 1)[1])
        except ValueError:
            raise EngineError(f"bad --draft {s!r}: expected layers:L with an integer L") from None
        return ModelDraft(layers_copy(target, L))
    lm = load_model(s, config.dtype, None, config.device, fast=config.fast)
    check_same_tokenizer(target, lm)
    return ModelDraft(lm)

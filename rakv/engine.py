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
from dataclasses import asdict

import torch

from . import decoding as dec
from .config import Policy, RakvConfig
from .controller import AlphaEWMA, Choice, Controller, Situation
from .costs import CostProfile
from .drafts import DraftSource, ModelDraft, NgramDraft, NoDraft, prefill_with_reuse
from .models import LoadedModel, model_info
from .prefix_cache import PrefixCache
from .prompts import EncodedPrompt, encode_prompt
from .records import (CacheLookup, Candidate, Decision, RequestEnd, RequestStart, Round, RunHeader,
                      hardware_info, versions_info)

now = time.perf_counter


class EngineError(ValueError):
    """Bad input to the engine (empty prompt, too long, ...); the message is one clear line."""


class Engine:
    def __init__(self, target: LoadedModel, draft: DraftSource | None, config: RakvConfig = RakvConfig(),
                 callback=None, profile: CostProfile | None = None):
        self.target = target
        self.draft = draft or NoDraft()
        self.config = config
        self.callback = callback or (lambda rec: None)
        self.store = PrefixCache(config.budget_bytes, config.bucket_tokens)
        self.policy = Policy.parse(config.policy)
        self.k_set = tuple(config.k_set)
        self.granularity = config.granularity
        self.force = config.force_action
        self.chat_template = config.chat_template
        self.profile = profile
        self.controller = Controller(profile, self.k_set, config.alpha_decay, config.probe_every,
                                     config.alpha_prior) if profile is not None else None
        self.alpha = self.controller.alpha if self.controller else AlphaEWMA(
            config.alpha_prior if config.alpha_prior is not None else 0.5, config.alpha_decay)
        if self.policy.adaptive and self.controller is None:
            raise EngineError("the adaptive policy needs a cost profile (run calibration)")
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
                      started=time.strftime("%Y-%m-%dT%H:%M:%S"))
        self._emit(h)
        return h

    # ------------------------------------------------------------------ tokenization
    def encode(self, prompt) -> list[int]:
        return self.encode_prompt(prompt).ids

    def encode_prompt(self, prompt) -> EncodedPrompt:
        """Text -> ids through ``rakv.prompts`` (chat template unless raw); ids pass through."""
        if isinstance(prompt, str):
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
        rid = self._next_id
        self._next_id += 1
        text = prompt if isinstance(prompt, str) else (prompt_text or "")
        self._open_request = rid
        self._emit(RequestStart(request_id=rid, prompt=text, prompt_ids=ids, prompt_tokens=P,
                                max_new_tokens=N, policy=policy.name, templated=enc.templated,
                                template_prefix=enc.template_prefix))
        t_req = now()
        has_draft = not isinstance(self.draft, NoDraft)
        draft_model = isinstance(self.draft, ModelDraft)

        # ---- decide (r, k)
        choice = None
        if policy.adaptive or self.controller is not None:
            s = self._situation(ids, N, budget, has_draft, draft_model, peek=policy.adaptive)
            if policy.adaptive:
                choice = self.controller.decide(s, k_set, force)
            else:
                r, k = int(policy.reuse), policy.k
                c = round(self.controller.cost(s, r, k, self.alpha.value), 3)
                ok, why = self.controller.feasible(s, r, k)
                stars = {str(k): self.controller.alpha_star(s, r, k)} if k > 0 else {}
                choice = Choice(r, k, c, [Candidate(r, k, c, ok, why)], self.alpha.value, stars, "fixed")
            reuse, k = choice.reuse, choice.k
            self._emit(Decision(request_id=rid, candidates=[asdict(c) for c in choice.candidates],
                                action={"reuse": reuse, "k": k}, alpha=choice.alpha,
                                alpha_star=choice.alpha_star, reason=choice.reason,
                                decide_ms=choice.decide_ms))
        else:
            reuse, k = int(policy.reuse), policy.k
            self._emit(Decision(request_id=rid, candidates=[asdict(Candidate(reuse, k, 0.0))],
                                action={"reuse": reuse, "k": k}, alpha=self.alpha.value, reason="fixed"))
        if k > 0 and not has_draft:
            raise EngineError(f"k={k} needs a draft (--draft is 'none')")

        # ---- prefill (target), first token
        store = self.store if reuse else None
        pf = prefill_with_reuse(self.target, ids, store)
        t1 = dec.argmax(pf.logits)
        ttft = (now() - t_req) * 1e3
        st = self.store.stats
        self._emit(CacheLookup(request_id=rid, model="target", bucket=pf.hit.bucket, hit_tokens=pf.hit.q,
                               reused_tokens=pf.hit.usable, exact_repeat=pf.hit.exact, prompt_tokens=P,
                               bytes_used=st.bytes_used, budget=st.budget, entries=st.entries,
                               evictions=st.evictions, stored=pf.stored, lookup_ms=round(pf.lookup_ms, 4),
                               prefill_ms=round(pf.forward_ms, 3)))
        if self.profile is not None and pf.forward_ms > 0:
            self.profile.observe("T", self.profile.T(P - pf.hit.usable), pf.forward_ms)
        out = [t1]
        self._emit(Round(request_id=rid, index=0, kind="prefill", emitted=[t1],
                         provenance=["stored" if pf.hit.exact else "target"], verify_ms=round(pf.forward_ms, 3),
                         round_ms=round(ttft, 3), context=P, alpha=self.alpha.value))
        cache = pf.cache
        self.draft.begin(ids, self.store, bool(reuse))
        eos = self.target.eos_ids
        drafted_total = accepted_total = rounds = 0
        forward_ms = pf.forward_ms
        book_ms = 0.0
        stopped = "eos" if t1 in eos else ""
        per_round = policy.adaptive and self.granularity == "round" and force is None
        self._last_k = k
        try:
            while not stopped:
                if len(out) >= N:
                    stopped = "max_new_tokens"
                    break
                if self._stop.is_set():
                    stopped = "stop"
                    break
                t_round = now()
                seq = ids + out
                remaining = N - len(out)
                k_use = k
                if per_round:
                    k_use = self._decide_round(rid, rounds + 1, reuse, seq, remaining, draft_model, has_draft)
                elif policy.adaptive and k == 0 and has_draft:
                    # per-request mode at k=0: an occasional probe round keeps alpha alive
                    td = now()
                    ctl = self.controller
                    behind = self._draft_behind(seq, reuse, draft_model) if ctl.probe_due else 0
                    k_use = ctl.maybe_probe(len(seq), remaining, k_set, behind, draft_model)
                    if k_use:
                        self._emit(Decision(request_id=rid, round=rounds + 1, action={"reuse": int(reuse), "k": k_use},
                                            alpha=self.alpha.value, reason="probe",
                                            alpha_star=self.controller.round_alpha_star(len(seq), k_set),
                                            decide_ms=round((now() - td) * 1e3, 4)))
                k_eff = min(k_use, remaining - 1)
                prop_tokens: list[int] = []
                draft_ms = catch_ms = 0.0
                catch_tok = 0
                if k_eff > 0:
                    prop = self.draft.propose(seq, k_eff)
                    prop_tokens, draft_ms = prop.tokens, prop.ms
                    catch_tok, catch_ms = prop.catchup_tokens, prop.catchup_ms
                    if prop.prefill is not None:
                        h = prop.prefill.hit
                        st = self.store.stats
                        self._emit(CacheLookup(request_id=rid, model="draft", bucket=h.bucket, hit_tokens=h.q,
                                               reused_tokens=h.usable, exact_repeat=h.exact, prompt_tokens=P,
                                               bytes_used=st.bytes_used, budget=st.budget, entries=st.entries,
                                               evictions=st.evictions, stored=prop.prefill.stored,
                                               lookup_ms=round(prop.prefill.lookup_ms, 4),
                                               prefill_ms=round(prop.prefill.ms, 3)))
                tv = now()
                if prop_tokens:
                    logits = dec.verify(self.target.model, [seq[-1]] + prop_tokens, cache)
                    pred = torch.argmax(logits, dim=-1).tolist()
                    verify_ms = (now() - tv) * 1e3
                    a = dec.accept(prop_tokens, pred)
                    dec.rollback(cache, len(prop_tokens) - a)
                    emitted = prop_tokens[:a] + [pred[a]]
                    prov = ["draft"] * a + ["target"]
                    kind = "spec"
                else:
                    logits = dec.decode_one(self.target.model, seq[-1], cache)
                    emitted = [dec.argmax(logits)]
                    verify_ms = (now() - tv) * 1e3
                    a = 0
                    prov = ["target"]
                    kind = "ar"
                # EOS inside the accepted run ends the output there; never exceed N
                cut = len(emitted)
                for i, tok in enumerate(emitted):
                    if tok in eos:
                        cut, stopped = i + 1, "eos"
                        break
                cut = min(cut, remaining)
                emitted, prov = emitted[:cut], prov[:cut]
                out.extend(emitted)
                if prop_tokens:
                    self.draft.commit(ids + out)
                m = len(prop_tokens)
                drafted_total += m
                accepted_total += a
                rounds += 1
                if self.controller is not None:
                    self.controller.observe_round(m, a)
                    self._observe_costs(kind, m, len(seq), verify_ms, draft_ms, catch_tok, draft_model)
                else:
                    self.alpha.update(a, m)
                round_ms = (now() - t_round) * 1e3
                fwd = verify_ms + (draft_ms if draft_model else 0.0)
                forward_ms += fwd
                book_ms += max(0.0, round_ms - fwd)
                self._emit(Round(request_id=rid, index=rounds, kind=kind, k=k_eff, drafted=m, accepted=a,
                                 emitted=emitted, provenance=prov, draft_ms=round(draft_ms, 3),
                                 verify_ms=round(verify_ms, 3), catchup_tokens=catch_tok,
                                 catchup_ms=round(catch_ms, 3), round_ms=round(round_ms, 3),
                                 context=len(seq), alpha=round(self.alpha.value, 5)))
                if len(out) >= N and not stopped:
                    stopped = "max_new_tokens"
        finally:
            self.draft.end()
        latency = (now() - t_req) * 1e3
        end = RequestEnd(request_id=rid, output_ids=out, text=self.decode_text(out), prompt_tokens=P,
                         hit_tokens=pf.hit.q if reuse else 0, exact_repeat=bool(pf.hit.exact),
                         action={"reuse": int(reuse), "k": int(k)}, latency_ms=round(latency, 3),
                         ttft_ms=round(ttft, 3), tokens_per_s=round(len(out) / (latency / 1e3), 3) if latency else 0.0,
                         drafted=drafted_total, accepted=accepted_total, rounds=rounds,
                         alpha_ewma=round(self.alpha.value, 5),
                         predicted_ms=None if choice is None else choice.predicted_ms,
                         stopped=stopped, forward_ms=round(forward_ms, 3), bookkeeping_ms=round(book_ms, 3))
        if self.controller is not None:
            self.controller.end_request(len(out), N, stopped)
        self._open_request = None
        self._emit(end)
        return end

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
        entry = P * self.target.kv_bytes_per_token() + 4 * V
        dentry = P * self.draft.lm.kv_bytes_per_token() if draft_model else 0
        return Situation(P=P, N=N, q=q, exact=exact, qd=qd, exact_d=exact_d, entry_bytes=entry,
                         draft_entry_bytes=dentry, budget=budget, has_draft=has_draft, draft_model=draft_model)

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

    def _observe_costs(self, kind, m, ctx, verify_ms, draft_ms, catch_tok, draft_model) -> None:
        p = self.profile
        if kind == "ar":
            p.observe("t", p.step(ctx), verify_ms)
        else:
            p.observe(f"V{m}", p.verify(m, ctx), verify_ms)
            if draft_model and catch_tok == 0 and m > 0:
                p.observe("d", m * p.draft_step(ctx), draft_ms)


def make_draft(spec: str, target: LoadedModel, config: RakvConfig) -> DraftSource:
    """--draft: a model (hub id / dir / .gguf), 'int8', 'ngram' or 'none'."""
    from .models import check_same_tokenizer, int8_copy, load_model

    s = (spec or "none").strip()
    if s == "none":
        return NoDraft()
    if s == "ngram":
        return NgramDraft(config.ngram_sizes)
    if s == "int8":
        return ModelDraft(int8_copy(target))
    lm = load_model(s, config.dtype, None, config.device)
    check_same_tokenizer(target, lm)
    return ModelDraft(lm)

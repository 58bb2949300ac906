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
from dataclasses import asdict, dataclass, field, replace

import torch

from .. import decoding as dec
from ..decoding import sampling as S
from ..util.device import clock, hardware_info, versions_info
from ..util.threads import Threads
from ..config import TREE_MAX_NODES, Policy, RakvConfig
from ..decide.learned import AlphaEWMA
from ..decide.controller import Choice, Controller, Situation, copy_length, moved_scales
from ..decide.profile import CostProfile, quality_summary
from ..drafts.base import DraftSource
from ..drafts.ngram import MAX_MATCH, history_match
from ..drafts.none import NoDraft
from ..load.loaded import LoadedModel, model_info
from ..decoding.reuse import prefill_with_reuse
from ..decide.planner import RoundPlanner
from ..prefix_cache import PrefixCache
from ..prompts import EncodedPrompt, encode_prompt
from ..config import Sampling, draw_seed
from ..decide.gate import LOOKUP_ALPHA, AcceptMap
from ..decoding.tree import TokenTree, priced, verify_tree
from ..records import CacheLookup, Candidate, Decision, RequestEnd, RequestStart, Round, RunHeader

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
    sampling: Sampling = Sampling()   # this request's (seed = the call's + request id)
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
    copied: bool = False         # priced as the copy of an exact repeat's earlier output (not copy-ledger evidence)
    explore: bool = False        # an explored request (drafts to learn alpha) ...
    dropped: bool = False        # ... that stopped drafting once its acceptance showed k does not pay


def learned_state(p: CostProfile) -> dict:
    """The state a profile carries from earlier sessions, beside what calibration measured: it
    starts the controller, so it is shown (run header, CLI log) and bounded (evidence capped,
    online scales clipped per measurement)."""
    return {"alpha0": p.alpha0, "alpha_learned": p.alpha_learned, "alpha_trials": p.alpha_trials,
            "out_frac": p.out_frac, "scale": {k: round(v, 3) for k, v in sorted(p.scale.items())}}


def next_token(logits, s: Sampling | None, position: int) -> int:
    """The target's token at output ``position`` from its logits [V]: argmax, or its seeded sample."""
    return dec.argmax(logits) if s is None or s.greedy else S.sample(logits, s, position)


def cut_at_eos(emitted: list[int], prov: list[str], eos, remaining: int):
    """EOS inside the accepted run ends the output there; never exceed ``remaining``."""
    cut, hit = len(emitted), False
    for i, tok in enumerate(emitted):
        if tok in eos:
            cut, hit = i + 1, True
            break
    cut = min(cut, remaining)
    return emitted[:cut], prov[:cut], hit


class _Ids:
    __slots__ = ("next",)

    def __init__(self):
        self.next = 0


class SharedWithPlanner:
    """An engine attribute the round planner holds too: setting it on the engine sets both."""

    def __init__(self, name: str):
        self.name = name

    def __get__(self, eng, owner=None):
        return self if eng is None else eng.__dict__["_" + self.name]

    def __set__(self, eng, value) -> None:
        eng.__dict__["_" + self.name] = value
        if "planner" in eng.__dict__:
            setattr(eng.planner, self.name, value)


class InPlanner:
    """An engine attribute that is the round planner's own (read and set through the engine)."""

    def __init__(self, name: str):
        self.name = name

    def __get__(self, eng, owner=None):
        return self if eng is None else getattr(eng.planner, self.name)

    def __set__(self, eng, value) -> None:
        setattr(eng.planner, self.name, value)


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
        s = config.sampling
        self.sampling = s if s.greedy or s.seed is not None else replace(s, seed=draw_seed())
        self.profile = profile
        self.controller = Controller(profile, self.k_set, config.alpha_decay, config.probe_every,
                                     config.alpha_prior, explore_share=config.explore_share) if profile is not None else None
        self.alpha = self.controller.alpha if self.controller else AlphaEWMA(
            config.alpha_prior if config.alpha_prior is not None else 0.5, config.alpha_decay)
        if self.policy.adaptive and self.controller is None:
            raise EngineError("the adaptive policy needs a cost profile (run calibration)")
        self.planner = RoundPlanner(self.draft, self.controller, profile, self.alpha, self.store,
                                    config.lookup_k, self._emit, self._k_set_now)
        self.tree_map = AcceptMap(LOOKUP_ALPHA)   # a tree node's confidence -> its chance, its parent accepted
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._ids = _Ids()               # request ids (one counter for an engine and its lanes)
        self._running = False
        self._pending_budget: int | None = None
        self._open_request: int | None = None
        self.threads = Threads(config.threads, pinned=bool(config.threads))   # the steps' thread count (adapts unless --threads)
        self.step_reports = True         # a lane of a LanePool: its batcher reports the shared steps instead
        self.t0 = now()

    _next_id = property(lambda self: self._ids.next, lambda self, v: setattr(self._ids, "next", int(v)))

    def lane(self) -> "Engine":
        """Another engine over this one's target, prefix cache, learned state and request ids, with
        its own draft state, round planner and controls: one lane of ``rakv.engine.batch.LanePool``."""
        e = Engine(self.target, self.draft.fork(), self.config, self.callback, self.profile)
        e.store = e.planner.store = self.store
        e.planner.copy_book = self.planner.copy_book       # (what copy rounds earn: the server's traffic, not a lane's)
        if self.controller is not None:
            e.controller = self.controller
        e.profile, e.alpha, e._ids, e.t0 = self.profile, self.alpha, self._ids, self.t0
        e.policy, e.k_set, e.granularity, e.force = self.policy, self.k_set, self.granularity, self.force
        e.sampling, e.chat_template = self.sampling, self.chat_template
        e.threads = self.threads
        return e

    # what the planner shares with the engine: swapping one (the oracle's measuring does) swaps both
    controller = SharedWithPlanner("controller")
    profile = SharedWithPlanner("profile")
    alpha = SharedWithPlanner("alpha")

    # the gate's acceptance tables and the n-gram side draft live in the planner
    accept_map = InPlanner("accept_map")
    lookup_map = InPlanner("lookup_map")
    lookup = InPlanner("lookup")

    def _k_set_now(self) -> tuple:
        with self._lock:
            return self.k_set

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

    def set_sampling(self, s: Sampling) -> None:
        """Sampling for the next requests (a seed is drawn if it has none); bad values: EngineError."""
        from ..config import problem

        why = problem(s)
        if why:
            raise EngineError(why)
        with self._lock:
            self.sampling = s if s.greedy or s.seed is not None else replace(s, seed=draw_seed())

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
                      numerics=self.target.numerics,
                      device=c.device, threads=torch.get_num_threads(), hardware=hardware_info(),
                      versions=versions_info(), settings={**asdict(c), "sampling": asdict(self.sampling)},
                      started=time.strftime("%Y-%m-%dT%H:%M:%S"),
                      learned=learned_state(self.profile) if self.profile is not None else {},
                      profile=quality_summary(self.profile) if self.profile is not None else {})
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
                self.planner.end_request(self._open_request)       # (it no longer shares the batch's steps)
                self._emit(RequestEnd(request_id=self._open_request, stopped="error",
                                      text=f"{type(e).__name__}: {e}"))
            raise
        finally:
            self._open_request = None
            self._stop.clear()
            self.threads.rest()
            with self._lock:
                self._running = False
                self._apply_budget()

    def _generate(self, prompt, max_new_tokens, prompt_text) -> RequestEnd:
        rq = self._start(prompt, max_new_tokens, prompt_text)
        choice = self._decide(rq)
        self.threads.use()
        self._prefill(rq)
        try:
            while not rq.stopped:
                if rq.policy.tree:
                    self._tree_round(rq)
                else:
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
            sampling = self.sampling.for_request(self._next_id)
        rq = _Request(rid=self._next_id, ids=ids, N=N, policy=policy, k_set=k_set, force=force, budget=budget,
                      has_draft=self.draft.proposes, draft_model=self.draft.has_model,
                      sampling=sampling)
        self._next_id += 1
        self._open_request = rq.rid
        text = prompt if isinstance(prompt, str) else (prompt_text or "")
        self._emit(RequestStart(request_id=rq.rid, prompt=text, prompt_ids=ids, prompt_tokens=P,
                                max_new_tokens=N, policy=policy.name, templated=enc.templated,
                                template_prefix=enc.template_prefix, sampling=sampling.to_dict(), conversation=enc.conversation))
        rq.t0 = now()
        return rq

    def _use_setting(self, rq: "_Request") -> None:
        """Acceptance is learned per sampling setting: switch the controller's estimates and the
        gate's tables to this request's (a new setting's prior is measured once, at its setting)."""
        key = rq.sampling.key()
        if self.controller is None or key == self.controller.setting:
            return
        from ..decide.calibration import alpha_prior

        prior = alpha_prior(self.profile, self.target, self.draft, rq.sampling)
        self.controller.use_setting(key, prior)
        self.planner.use_setting(key, prior)

    def _decide(self, rq: "_Request") -> Choice | None:
        """The per-request action (r, k): the controller's argmin, or the fixed policy's."""
        self._use_setting(rq)
        policy, ctl = rq.policy, self.controller
        choice = None
        if ctl is not None:
            # (a fixed policy's prediction prices its real hit too: the oracle sets it beside its run)
            s = self._situation(rq.ids, rq.N, rq.budget, rq.has_draft, rq.draft_model, peek=True,
                                gate=policy.gate, k_set=rq.k_set)
            if policy.adaptive:
                choice = ctl.decide(s, rq.k_set, rq.force)
                if policy.tree:            # the controller's reuse; every round prices its own tree
                    choice.k = TREE_MAX_NODES
            else:
                r, k = int(policy.reuse), policy.k
                c = round(ctl.cost(s, r, k, self.alpha.value), 3)
                ok, why = ctl.feasible(s, r, k)
                stars = {str(k): ctl.request_alpha_star(s, r, k)} if k > 0 else {}
                choice = Choice(r, k, c, [Candidate(r, k, c, ok, why)], self.alpha.value, stars, "fixed",
                                copy=bool(copy_length(s, r, k)), passes=round(ctl.passes(s, r, k, self.alpha.value), 2))
            rq.reuse, rq.copied = choice.reuse, choice.copy
            batch = self.planner.join(rq, choice)     # beside other requests: k priced by the batch it joins
            rq.k = choice.k
            rq.explore = choice.reason == "probe" and choice.k > 0 and not policy.tree
            self._emit(Decision(request_id=rq.rid, candidates=[c.to_dict() for c in choice.candidates],
                                action={"reuse": rq.reuse, "k": rq.k}, alpha=choice.alpha,
                                alpha_star=choice.alpha_star, reason=choice.reason, decide_ms=choice.decide_ms,
                                explore_balance_ms=round(ctl.explore_balance, 3), copy=choice.copy,
                                explore_cost_ms=choice.explore_ms, predicted_passes=choice.passes,
                                cost_scales=moved_scales(self.profile, self.planner.lookup_scale), batch=batch))
            rq.explore_ms += choice.explore_ms      # an explored request's predicted excess (its k = 0 is not run)
        else:
            rq.reuse, rq.k = int(policy.reuse), policy.k
            self.planner.join(rq, None)
            self._emit(Decision(request_id=rq.rid, candidates=[Candidate(rq.reuse, rq.k, 0.0).to_dict()],
                                action={"reuse": rq.reuse, "k": rq.k}, alpha=self.alpha.value, reason="fixed"))
        if rq.k > 0 and not rq.has_draft and not policy.tree:     # (a tree's source is the n-gram lookup)
            raise EngineError(f"k={rq.k} needs a draft (--draft is 'none')")
        # (an explored request runs its k, judged by explore_holds: per-round decisions at the prior
        # never drafted, so it had explored again every request and learnt nothing)
        rq.per_round = policy.adaptive and self.granularity == "round" and rq.force is None and not rq.explore
        self.planner.begin(rq)
        return choice

    def _prefill(self, rq: "_Request") -> None:
        """Target prompt KV (through the prefix cache when r = 1) and the first token."""
        P = len(rq.ids)
        pf = prefill_with_reuse(self.target, rq.ids, self.store if rq.reuse else None)
        t1 = next_token(pf.logits, rq.sampling, 0)    # stored logits of an exact repeat: this request's seed
        rq.ttft = (now() - rq.t0) * 1e3
        self._emit_lookup(rq.rid, "target", pf.hit, P, pf.stored, pf.lookup_ms, pf.forward_ms)
        if self.profile is not None and pf.forward_ms > 0 and not self.planner.shared(rq.rid):   # (shared: the batch's ms)
            self.profile.observe("T", self.profile.T(P - pf.hit.usable), pf.forward_ms)
        if self.controller is not None:
            self.controller.earn(rq.ttft)
        rq.pf, rq.cache, rq.out = pf, pf.cache, [t1]
        rq.forward_ms = pf.forward_ms
        self._emit(Round(request_id=rq.rid, index=0, kind="prefill", emitted=[t1],
                         provenance=["stored" if pf.hit.exact else "target"], verify_ms=round(pf.forward_ms, 3),
                         round_ms=round(rq.ttft, 3), context=P, alpha=self.alpha.value))
        self.draft.sampling = rq.sampling
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

    def _round(self, rq: "_Request") -> None:
        """One round: ask the planner (k, source, drafts), verify, accept, tell it the outcome."""
        threads = self.threads.use()
        t_round = now()
        seq = rq.ids + rq.out
        remaining = rq.N - len(rq.out)
        plan = self.planner.plan(rq, seq, remaining)
        if plan.prefill is not None:
            h = plan.prefill
            self._emit_lookup(rq.rid, "draft", h.hit, len(rq.ids), h.stored, h.lookup_ms, h.ms)
        drafts, gate = plan.drafts, plan.gate
        tv = now()
        if drafts:
            emitted, a = dec.verify_accept(self.target.model, rq.cache, seq[-1], drafts, rq.sampling,
                                       len(rq.out), plan.q_logits)
            prov = ["draft"] * a + ["target"]
        else:
            logits = dec.decode_one(self.target.model, seq[-1], rq.cache)
            emitted, a = [next_token(logits, rq.sampling, len(rq.out))], 0
            prov = ["target"]
        verify_ms = (now() - tv) * 1e3
        if self.step_reports:
            self.threads.step(verify_ms, len(drafts) + 1)
        emitted, prov, eos = cut_at_eos(emitted, prov, self.target.eos_ids, remaining)
        rq.out.extend(emitted)
        if eos:
            rq.stopped = "eos"
        m = len(drafts)
        if not plan.lookup:      # a request's drafted / accepted count the model draft's rounds
            rq.drafted += m
            rq.accepted += a
        rq.rounds += 1
        round_ms = (now() - t_round) * 1e3 - plan.setup_ms
        explore = self.planner.told(rq, plan, a, len(emitted), verify_ms, round_ms, len(seq))
        rq.explore_ms += explore
        fwd = verify_ms + (plan.draft_ms if rq.draft_model else 0.0)
        rq.forward_ms += fwd
        rq.book_ms += max(0.0, round_ms - fwd)
        self._emit(Round(request_id=rq.rid, index=rq.rounds, kind="spec" if drafts else "ar", k=plan.k, drafted=m,
                         accepted=a, emitted=emitted, provenance=prov, draft_ms=round(plan.draft_ms, 3),
                         verify_ms=round(verify_ms, 3), catchup_tokens=plan.catchup_tokens,
                         catchup_ms=round(plan.catchup_ms, 3),
                         round_ms=round(round_ms, 3), context=len(seq), alpha=round(self.alpha.value, 5),
                         explore_ms=round(explore, 3),
                         draft_conf=[round(c, 4) for c in gate.confs] if gate else [],
                         draft_pred=[round(c, 4) for c in gate.preds] if gate else [],
                         draft_stop=gate.stop if gate else "",
                         draft_source="lookup" if plan.lookup and gate else "",
                         verify="" if rq.sampling.greedy or not drafts else rq.sampling.verify,
                         threads=threads))
        self._check_end(rq)

    def _tree_round(self, rq: "_Request") -> None:
        """One round of policy tree:N: the n-gram lookup's token tree (at most N nodes, no deeper
        than the tokens left), verified in one forward; the accepted path and a target token."""
        threads = self.threads.use()
        t_round = now()
        seq = rq.ids + rq.out
        remaining = rq.N - len(rq.out)
        tree, draft_ms = (self.lookup.propose_tree(seq, rq.k, remaining - 1) if remaining > 1
                          else (TokenTree(), 0.0))
        expected, predicted = None, None
        if rq.policy.adaptive and self.profile is not None and tree.tokens:
            tree, expected, predicted = self._price_tree(tree, len(seq))
        tv = now()
        how = ""
        if tree.tokens:
            emitted, path, how = verify_tree(self.target.model, rq.cache, seq[-1], tree, rq.sampling, len(rq.out))
        else:
            logits = dec.decode_one(self.target.model, seq[-1], rq.cache)
            emitted, path = [next_token(logits, rq.sampling, len(rq.out))], []
        verify_ms = (now() - tv) * 1e3
        if self.step_reports:
            self.threads.step(verify_ms, len(tree) + 1)
        a = len(path)
        if expected is not None:
            self._observe_tree(tree, path, how)
        emitted, prov, eos = cut_at_eos(emitted, ["draft"] * a + ["target"], self.target.eos_ids, remaining)
        rq.out.extend(emitted)
        if eos:
            rq.stopped = "eos"
        rq.drafted += len(tree)
        rq.accepted += a
        rq.rounds += 1
        round_ms = (now() - t_round) * 1e3
        rq.forward_ms += verify_ms
        rq.book_ms += max(0.0, round_ms - verify_ms)
        self._emit(Round(request_id=rq.rid, index=rq.rounds, kind="spec" if tree.tokens else "ar", k=rq.k,
                         drafted=len(tree), accepted=a, emitted=emitted, provenance=prov,
                         draft_ms=round(draft_ms, 3), verify_ms=round(verify_ms, 3), round_ms=round(round_ms, 3),
                         context=len(seq), alpha=round(self.alpha.value, 5),
                         draft_source="tree" if tree.tokens else "",
                         verify="" if rq.sampling.greedy or not tree.tokens else rq.sampling.verify,
                         tree_tokens=list(tree.tokens), tree_parents=list(tree.parents), tree_path=path,
                         tree_verify=how, tree_expected=None if expected is None else round(expected, 4),
                         tree_predicted_ms=None if predicted is None else round(predicted, 3),
                         threads=threads))
        self._check_end(rq)

    def _price_tree(self, tree: TokenTree, ctx: int) -> tuple[TokenTree, float, float]:
        """adaptive:tree: the subtree with the most expected tokens per ms, from the measured
        V(n) (V(0) = t: a plain step) and each node's learned chance of acceptance."""
        p = self.profile
        V = [p.step(ctx)] + [p.verify(n, ctx) for n in range(1, len(tree) + 1)]
        return priced(tree, self.tree_map.p, V)

    def _observe_tree(self, tree: TokenTree, path: list[int], how: str) -> None:
        """Each node the verify judged (a child of the pending token or of an accepted node; of the
        first path only where it was verified as a chain) is a trial of its confidence."""
        judged = {-1, *path}
        chain = set(tree.first_path()[: len(path) + 1]) if how == "chain" else None
        for i, par in enumerate(tree.parents):
            if par in judged and (chain is None or i in chain):
                c = tree.conf[i]
                self.tree_map.observe([c], [self.tree_map.p(c)], int(i in path))

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
                         explore_ms=round(rq.explore_ms, 3), threads=self.threads.count(),
                         thread_switches=self.threads.switches,
                         cost_corrections=self.profile.corrections() if self.profile is not None else {})
        self.planner.fold_plain()
        self.planner.end_request(rq.rid)
        if self.controller is not None:
            self.controller.end_request(len(out), rq.N, rq.stopped)
        self._open_request = None
        self._emit(end)
        return end

    # ------------------------------------------------------------------ warm-up (an editor's n_predict: 0)
    def warm(self, prompt, prompt_text: str | None = None) -> RequestEnd:
        """Prefill ``prompt`` through the prefix cache and store its KV (the draft model's too),
        decoding nothing: the next request that starts with these ids reuses them. Records a
        request like any (start, cache lookups, end with ``stopped="warm"``)."""
        with self._lock:
            self._running = True
            self._apply_budget()
        try:
            enc = self.encode_prompt(prompt)
            ids, P = enc.ids, len(enc.ids)
            if self.target.max_positions is not None and P > self.target.max_positions:
                raise EngineError(f"prompt ({P} tokens) exceeds the model's context of {self.target.max_positions}")
            rid = self._next_id
            self._next_id += 1
            self._open_request = rid
            self._emit(RequestStart(request_id=rid, prompt=prompt_text or "", prompt_ids=ids, prompt_tokens=P,
                                    max_new_tokens=0, policy=self.policy.name, templated=enc.templated,
                                    template_prefix=enc.template_prefix))
            t0 = now()
            pf = prefill_with_reuse(self.target, ids, self.store)
            self._emit_lookup(rid, "target", pf.hit, P, pf.stored, pf.lookup_ms, pf.forward_ms)
            fwd = pf.forward_ms
            if self.draft.has_model:
                h = prefill_with_reuse(self.draft.lm, ids, self.store, need_logits=False)
                self._emit_lookup(rid, "draft", h.hit, P, h.stored, h.lookup_ms, h.forward_ms)
                fwd += h.forward_ms
            ms = (now() - t0) * 1e3
            end = RequestEnd(request_id=rid, prompt_tokens=P, hit_tokens=pf.hit.q, exact_repeat=bool(pf.hit.exact),
                             action={"reuse": 1, "k": 0}, latency_ms=round(ms, 3), ttft_ms=round(ms, 3),
                             alpha_ewma=round(self.alpha.value, 5), stopped="warm", forward_ms=round(fwd, 3))
            self._open_request = None
            self._emit(end)
            return end
        except Exception as e:
            if self._open_request is not None:
                self._emit(RequestEnd(request_id=self._open_request, stopped="error", text=f"{type(e).__name__}: {e}"))
            raise
        finally:
            self._open_request = None
            self._stop.clear()
            with self._lock:
                self._running = False
                self._apply_budget()

    # ------------------------------------------------------------------ conversations (rakv.engine.chat)
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
    def _situation(self, ids, N, budget, has_draft, draft_model, peek: bool, gate: bool | None = None,
                   k_set=None) -> Situation:
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
        # (only greedy decoding repeats an earlier output: a sampled request has its own seed)
        # (the gate's lookup copies with any draft; without it only an n-gram draft copies)
        gate = (self.policy.gate if gate is None else gate) and self.profile is not None
        follow = (self._copies_whole(ids, N) if peek and exact and self.sampling.greedy
                  and (gate or self.draft.copies) else None)
        entry = P * self.target.kv_bytes_per_token() + 4 * V
        dentry = P * self.draft.lm.kv_bytes_per_token() if draft_model else 0
        return Situation(P=P, N=N, q=q, exact=exact, qd=qd, exact_d=exact_d, entry_bytes=entry,
                         draft_entry_bytes=dentry, budget=budget, has_draft=has_draft, draft_model=draft_model,
                         copy=follow is not None, copy_tokens=len(follow or ()), gate=gate,
                         copy_run=self.planner.copy_top(k_set or self.k_set) if follow else 0,
                         copy_scale=self.planner.lookup_scale,
                         draft_copies=self.draft.copies, **self._copy_evidence(gate))

    def _copy_evidence(self, gate: bool) -> dict:
        """The copy ledger's measured gain and tokens of a gated copy round (none without the gate)."""
        ev = self.planner.copies.evidence() if gate else None
        return {} if ev is None else {"copy_gain": ev[0], "copy_emit": ev[1]}

    def _copies_whole(self, ids, N: int) -> list[int] | None:
        """The earlier output of exactly this prompt the history holds, N tokens or up to EOS (None:
        none); the n-gram lookup that will copy it (the draft's, or the gate's side lookup) reads it."""
        h = self.store.history
        if not len(h):
            return None
        follow, m = history_match(ids, N, self.lookup.sizes, h.tokens)
        whole = m >= min(len(ids), MAX_MATCH) and bool(follow) and (
            len(follow) >= N or follow[-1] in self.target.eos_ids)
        return list(follow[:N]) if whole else None


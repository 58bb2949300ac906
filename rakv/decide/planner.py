"""Plans each decoding round and is told its outcome: the engine's one door to the controller.

The engine asks one question a round, ``plan(rq, seq, remaining)``, and gets a ``RoundPlan``: the
round's k, where its tokens come from (the model draft, the n-gram lookup, or none: a plain
step), the drafted tokens themselves, the confidence gate that cut them, and whether it is a
priced probe (with its alpha*). After the verify it reports one ``RoundOutcome`` through
``told(...)``, which teaches the controller (acceptance, exploration spent), the gate's tables and
the cost profile. Like transformers' candidate generators: propose, then be told the outcome.
Qt-free; knows nothing of the prefix cache or the records' transport (it emits through ``emit``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..util.acceptance import judged
from .learned import AlphaEWMA
from .controller import Controller
from .profile import CostProfile
from ..util.device import clock
from ..drafts.base import DraftSource
from ..drafts.ngram import NgramDraft
from ..prefix_cache import PrefixCache
from ..records import Candidate, Decision
from .gate import LOOKUP_ALPHA, AcceptMap, RoundGate, Trusted, request_trust
from .policy import E, batch_k, copies_win, joint_move
from ..config import PREFILL_CHUNK

now = clock

LOOKUP_COST_WEIGHT = 0.2    # a lookup verify's measured / predicted ms: weight of each new round (log space)
LOOKUP_COST_CLIP = 2.0      # one round moves that ratio by at most this factor
LOOKUP_STEPS = 4.0          # a gated lookup verifies at most what a verify of this many steps holds
COPY_GAIN_WEIGHT = 0.05     # a copy round's gain and dry planning: weight of each new round
COPY_SHARE_WEIGHT = 0.01    # ... the share of copy rounds that verify (matches come in bursts: a long window)
COPY_RETRY = 8              # while copies do not pay, every 8th copy round still tries one
COPY_EVIDENCE = 4           # verified copy rounds weighed before copies may be judged not to pay
PLAIN_BATCH = 16            # plain steps' times reach the profile this many at a time (and at a request's end)


def batch_pass(profile: CostProfile, costs, ctx: float):
    """W(n): a pass of n rows at context ctx, the profile's V(n - 1) (W(1) = t) times the scale the
    batch's shared steps measured for n rows (``learned.BatchCosts``; 1 before any). Each n is
    priced once (a round asks for the same few many times): make a new W for each round."""
    seen: dict[int, float] = {}

    def W(n: int) -> float:
        w = seen.get(n)
        if w is None:
            base = profile.verify(n - 1, ctx) if n > 1 else profile.step(ctx)
            w = seen[n] = base * (costs.factor(n) if costs is not None else 1.0)
        return w
    return W


def cut_beside_drafting(others_drafting) -> bool:
    """May a move's round stop its draft short of K while other requests of the move draft? No: the
    draft passes and the verify run for them anyway, so a cut saves only its rows of that verify and
    gives up tokens that cost whole steps later (docs/serve.md, "A move's gate")."""
    return not others_drafting


def joins_batch_move(rq, batch) -> bool:
    """Is this request's k part of the batch's joint move (``policy.joint_move``)? An adaptive
    request with a model draft, in lockstep (where drafts share passes), not forced or a tree."""
    return bool(batch.lockstep and rq.policy.adaptive and rq.has_draft and rq.draft_model
                and not rq.policy.tree and rq.force is None)


class BatchVerifies:
    """[W(rows + 1 + j) for j = 0..k_max], each made on first read (``Verifies``' shape): the step's
    pass with j drafts of this request beside the others' ``rows``."""

    __slots__ = ("_W", "_rows", "_n")

    def __init__(self, W, rows: int, k_max: int):
        self._W, self._rows, self._n = W, rows, max(0, int(k_max)) + 1

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, j: int) -> float:
        if not 0 <= j < self._n:
            raise IndexError(j)
        return self._W(self._rows + 1 + j)

    def __iter__(self):
        return (self[j] for j in range(self._n))


def lookup_cost_scale(scale: float, measured_ms: float, predicted_ms: float) -> float:
    """A lookup's verify runs a path the plain steps around it do not (in a k = 0 round it is
    rare and runs cold), so its V(j) is learned as its own multiple of the profile's."""
    if predicted_ms <= 0 or measured_ms <= 0 or not math.isfinite(measured_ms):
        return scale
    r = min(LOOKUP_COST_CLIP, max(1.0 / LOOKUP_COST_CLIP, measured_ms / predicted_ms))
    return math.exp((1 - LOOKUP_COST_WEIGHT) * math.log(scale) + LOOKUP_COST_WEIGHT * math.log(r))


def follows_copy(rq) -> bool:
    """A copied exact repeat keeps its request's action every round: its earlier output is known to
    be there, and a k re-decided per round (or a probe) would trade those copies for model drafts."""
    return bool(getattr(rq, "copied", False))


@dataclass
class CopyLedger:
    """What copy rounds earn under one sampling setting: the average net gain of a round that
    verified copies (the steps its accepted copies saved, less what its verify cost over a plain
    step and what looking up and gating took), how often a copy round verifies any, and what one
    that verifies none costs (its lookup and gate). A stretch without matches lowers how often,
    not what a verified copy earns, so a few dry rounds and one miss do not stop the lookups where
    copies pay."""

    gain: float = 0.0          # net gain of a verified copy round (ms): mean of the first rounds, then weighted
    verified: float = 0.0      # share of copy rounds that verify copies (mean of the first rounds, then weighted)
    dry_ms: float = 0.0        # planning of a copy round that verifies none (ms, weighted)
    n: int = 0                 # verified copy rounds seen
    rounds: int = 0            # copy rounds seen
    accepted: float = 0.0      # copies the target accepted in a verified copy round (mean of the first, then weighted)
    rows: float = 0.0          # copies a verified copy round verified (as ``accepted``)
    plan_ms: float = 0.0       # planning of a verified copy round (ms, as ``accepted``)
    priced: tuple | None = None    # ((batch, step), expected gain at that step's prices): lanes price once a step

    def observe(self, m: int, accepted: int, t_ms: float, extra_ms: float, plan_ms: float) -> None:
        w = COPY_GAIN_WEIGHT
        self.rounds += 1
        ws = max(COPY_SHARE_WEIGHT, 1.0 / self.rounds)
        self.verified = (1 - ws) * self.verified + ws * (m > 0)
        if m:
            self.n += 1
            wg = max(w, 1.0 / self.n)
            self.gain = (1 - wg) * self.gain + wg * (accepted * t_ms - extra_ms - plan_ms)
            self.accepted = (1 - wg) * self.accepted + wg * accepted
            self.rows = (1 - wg) * self.rows + wg * m
            self.plan_ms = (1 - wg) * self.plan_ms + wg * plan_ms
        else:
            self.dry_ms = (1 - w) * self.dry_ms + w * plan_ms

    def expected(self) -> float:
        """A copy round's expected net gain (ms), at the prices its rounds were told."""
        return self.verified * self.gain - (1 - self.verified) * self.dry_ms

    def expected_at(self, token_ms: float, extra) -> float:
        """A copy round's expected net gain (ms) at today's prices: ``token_ms`` what an emitted
        token costs now, ``extra(m)`` what verifying m copies adds to the step now (a batch's:
        ``copy_prices``). What the rounds measured (how often they verify, how many copies, how
        many hold, the planning) does not depend on what shares the step; their prices do."""
        if not self.n:
            return self.expected()
        won = self.accepted * token_ms - extra(max(1, round(self.rows))) - self.plan_ms
        return self.verified * won - (1 - self.verified) * self.dry_ms

    def evidence(self) -> tuple[float, float] | None:
        """What a request-level prediction takes from the copy rounds measured so far: a copy
        round's expected net gain over a plain step (ms; where copies do not pay only every
        COPY_RETRY-th round still tries one) and the tokens it emits; None before COPY_EVIDENCE
        verified rounds (no evidence: copies are not priced)."""
        if self.n < COPY_EVIDENCE:
            return None
        g = self.expected()
        return (g if g >= 0 else g / COPY_RETRY), 1.0 + self.verified * self.accepted


def copy_prices(W, rows_o: int, tokens_o: float):
    """(token_ms, extra) of a copy beside other requests: a token a copy emits is worth the batch's
    ms per token, W(rows_o + 1) / (1 + tokens_o), not a lone step, and verifying m copies adds
    W(rows_o + 1 + m) - W(rows_o + 1) ms to every request's step. Lanes plan one at a time, so a
    lookup's planning is the step's wall time too."""
    base = W(rows_o + 1)
    return base / (1.0 + tokens_o), (lambda m: W(rows_o + 1 + m) - base)


def copies_pay(expected_gain: float, skipped: int, evidence: int = COPY_EVIDENCE, requests: int = 1) -> bool:
    """Look up n-gram copies while a copy round is expected to gain, and every COPY_RETRY-th round
    when not (to notice when they pay again): where almost no copy is accepted (T = 1.0) the
    lookup's planning on every round and its rejected verifies cost more than the few it gains.
    Until ``evidence`` verified copy rounds have been weighed, always look up (a lookup that
    finds nothing costs what a fixed policy's does; one skipped may be a copy worth a step).
    ``requests`` sharing the steps retry each that much more rarely (``retry_every``)."""
    return copies_tried(skipped, evidence, requests) or expected_gain >= 0.0


def copies_tried(skipped: int, evidence: int, requests: int = 1) -> bool:
    """Is this copy round looked up whatever copies are expected to gain: before ``evidence``
    reaches COPY_EVIDENCE, or as the retry (``retry_every``)?"""
    return evidence < COPY_EVIDENCE or skipped + 1 >= retry_every(requests)


def retry_every(requests: int) -> int:
    """Copy rounds between two tries where copies do not pay: COPY_RETRY for each of the requests
    sharing the steps (and one ledger), so a batch tries in one step of COPY_RETRY, as one request
    alone does: a try's rows cost every request's step (docs/serve.md, "Copies beside other requests")."""
    return COPY_RETRY * max(1, int(requests))


def lookup_top(profile: CostProfile | None, lookup_k: int, floor: int) -> int:
    """The longest n-gram lookup a gated round verifies: lookup_k, cut to the longest verify that
    costs at most LOOKUP_STEPS steps (never below max(K)): a long copy's tokens fail together, more
    often than their confident one-token chances say, and where a long verify costs many steps the
    misses cost more than the hits gain (docs/controller.md#constants)."""
    if profile is None:
        return lookup_k
    ctx = profile.V_ctx
    t = profile.step(ctx)
    j = lookup_k
    while j > floor and profile.verify(j, ctx) > LOOKUP_STEPS * t:
        j -= 1
    return j


@dataclass
class RoundPlan:
    """What one round will verify (plain data; the engine verifies ``drafts`` after the pending token)."""

    k: int                                  # the round's k (0: a plain step unless a lookup verifies)
    drafts: list[int] = field(default_factory=list)
    source: str = ""                        # "" (plain step) | "draft" | "lookup"
    gate: RoundGate | None = None
    draft_ms: float = 0.0                   # proposing, catch-up and prompt prefill included
    catchup_tokens: int = 0
    catchup_ms: float = 0.0
    fed: int = 0                            # tokens the draft's first forward read (1, or 2 after a full accept)
    forwards: int = 0                       # the draft's forwards this round
    forward_ms: float = 0.0                 # ... their ms alone (no prompt prefill)
    prefill: object = None                  # the draft's prompt prefill, when this round paid it
    q_logits: object = None                 # [len(drafts), V] the model draft's rows (rejection verify)
    setup_ms: float = 0.0                   # making a lazy draft (kept out of the round's measured time)
    copy: bool = False                      # a gated round of n-gram copies (lookup, or the n-gram draft)
    plan_ms: float = 0.0                    # ... its planning (lookup, gate), for its net gain

    @property
    def lookup(self) -> bool:
        return self.source == "lookup"


def gate_k_max(k: int, rq, remaining: int, k_top: int) -> int:
    """With the gate, a drafting round may go to k_top (the largest k of K; lookup_k for an n-gram
    draft, which drafts for free): the gate, not an average acceptance, decides where each round
    stops (probes and fixed policies keep their k)."""
    if rq.policy.gate and rq.k > 0 and k == min(rq.k, remaining - 1):
        return max(k, min(k_top, remaining - 1))
    return k


def plain_step(plan: RoundPlan) -> bool:
    """A round that verified no drafts and ran no draft forward (a plain step, a copy round that
    found nothing to verify, a draft that proposed nothing): all it teaches is a step's time and
    one more round without drafting."""
    return not plan.drafts and plan.source != "draft" and plan.forwards == 0


def use_lookup(tokens: list[int], lookup: RoundGate | None, model: RoundGate, alpha: float) -> bool:
    """A gated drafting round takes the n-gram lookup instead of the model draft when the lookup's
    tokens per ms (nothing to draft: C_j = V(j)) beat what the model draft can expect at alpha."""
    return bool(tokens) and copies_win(lookup.rate(len(tokens)), model.expected_rate(alpha))


class RoundPlanner:
    """Owns what rounds learn beside the controller: the gate's acceptance tables (model draft and
    n-gram lookup) and, without a controller, the acceptance EWMA."""

    def __init__(self, draft: DraftSource, controller: Controller | None, profile: CostProfile | None,
                 alpha: AlphaEWMA, store: PrefixCache, lookup_k: int, emit, k_set_now):
        self.draft = draft
        self.store = store
        self.controller = controller
        self.profile = profile
        self.alpha = alpha
        self.lookup_k = lookup_k
        self.lookup_top = lookup_k              # lookup_k as this machine's verify costs allow (per request)
        self.emit = emit                        # records out (the engine stamps and forwards them)
        self.k_set_now = k_set_now              # () -> the K allowed now (changes between rounds)
        self.batch = None                       # a lane's BatchView (rakv.engine.batch): the others' rows
        self.k_alone = None                     # the request's own k where the batch it joined set another
        # draft confidence -> chance of acceptance, for the gate (prior: the calibration's counts)
        self.accept_map = AcceptMap(alpha.value, profile.accept_map if profile is not None else None)
        # the n-gram side draft of k = 0 rounds under the gate (its own map unless it is the draft)
        self.lookup = draft if draft.copies else NgramDraft()
        self.lookup_map = self.accept_map if self.lookup is draft else AcceptMap(LOOKUP_ALPHA)
        self.last_k = 0
        self.lookup_scale = 1.0                 # a lookup verify's measured ms over the profile's V(j)
        self.decide_ms_total = 0.0
        self.setting = "greedy"                 # the sampling setting the maps below are for
        self._maps: dict[str, tuple] = {}       # the other settings' (accept_map, lookup_map)
        self.copy_book: dict[str, CopyLedger] = {}  # what copy rounds earn, per setting (a batch's lanes share it)
        self.copy_skipped = 0                   # copy rounds made plain steps since the last one tried
        self._plain: list[tuple[int, float]] = []   # plain steps told and not yet folded: (ctx, verify ms)

    def use_setting(self, key: str, prior: float) -> None:
        """The gate's tables for sampling setting ``key`` (a draft's confidence means another
        chance of acceptance at another temperature); a new setting's start from ``prior``."""
        if key == self.setting:
            return
        self._maps[self.setting] = (self.accept_map, self.lookup_map)
        if key in self._maps:
            self.accept_map, self.lookup_map = self._maps.pop(key)
        else:
            self.accept_map = AcceptMap(prior)
            self.lookup_map = self.accept_map if self.lookup is self.draft else AcceptMap(LOOKUP_ALPHA)
        self.setting = key

    @property
    def copies(self) -> CopyLedger:
        """What copy rounds earn under the setting in force (``CopyLedger``)."""
        led = self.copy_book.get(self.setting)
        if led is None:
            led = self.copy_book[self.setting] = CopyLedger()
        return led

    # ------------------------------------------------------------------ the question
    def plan(self, rq, seq: list[int], remaining: int) -> RoundPlan:
        """This round's k, source and drafted tokens (a model draft is run here, gate and all)."""
        k = min(self._round_k(rq, seq, remaining), remaining - 1)
        copy = self._copy_round(rq, k, remaining)
        # (a copied repeat always looks up: its earlier output is known to be there)
        if copy and not follows_copy(rq) and not self._copies_pay(rq, len(seq)):
            self.copy_skipped += 1
            return RoundPlan(k=0)                 # a plain step
        tp = now()
        plan = RoundPlan(k=k, copy=copy)
        moving = self.in_joint_move(rq)
        k_gate = (k if moving else gate_k_max(k, rq, remaining, self._k_top(rq, self.draft))) if k > 0 else 0
        match = None
        if copy and k > 0 and self.lookup is self.draft:
            match = self.draft.match(seq, k_gate)         # nothing to copy (most rounds): no gate to make
            if not match[0]:
                plan.plan_ms = (now() - tp) * 1e3
                self.copy_skipped = 0
                return plan
        gate = self._gate(rq, seq, k_gate) if k > 0 else None
        lookup = k == 0 and rq.policy.gate
        # (a probe keeps the model draft: it is there to measure the model draft's acceptance)
        if lookup or (gate is not None and rq.k > 0 and self.lookup is not self.draft and not moving):
            lk, lk_ms, lk_gate = self._lookup(rq, seq, remaining)
            lookup = lookup or use_lookup(lk, lk_gate, gate, self.alpha.value)
            if lookup:
                plan.drafts, plan.draft_ms, gate = lk, lk_ms, lk_gate
                plan.source = "lookup" if lk else ""
        if k > 0 and not lookup:
            plan.setup_ms = self.draft.prepare()
            prop = self.draft.propose(seq, gate.k_max if gate else k, gate, match)
            plan.drafts, plan.draft_ms = prop.tokens, prop.ms
            plan.catchup_tokens, plan.catchup_ms = prop.catchup_tokens, prop.catchup_ms
            plan.fed, plan.forwards, plan.forward_ms = prop.fed, len(prop.tokens), prop.forward_ms
            plan.prefill, plan.q_logits = prop.prefill, prop.q_logits
            plan.source = "draft" if prop.tokens else ""
            if gate is not None and plan.drafts:
                plan.drafts = plan.drafts[: gate.verify_length(len(plan.drafts))]
                if plan.q_logits is not None:
                    plan.q_logits = plan.q_logits[: len(plan.drafts)]
            if prop.prefill is not None and self.profile is not None and prop.prefill.ms > 0 \
                    and not self.shared(rq.rid):
                h = prop.prefill          # the draft's prompt prefill, as paid in a request
                self.profile.observe("D", self.profile.D(len(rq.ids) - h.hit.usable), h.ms)
        plan.gate = gate
        if lookup and not plan.drafts:
            plan.source = ""
        if copy:
            self.copy_skipped = 0
            plan.plan_ms = (now() - tp) * 1e3
        return plan

    # ------------------------------------------------------------------ the outcome
    def told(self, rq, plan: RoundPlan, accepted: int, emitted: int, verify_ms: float, round_ms: float,
             ctx: int) -> float:
        """Learn from the verified round; returns the exploration ms it spent (a probe's excess)."""
        m, a, gate, lookup = len(plan.drafts), accepted, plan.gate, plan.lookup
        shared = self.batch is not None and self.shared(rq.rid)
        if self.batch is not None:
            self.batch.told(rq.rid, m + 1, emitted, m if m and rq.draft_model and not (lookup or plan.copy) else 0)
            if rq.rid in self.batch.alpha and self.batch.move_due(1):      # (read only where the move is made)
                self._joins(rq, ctx)
        if plain_step(plan) and self.controller is not None:
            if plan.copy and not follows_copy(rq):     # (its lookup's cost, for the copy ledger)
                self.copies.observe(0, 0, 0.0, 0.0, plan.plan_ms)
            self.controller.observe_plain(round_ms)
            if not shared:
                self._plain.append((ctx, verify_ms))
            if len(self._plain) >= PLAIN_BATCH:
                self.fold_plain()
            return 0.0
        if plan.source == "draft":
            self.draft.commit(rq.ids + rq.out)
        copied = gate is not None and m > 0 and (lookup or self.lookup is self.draft)   # n-gram copies verified
        if gate is not None and m:
            if copied:                                   # the request's trust in its copies
                for c, ok in judged(gate.confs, m, a):
                    rq.lk_pred += self.lookup_map.p(c)
                    rq.lk_hits += ok
            (self.lookup_map if lookup else self.accept_map).observe(gate.confs[:m], gate.preds[:m], a)
        p = self.profile
        v_m = p.verify(m, ctx) if copied and p is not None else 0.0      # (a copy round with drafts is copied)
        if copied and p is not None and not shared:      # a copy's verify learns its own cost (alone)
            self.lookup_scale = lookup_cost_scale(self.lookup_scale, verify_ms, v_m)
        # (a copied repeat's copies were known in advance: they say nothing of a new prompt's)
        if plan.copy and p is not None and not follows_copy(rq):
            t_ms = p.step(ctx)                           # (its verify at its learned cost, as the gate prices it)
            extra = v_m * self.lookup_scale - t_ms if m else 0.0
            self.copies.observe(m, a, t_ms, extra, plan.plan_ms)
        if self.controller is None:
            self.alpha.update(a, m)
            return 0.0
        # a lookup's acceptance is not the model draft's alpha: the controller sees a k = 0 round
        explore = self.controller.observe_round(0 if lookup else m, a, round_ms, emitted, ctx)
        if shared:
            return explore
        self._observe_costs("spec" if m else "ar", m, ctx, verify_ms, plan.forward_ms, plan.catchup_tokens,
                            rq.draft_model and not lookup, plan.fed, plan.forwards, v_m)
        return explore

    def fold_plain(self) -> None:
        """The plain steps told since the last fold refine the profile's t, in order: one by one
        after each step (Python run cold after a forward) cost a measurable share of a step
        (docs/controller.md)."""
        p = self.profile
        if p is not None:
            for ctx, ms in self._plain:
                p.observe("t", p.step(ctx), ms)
        self._plain.clear()

    def begin(self, rq) -> None:
        """A request's per-request action is set: per-round decisions start from its k."""
        self.last_k = rq.k
        self.lookup_top = lookup_top(self.profile, self.lookup_k, max(rq.k_set))
        self.copy_skipped = COPY_RETRY - 1      # a request's first copy round is tried (a new prompt may copy)

    # ------------------------------------------------------------------ rules of one round
    def _copies_pay(self, rq, ctx: int) -> bool:
        """``copies_pay`` for this round, its expected gain priced only where it decides: alone at
        a lone step's prices, beside other requests at the batch's (``copy_prices``)."""
        led = self.copies
        v = self.batch
        rows_o, tokens_o, n_o = v.others(rq.rid) if v is not None else (0, 0.0, 0)
        n = 1 + n_o
        if copies_tried(self.copy_skipped, led.n, n):
            return True
        if n == 1:
            gain = led.expected()
        elif led.priced is not None and led.priced[0] == (id(v), v.steps):
            gain = led.priced[1]                   # (priced this step by another lane: the same batch)
        else:
            gain = led.expected_at(*copy_prices(batch_pass(self.profile, v.costs, ctx), rows_o, tokens_o))
            led.priced = ((id(v), v.steps), gain)
        return copies_pay(gain, self.copy_skipped, led.n, n)

    def _copy_round(self, rq, k: int, remaining: int) -> bool:
        """Would this round verify n-gram copies under the gate: a k = 0 round's lookup, or a
        round of the request's k with the n-gram draft (a probe is not: it measures the draft)."""
        if not (rq.policy.gate and self.profile is not None and rq.force is None and remaining > 1):
            return False
        return k == 0 or (self.lookup is self.draft and rq.k > 0)

    def _round_k(self, rq, seq: list[int], remaining: int) -> int:
        """This round's k: the request's, a per-round decision, or a priced probe at k = 0."""
        if follows_copy(rq):
            return rq.k
        if rq.per_round:
            return self._decide_round(rq, seq, remaining)
        ctl = self.controller
        if rq.explore and not rq.dropped and not ctl.explore_holds(len(seq), rq.k, remaining):
            rq.dropped = True                      # an explored request whose acceptance says k does not pay
            self.emit(Decision(request_id=rq.rid, round=rq.rounds + 1, action={"reuse": int(rq.reuse), "k": 0},
                               alpha=self.alpha.value, reason="argmin",
                               alpha_star=ctl.round_alpha_star(len(seq), (rq.k,))))
        k_req = 0 if rq.dropped else rq.k if self.k_alone is None else self.k_alone
        if rq.policy.adaptive and rq.has_draft and not rq.explore and self.batch is not None:
            k_b = self._batch_round(rq, seq, remaining, k_req)
            if k_b is not None:
                return k_b
        if not (rq.policy.adaptive and k_req == 0 and rq.has_draft):
            return k_req
        if not ctl.probe_possible(len(seq), remaining, rq.k_set):
            return 0
        td = now()
        behind = self._draft_behind(seq, rq.reuse, rq.draft_model)
        k = ctl.maybe_probe(len(seq), remaining, rq.k_set, behind, rq.draft_model)
        if k:
            self.emit(Decision(request_id=rq.rid, round=rq.rounds + 1, action={"reuse": int(rq.reuse), "k": k},
                               alpha=self.alpha.value, reason="probe",
                               alpha_star=ctl.round_alpha_star(len(seq), rq.k_set),
                               decide_ms=round((now() - td) * 1e3, 4),
                               explore_cost_ms=round(ctl.probe_predicted_ms, 3),
                               explore_balance_ms=round(ctl.explore_balance, 3)))
        return k

    def _decide_round(self, rq, seq: list[int], remaining: int) -> int:
        """Per-round granularity: the controller's k for this round (a Decision when it changes),
        priced by the batch where other requests share the steps (``_batch_k``)."""
        ks_now = self.k_set_now()
        behind = self._draft_behind(seq, rq.reuse, rq.draft_model)
        td = now()
        k_new, reason, costs = self.controller.decide_round(len(seq), remaining, ks_now, behind,
                                                            rq.has_draft, rq.draft_model)
        batch = {}
        if costs and (reason == "argmin" or (reason == "probe" and self.shared(rq.rid))):
            k_new, batch = self._batch_k(rq, len(seq), k_new, costs)      # (no probe in a batch)
            reason = "argmin" if batch else reason
        dms = (now() - td) * 1e3
        self.decide_ms_total += dms
        if reason == "probe" or k_new != self.last_k:
            self.emit(Decision(request_id=rq.rid, round=rq.rounds + 1,
                               candidates=[Candidate(int(rq.reuse), kk, round(v * remaining, 3)).to_dict()
                                           for kk, v in costs.items()],
                               action={"reuse": int(rq.reuse), "k": k_new}, alpha=self.alpha.value,
                               alpha_star=self.controller.round_alpha_star(len(seq), ks_now),
                               reason=reason, decide_ms=round(dms, 4), batch=batch))
        self.last_k = k_new
        return k_new

    def _batch_k(self, rq, ctx: int, k_solo: int, costs: dict, remaining: int | None = None) -> tuple[int, dict]:
        """The round's k when other requests share its steps (``self.batch``, a lane's): the k among
        the controller's candidates at which the whole step emits the most tokens per ms
        (``policy.batch_k``: a pass of all rows W(n), each request's expected tokens); alone, the
        controller's own k. W(n) is the profile's V(n - 1) times what the shared steps measured
        (``BatchView.costs``); a model draft that is behind (its prompt not read yet: it is read
        only once a round drafts) pays that catch-up once over the request's remaining rounds."""
        if self.batch is None:
            return k_solo, {}
        rows_o, tokens_o, n_o = self.batch.others(rq.rid)
        if not n_o:
            return k_solo, {}
        p, a = self.profile, self.alpha.value
        W = batch_pass(p, self.batch.costs, ctx)
        lockstep = self.batch.lockstep
        k_o = self.batch.others_drafting(rq.rid) if lockstep and rq.draft_model else 0
        said = {"requests": n_o, "rows": rows_o, "tokens": round(tokens_o, 3), "k_alone": k_solo,
                **({"drafting_o": k_o} if k_o else {})}
        if self.in_joint_move(rq):        # (the move decides: its own price is not asked, every round)
            K, drafting = self._joint_move(list(costs), ctx, W)
            return (K if rq.rid in drafting else 0), {**said, "joint": len(self.batch.alpha), "K": K}
        remaining = rq.N - len(rq.out) if remaining is None else remaining
        catch_ms, catch_fires = self._catchup_price(rq, ctx)

        def once(j: int) -> float:              # the share of a one-off cost a round of k = j carries
            return E(j, a) / max(1, remaining)

        drafting_o = p.draft_round(k_o, ctx, a) if k_o else 0.0      # (in lockstep: passes this round waits for)
        k = batch_k(list(costs), lambda j: E(j, a), W, rows_o, tokens_o,
                    lambda j: (p.draft_round(j, ctx, a) + catch_ms * once(j)) if rq.has_draft else 0.0,
                    lambda j: (j + catch_fires * once(j)) if rq.draft_model and not lockstep else 0,
                    drafting_o)   # a model draft's forwards: steps of their own, unless the steps run in lockstep
        return k, said

    def in_joint_move(self, rq) -> bool:
        """Is this request's k the batch's joint move now (``_joint_move``)? Then its round drafts
        the move's K, no more (in lockstep every round waits for the longest drafting) and no copy
        replaces the draft."""
        return (self.batch is not None and self.batch.lockstep and rq.rid in self.batch.alpha
                and len(self.batch.alpha) > 1)

    def _joins(self, rq, ctx: int) -> None:
        """Tell the batch this request's part in the joint move: its acceptance and what its draft
        must read before it can draft (its prompt, or what plain rounds skipped), per token left."""
        catch_ms, _ = self._catchup_price(rq, ctx)
        a = self.controller.alpha_ahead if self.controller is not None else self.alpha.value
        self.batch.joins(rq.rid, a, catch_ms / max(1, rq.N - len(rq.out)))

    def _joint_move(self, ks, ctx: int, W) -> tuple[int, frozenset]:
        """The batch's joint move (``policy.joint_move``), made every MOVE_EVERY shared steps (and
        again when a request of it joins or leaves) by the first round that asks and kept by the
        others: every request of the move reads the same one. Its requests tell their part
        (``_joins``) only in the rounds before it is made."""
        v, p = self.batch, self.profile
        if not v.move_due():
            return v.move[1], v.move[2]         # (made lately for the same requests)
        rows_n, tokens_n = v.apart(None)
        a = sum(v.alpha.values()) / len(v.alpha)
        t1 = W(1)
        d = {j: p.draft_round(j, ctx, a) / t1 for j in ks if j > 0}      # (a K's draft passes, once)
        K, drafting, _, _ = joint_move(ks, v.alpha, W, rows_n, tokens_n, lambda j, m: d[j] * W(m),
                                       keep=v.move[1] if v.move is not None else None, sunk=v.sunk)
        v.move = ((v.steps, v.members), K, drafting)
        return K, drafting

    def _catchup_price(self, rq, ctx: int) -> tuple[float, float]:
        """(ms, steps) a model draft must spend reading what it is behind before its next round can
        draft (its prompt, not read yet, or what k = 0 rounds skipped): one prefill, fed a chunk a step."""
        if not rq.draft_model or self.controller is None:
            return 0.0, 0.0
        if rq.pf is None:                 # (deciding the request: the draft holds no state of it yet)
            hd = self.store.peek(self.draft.key, rq.ids) if rq.reuse else None
            behind = len(rq.ids) - (hd.usable if hd is not None else 0)
        else:
            behind = self._draft_behind(rq.ids + rq.out, rq.reuse, rq.draft_model)
        if behind <= 2:
            return 0.0, 0.0
        return self.controller.catchup_ms(behind, True, ctx), float(-(-behind // PREFILL_CHUNK))

    def join(self, rq, choice):
        """A request joins the batch (``self.batch``): it is counted among the requests from now on
        (its first k and the others' are priced by each other), and where others share the steps its
        request-level k is the batch's (``_batch_k``, the same rule alone as the controller's): no
        probe in a batch, where a request's rows are the others' tokens. Returns the batch dict
        (empty when alone or unbatched); ``choice`` is changed in place."""
        self.k_alone = None
        if self.batch is None:
            return {}
        self.batch.join(rq.rid)
        if joins_batch_move(rq, self.batch):
            self._joins(rq, len(rq.ids))
        if choice is None or choice.reason == "forced" or not (rq.policy.adaptive and rq.has_draft) or rq.policy.tree:
            return {}
        if not self.batch.others(rq.rid)[2]:
            return {}
        ks = sorted({k for k in rq.k_set if k == 0 or k <= rq.N - 1})
        k, batch = self._batch_k(rq, len(rq.ids), choice.k, dict.fromkeys(ks or [0], 0.0), rq.N)
        if k != choice.k or choice.reason == "probe":
            self.k_alone = 0 if choice.reason == "probe" else choice.k      # its k if the others leave
            choice.k, choice.reason, choice.explore_ms = k, "argmin", 0.0
        return batch

    def _batch_round(self, rq, seq: list[int], remaining: int, k_req: int) -> int | None:
        """Request granularity in a batch: the request's k re-priced every round while others share
        its steps (their rows change as requests join and leave); None alone."""
        ks = [k for k in self.k_set_now() if k == 0 or k <= remaining - 1]
        if not self.batch.others(rq.rid)[2]:
            if self.last_k != k_req:           # alone again: back to the request's own k
                self.emit(Decision(request_id=rq.rid, round=rq.rounds + 1, action={"reuse": int(rq.reuse), "k": k_req},
                                   alpha=self.alpha.value, reason="argmin",
                                   alpha_star=self.controller.round_alpha_star(len(seq), tuple(ks))))
                self.last_k = k_req
            return None
        k, batch = self._batch_k(rq, len(seq), k_req, dict.fromkeys(ks or [0], 0.0))
        if k != self.last_k:
            self.emit(Decision(request_id=rq.rid, round=rq.rounds + 1, action={"reuse": int(rq.reuse), "k": k},
                               alpha=self.alpha.value, reason="argmin",
                               alpha_star=self.controller.round_alpha_star(len(seq), tuple(ks)), batch=batch))
            self.last_k = k
        return k

    def shared(self, rid: int) -> bool:
        """Do other requests share this request's steps now? (Its forwards then wait for theirs:
        their ms are the batch's, learned as W(n) by the pool, not this request's t or V(k).)"""
        return self.batch is not None and bool(self.batch.others(rid)[2])

    def end_request(self, rid: int) -> None:
        """A request left: its rows no longer share the batch's steps."""
        if self.batch is not None:
            self.batch.leave(rid)

    def _gate(self, rq, seq: list[int], k: int) -> RoundGate | None:
        """The round's confidence gate (policy adaptive:gate and a cost profile), else None."""
        p = self.profile
        if not (rq.policy.gate and p is not None and k > 0):
            return None
        ctx = len(seq)
        amap = self.accept_map
        if self.lookup is self.draft:      # an n-gram draft: this request's judged copies scale the map
            amap = Trusted(amap, request_trust(rq.lk_hits, rq.lk_pred))
        if self.in_joint_move(rq) and rq.draft_model:
            return self._move_gate(rq, amap, k, ctx)
        behind = self._draft_behind(seq, rq.reuse, rq.draft_model)
        over = self.lookup_scale if self.lookup is self.draft else 1.0      # an n-gram draft verifies copies
        return RoundGate(amap, k, p.draft_step(ctx) if rq.draft_model else 0.0, p.verifies(k, ctx, over),
                         sunk=self.controller.catchup_ms(behind, rq.draft_model, ctx))

    def _move_gate(self, rq, amap, k: int, ctx: int) -> RoundGate | None:
        """A round of the joint move's gate. Beside the move's other drafting requests, none
        (``cut_beside_drafting``); drafting alone, priced by the batch's step as ``_batch_gate``: a
        drafted row must earn the batch's rate, V[j] = W(rows_o + 1 + j) against the tokens the step
        gives without it, each draft token a pass of its own."""
        drafting = self.batch.move[2] if self.batch.move is not None else frozenset()
        if not cut_beside_drafting(drafting - {rq.rid}):
            return None
        return self._batch_gate(rq, amap, k, ctx, self.profile.draft_step(ctx))

    def copy_top(self, k_set) -> int:
        """The longest copy a gated round verifies for a request of K = ``k_set`` (``_k_top`` of the
        lookup, before the request begins): what the request-level prediction prices a copy round at."""
        top = max(k_set)
        return max(top, lookup_top(self.profile, self.lookup_k, top))

    def _k_top(self, rq, source) -> int:
        """The longest draft a gated round may verify: max(K), or lookup_top for n-gram lookup."""
        top = max(rq.k_set)
        return max(top, self.lookup_top) if source.copies else top

    def _lookup(self, rq, seq: list[int], remaining: int) -> tuple[list[int], float, RoundGate | None]:
        """A k = 0 round under the gate: the n-gram continuation costs ~nothing to look up, so verify
        the part of it whose expected tokens per ms beat a plain step (often none)."""
        p = self.profile
        k_max = min(self._k_top(rq, self.lookup), remaining - 1)
        if not (rq.policy.gate and p is not None and rq.force is None and k_max >= 1):
            return [], 0.0, None
        amap = Trusted(self.lookup_map, request_trust(rq.lk_hits, rq.lk_pred))
        gate = self._batch_gate(rq, amap, k_max, len(seq)) if self.shared(rq.rid) else None
        if gate is None:
            gate = RoundGate(amap, k_max, 0.0, p.verifies(k_max, len(seq), self.lookup_scale))
        prop = self.lookup.propose(seq, k_max, gate)
        if not prop.tokens:
            return [], prop.ms, None
        return prop.tokens[: gate.verify_length(len(prop.tokens))], prop.ms, gate

    def _batch_gate(self, rq, amap, k_max: int, ctx: int, d: float = 0.0) -> RoundGate | None:
        """A round's gate beside other requests (a k = 0 round's lookup; ``d`` > 0: a model draft's
        tokens, a pass each): V[j] the whole step's pass W(rows_o + 1 + j), base the tokens that step
        gives without the drafts (``RoundGate``): a drafted row must earn the batch's rate (4 lanes of
        1 row: about 3x a lone step's), not a lone step's."""
        rows_o, tokens_o, n_o = self.batch.others(rq.rid)
        if not n_o:
            return None
        W = batch_pass(self.profile, self.batch.costs, ctx)
        return RoundGate(amap, k_max, d, BatchVerifies(W, rows_o, k_max), base=1.0 + tokens_o)

    def _draft_behind(self, seq, reuse, draft_model) -> int:
        """Tokens a model draft must read before it can draft after ``seq`` (its catch-up)."""
        if not draft_model:
            return 0
        if self.draft.cache is not None:
            return len(seq) - len(self.draft.cached)
        # the draft has not seen the prompt yet: its prefill (minus a cached prefix) is due
        hd = self.store.peek(self.draft.key, self.draft.prompt) if (reuse and self.draft.reuse) else None
        return len(seq) - (hd.usable if hd is not None else 0)

    def _observe_costs(self, kind, m, ctx, verify_ms, draft_ms, catch_tok, draft_model, fed=1, n_fwd=0,
                       v_m: float = 0.0) -> None:
        """Refine the profile from one round: t from a plain step; a speculative round of m as one
        term R{m}, its draft forwards (``draft_ms``: ``n_fwd`` of them, the first reading ``fed`` =
        1 or 2 tokens, the prompt's prefill left out) and verify together. A model draft's round
        that caught up first is not a round of m: skipped."""
        p = self.profile
        if kind == "ar":
            p.observe("t", p.step(ctx), verify_ms)
        elif not draft_model:
            p.observe(f"R{m}", v_m or p.verify(m, ctx), verify_ms)     # (v_m: V(m) as told() priced it)
        elif catch_tok == 0 and n_fwd > 0:
            p.observe(f"R{m}", p.round_forwards(m, ctx, n_fwd, fed), draft_ms + verify_ms)

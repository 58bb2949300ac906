"""The measured-cost controller (RAKV-ASD): pick (r, k) by the argmin of predicted latency.

    E_k(alpha) = (1 - alpha^(k+1)) / (1 - alpha)       (k+1 at alpha = 1; E_0 = 1)
    C(0, r)    = T_pf(P - hit_r) + N * t
    C(k, r)    = T_pf(P - hit_r) + D_pf(P - hitd_r) + (N / E'_k(alpha) + eps_k(alpha)) * (k d + alpha^k (d2 - d) + V(k))

An action that copies an exact repeat's earlier output (``copy_length``: r = 1, the history holds
it, the gate or an n-gram draft copies) is priced as the engine serves it (``copy_cost``): no prompt
forward, one verify a copy round, no draft. E'_k takes acceptance by draft position (``E_shaped``),
eps_k is the last round's cut (``overshoot``), d2 the draft's 2-token step. Where to find the rules:

  * when it reuses:  ``feasible`` (the budget), ``prefer_reuse`` (r = 1 wins a near-tie);
  * when it drafts:  ``Controller.decide`` (argmin), ``spec_or_plain`` (a margin over k = 0),
                     ``copy_alpha`` (an exact repeat the n-gram lookup will copy);
  * when it probes:  ``Controller.maybe_probe`` (due, could pay, alpha's optimistic bound reaches
                     the crossover, the exploration balance covers the excess);
  * when it explores a request: ``Controller.explore_request`` (its expected excess at most what it
                     teaches the next EXPLORE_HORIZON requests), ``explore_holds`` (when it stops);
  * what it learns:  ``AlphaEWMA`` (per round), ``alpha_req`` (per request: the long run plus the
                     measured persistence of recent deviations), ``shape`` (by draft position):
                     ``rakv.decide.learned``; the pure maths (E_k, alpha*, the margins):
                     ``rakv.decide.policy``.

The constants have one line each; the measurements that set them are in
docs/controller.md#constants.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

from ..config import LOOKUP_K
from ..records import Candidate
from .learned import OUT_DECAY, PRIOR_TRIALS, Acceptance
from .policy import (SPEC_MARGIN, E, E_shaped, crossover, explore_value, gh_nodes, learnt_sd, overshoot,
                     prefer_reuse, round_crossover, round_draft_ms, spec_or_plain)
from .profile import CostProfile

now = time.perf_counter
EXPLORE_SHARE = 0.005  # probes may spend this share of the stream's measured time
PROBE_CTX_BUCKET = 16  # probe candidates are recomputed when the context moves by this many tokens
COPY_ALPHA = 0.99     # acceptance of an exact repeat whose earlier output the n-gram lookup copies
EXPLORE_HORIZON = 4.0  # what an explored request teaches is counted for this many later requests like it


def copy_alpha(s: "Situation", alpha: float) -> float:
    """An exact repeat whose earlier output the n-gram lookup will copy accepts nearly every draft:
    greedy decoding of the same prompt gives the same output (docs/controller.md#constants)."""
    return COPY_ALPHA if s.copy else alpha


SCALE_NOTED = 0.1     # an online cost scale this far from 1 is shown: past a calibrated term's usual spread


def moved_scales(profile: CostProfile, copy_scale: float = 1.0) -> dict:
    """The online cost scales that now correct the profile's terms by more than SCALE_NOTED (the
    round records disagreed with it): the machine factor, a term's own scale, and a copy verify's
    learned cost; what the prediction stands on beside calibration, so the explorer shows it."""
    out = {k: round(v, 3) for k, v in sorted(profile.scale.items()) if abs(math.log(max(v, 1e-9))) > math.log1p(SCALE_NOTED)}
    if abs(math.log(max(copy_scale, 1e-9))) > math.log1p(SCALE_NOTED):
        out["copy verify"] = round(copy_scale, 3)
    return out


def copy_length(s: "Situation", r: int, k: int) -> int:
    """How many tokens one round of action (r, k) copies on an exact repeat whose earlier output
    the history holds (0: the action does not copy): with r = 1 the lookup reads the history; a
    gated round takes the whole copy the gate allows (a k = 0 round's lookup, and a drafting round's
    lookup beats its model draft at the copy's acceptance), an ungated one its draft's k copies
    only where the draft is the n-gram lookup."""
    if not (s.copy and r == 1):
        return 0
    if s.gate:
        return max(k, s.copy_run)
    return k if s.draft_copies else 0


def copy_through_draft(best: Candidate, feas: list[Candidate], s: "Situation") -> Candidate:
    """An n-gram draft copies (an exact repeat, or gated copy rounds) through its own rounds at any
    k > 0, priced alike: take the largest such k of the chosen r (its copies are then its drafts,
    as a fixed joint:k counts them); a model draft's copy stays at k = 0 (the gate's lookup copies
    without waking the draft)."""
    if not (s.draft_copies and (copy_length(s, best.reuse, best.k) or gated_copies(s, best.k))):
        return best
    tied = [c for c in feas if c.reuse == best.reuse and c.k > 0 and c.predicted_ms <= best.predicted_ms]
    return max(tied, key=lambda c: c.k) if tied else best


def gated_copies(s: "Situation", k: int) -> bool:
    """Are action k's rounds on a new prompt gated copy rounds, priced from the copy ledger: a
    k = 0 round under the gate looks up n-gram copies, and so does every round of an n-gram
    draft (its k only bounds what the gate already bounds); only with measured evidence."""
    return s.gate and s.copy_emit > 0 and (k == 0 or s.draft_copies)


def copy_rounds(L: int, run: int) -> list[int]:
    """The verify lengths of the rounds that copy an output of L tokens (the first comes from the
    prefill), ``run`` at most a round: each round verifies what it copies plus the pending token
    and emits one more than it copies; the last copies what is left (0: a plain step)."""
    out, left = [], L - 1
    while left > 0:
        j = min(run, left - 1)
        out.append(j)
        left -= j + 1
    return out


@dataclass
class Situation:
    """What the controller knows when deciding for one request."""

    P: int                      # prompt tokens
    N: int                      # max new tokens
    q: int = 0                  # target hit (LCP) if reused
    exact: bool = False         # exact repeat with stored logits
    qd: int = 0                 # draft hit
    exact_d: bool = False
    entry_bytes: int = 0        # target prompt KV + logits
    draft_entry_bytes: int = 0  # draft prompt KV
    budget: int = 0
    has_draft: bool = True
    draft_model: bool = True    # False for ngram (D_pf = 0)
    copy: bool = False          # an exact repeat whose whole earlier output the n-gram lookup will copy
    copy_tokens: int = 0        # ... that output's length (capped at N; 0: unknown, take N)
    gate: bool = False          # rounds are gated: a k = 0 round looks up n-gram copies, a drafting one may take them
    copy_run: int = 0           # the longest copy a gated round verifies (the planner's lookup_top)
    copy_scale: float = 1.0     # a copy verify's learned ms over the profile's V(j) (the planner's lookup_scale)
    draft_copies: bool = False  # the draft itself is the n-gram lookup (its rounds of k copy)
    copy_gain: float = 0.0      # a gated copy round's measured net gain over a plain step (ms; the copy ledger)
    copy_emit: float = 0.0      # ... and the tokens it emits (0: no evidence, copies not priced)


@dataclass
class Choice:
    reuse: int
    k: int
    predicted_ms: float
    candidates: list[Candidate]
    alpha: float
    alpha_star: dict
    reason: str = "argmin"
    decide_ms: float = 0.0
    copy: bool = False
    explore_ms: float = 0.0     # an explored request's expected cost over the best k = 0 action
    passes: float | None = None  # the chosen action's predicted target forwards after the prefill


class Controller(Acceptance):
    def __init__(self, profile: CostProfile, k_set=(0, 1, 2, 4, 6, 8), lam: float = 0.3,
                 probe_every: int = 8, alpha_prior: float | None = None, req_decay: float = 0.3,
                 out_decay: float = OUT_DECAY, explore_share: float = EXPLORE_SHARE):
        self.k_set = tuple(sorted(set(k_set)))
        k_top = max(self.k_set + (LOOKUP_K,))     # (a gated n-gram round may verify up to lookup_k)
        self._init_learned(profile, alpha_prior, lam, req_decay, out_decay, k_top)
        self.probe_every = probe_every
        self.rounds_since_draft = 0
        self.explore_share = explore_share
        self.earned_ms = 0.0         # explore_share x measured stream time
        self.spent_ms = 0.0          # probes' measured cost beyond the plain steps they replaced
        self._probe: tuple[int, float] | None = None     # (k, predicted excess ms) of a pending probe
        self._explore: tuple[dict, float] | None = None   # an explored request's C_k(alpha) by action and its k = 0 cost
        self._pk_key, self._pk = None, []                 # probe_ks's cache (per acceptance estimate)
        self._can_key, self._can = None, []               # ... the k that pay at all (per context bucket)
        self._ksb_key, self._ksb = None, ()               # ks_below's cache
        self._quiet = (0, 0, None)                        # (from, below, K): no probe in that context (nothing pays)

    def use_setting(self, key: str, prior: float) -> None:
        if key != self.setting:
            super().use_setting(key, prior)
            self._pk_key = None         # probe_ks's cache was made for the other setting's acceptance

    # ------------------------------------------------------------------ costs
    def hit_tokens(self, s: Situation, r: int) -> tuple[int, int]:
        if r == 0:
            return 0, 0
        hit = s.P if s.exact else max(0, s.q - 1)
        hitd = s.P if s.exact_d else max(0, s.qd - 1)
        return hit, hitd

    def cost(self, s: Situation, r: int, k: int, alpha: float) -> float:
        return self.cost_of_alpha(s, r, k)(alpha)

    def cost_of_alpha(self, s: Situation, r: int, k: int, shape: list[float] | None = None):
        """C(k, r) as a function of alpha, its alpha-free terms read once (alpha* searches over it);
        ``shape``: this decision's ``self.shape``, made once for all its actions."""
        p = self.profile
        hit, hitd = self.hit_tokens(s, r)
        if copy_length(s, r, k):
            c = self.copy_cost(s, r, k)
            return lambda alpha: c
        n = max(0, s.N - 1) * self.out_frac
        ctx = s.P + s.N / 2
        c = p.T(s.P - hit)
        if r == 1 and not s.exact:
            c += p.clone_ms_per_token * s.P
        if gated_copies(s, k):
            # n plain steps, less each copy round's measured net gain over a step (n / copy_emit rounds)
            c += n * p.step(ctx) - n / s.copy_emit * s.copy_gain
            return lambda alpha: c
        if k == 0:
            c += n * p.step(ctx)
            return lambda alpha: c
        if s.draft_model:
            c += p.D(s.P - hitd)
        d, d2x, v = p.round_terms(k, ctx)
        last = min(1.0, n)            # a request with decode rounds pays its last round's cut once
        sh = self.shape if shape is None else shape
        return lambda alpha: c + (n / E_shaped(k, alpha, sh) + last * overshoot(k, alpha)) * (round_draft_ms(k, alpha, d, d2x) + v)

    def copy_cost(self, s: Situation, r: int, k: int) -> float:
        """An action that copies an exact repeat's earlier output: the prompt costs nothing (stored
        logits), each copy round one verify of what it copies at the copy's learned cost, and no
        draft runs (no draft prefill): the engine's copy path, priced round by round."""
        p = self.profile
        hit, _ = self.hit_tokens(s, r)
        ctx = s.P + s.N / 2
        c = p.T(s.P - hit)
        for j in copy_rounds(self.copy_output(s), copy_length(s, r, k)):
            c += p.verify(j, ctx) * s.copy_scale if j else p.step(ctx)
        return c

    def copy_output(self, s: Situation) -> int:
        """The tokens a copied exact repeat emits: its earlier output, as long as it was (to N)."""
        return min(s.N, s.copy_tokens) if s.copy_tokens > 0 else s.N

    def passes(self, s: Situation, r: int, k: int, alpha: float) -> float:
        """Target forwards after the prefill that action (r, k) is predicted to take: a copy's rounds,
        the plain steps of k = 0, or the rounds of k at the expected tokens a round."""
        j = copy_length(s, r, k)
        if j:
            return float(len(copy_rounds(self.copy_output(s), j)))
        n = max(0, s.N - 1) * self.out_frac
        if gated_copies(s, k):
            return n / s.copy_emit
        return n if k == 0 else n / E_shaped(k, alpha, self.shape) + min(1.0, n) * overshoot(k, alpha)

    def feasible(self, s: Situation, r: int, k: int) -> tuple[bool, str]:
        if k > 0 and not s.has_draft:
            return False, "no draft source"
        if r == 1:
            need = s.entry_bytes + (s.draft_entry_bytes if k > 0 and s.draft_model else 0)
            if need > s.budget:
                return False, f"prompt KV {need / 2**20:.2f} MiB > budget {s.budget / 2**20:.2f} MiB"
        return True, ""

    def request_alpha_star(self, s: Situation, r: int, k: int, costs: dict | None = None) -> float | None:
        """Smallest alpha with C(k, r) <= C(0, r) (C(k) falls as alpha rises): ``policy.crossover``;
        ``costs``: the decision's C(k, r) of alpha by (r, k), made once."""
        costs = costs or {}
        c0 = (costs.get((r, 0)) or self.cost_of_alpha(s, r, 0))(0.0)
        ck = costs.get((r, k)) or self.cost_of_alpha(s, r, k)
        return crossover(lambda a: ck(a) - c0)

    # ------------------------------------------------------------------ decisions
    def decide(self, s: Situation, k_set=None, force: tuple[int, int] | None = None) -> Choice:
        t0 = now()
        ks = tuple(sorted(set(k_set if k_set is not None else self.k_set)))
        a = self.alpha_req       # (a copying action is priced by its copy rounds, not at an acceptance)
        self._copy = s.copy
        cands: list[Candidate] = []
        best = None
        fns = {}
        sh = self.shape
        for r in (0, 1):
            for k in ks:
                ok, why = self.feasible(s, r, k)
                fns[r, k] = self.cost_of_alpha(s, r, k, sh)
                cands.append(Candidate(reuse=r, k=k, predicted_ms=round(fns[r, k](a), 3), feasible=ok, reason=why))
        # argmin over feasible actions; r = 1 wins a near-tie, before and after the spec margin
        feas = [c for c in cands if c.feasible]
        best = min(feas, key=lambda c: c.predicted_ms) if feas else None
        if best is not None:
            best = prefer_reuse(best, feas)
            if best.k > 0:
                best = prefer_reuse(spec_or_plain(best, [c for c in feas if c.k == 0]), feas)
            best = copy_through_draft(best, feas, s)
        reason, explore_ms = "argmin", 0.0
        self._explore = None
        if best is not None and best.k == 0 and force is None and s.has_draft and not s.copy:
            found = self.explore_request(feas, best, fns, s.N)
            if found is not None:
                best, explore_ms = found
                reason = "probe"
        if force is not None:
            fr, fk = force
            forced = next((c for c in cands if c.reuse == fr and c.k == fk), None)
            if forced is None:
                ok, why = self.feasible(s, fr, fk)
                forced = Candidate(fr, fk, round(self.cost(s, fr, fk, a), 3), ok, why)
                cands.append(forced)
            best, reason = forced, "forced"
        if best is None:    # nothing feasible (cannot happen: (0, 0) is always feasible)
            best = Candidate(0, 0, self.cost(s, 0, 0, a))
        r = best.reuse
        stars = {str(k): self.request_alpha_star(s, r, k, fns) for k in ks if k > 0}
        copying = bool(copy_length(s, best.reuse, best.k))
        self._copy = copying      # a copied request's acceptance is known in advance: not alpha evidence
        return Choice(best.reuse, best.k, best.predicted_ms, cands, copy_alpha(s, a) if copying else a, stars, reason,
                      (now() - t0) * 1e3, copying, round(explore_ms, 3), round(self.passes(s, best.reuse, best.k, a), 2))

    def explore_request(self, feas: list[Candidate], best: Candidate, fns: dict, s_N: int) -> tuple[Candidate, float] | None:
        """Draft this request although the argmin says k = 0, when what it teaches is worth its
        expected cost (value of information). alpha ~ normal(alpha_req, alpha_sd); a drafting
        action's expected cost here is E[C_k(alpha)] (its draft prefill and catch-up included: they
        are paid once a request, not a probe's lump); what the request teaches is worth, to each of
        EXPLORE_HORIZON later requests like it, E[max(0, C_0 - min_k C_k(alpha'))] over the estimate
        alpha' after this request's expected trials (the knowledge gradient: a settled estimate is
        barely moved by one more request, an unsure one a lot). Explore with the drafting action of
        least expected cost iff that cost over C_0 is at most the value. Nothing is computed past one
        comparison per action unless alpha's optimistic bound makes some action beat C_0 by the
        spec margin (where no k pays even at alpha = 1, never). C_0 is taken less the spec margin
        throughout, as the argmin takes it (drafting's predictions run optimistic)."""
        drafting = [c for c in feas if c.k > 0]
        if not drafting:
            return None
        b0 = best.predicted_ms * (1 - SPEC_MARGIN)      # what drafting must beat (as in spec_or_plain)
        a_hi = self.alpha_upper()
        if all(fns[c.reuse, c.k](a_hi) >= b0 for c in drafting):
            return None
        a = self.alpha_req
        nodes = gh_nodes(a, self.alpha_sd())
        dfns = {(c.reuse, c.k): fns[c.reuse, c.k] for c in drafting}
        expected = {key: sum(w * f(al) for al, w in nodes) for key, f in dfns.items()}
        key = min(expected, key=expected.get)
        excess = expected[key] - b0
        n = max(0, s_N - 1) * self.out_frac
        m = n / E(key[1], a) * (E(key[1], a) - a ** key[1])       # the trials this request would add
        learnt = gh_nodes(a, learnt_sd(a, self.evidence + PRIOR_TRIALS, m))
        if excess > EXPLORE_HORIZON * explore_value(dfns, b0, learnt):
            return None
        self._explore = (dfns, b0)
        pick = prefer_reuse(next(c for c in drafting if (c.reuse, c.k) == key), feas)
        return pick, max(0.0, excess)

    def decide_round(self, ctx: int, remaining: int, k_set=None, catchup_tokens: int = 0,
                     has_draft: bool = True, draft_model: bool = True) -> tuple[int, str, dict]:
        """Per-round k: minimise expected ms per token over the allowed k (r is already fixed)."""
        p = self.profile
        ks = sorted(set(k_set if k_set is not None else self.k_set))
        a = self.alpha.value
        # a catch-up past the 2-token step (which draft_round prices every round) is paid once
        catch = self.catchup_ms(catchup_tokens, draft_model, ctx) if catchup_tokens > 2 else 0.0
        costs = {}
        for k in ks:
            if k == 0:
                costs[0] = p.step(ctx)
            elif has_draft and k <= max(0, remaining - 1):
                per_round = p.draft_round(k, ctx, a) + p.verify(k, ctx)
                # spread a catch-up over the rounds left, as it is paid once
                rounds_left = max(1.0, remaining / E(k, a))
                costs[k] = (per_round + catch / rounds_left) / E(k, a)
        if not costs:
            return 0, "argmin", costs
        k = min(costs, key=costs.get)
        if k == 0 and has_draft:
            kp = self.maybe_probe(ctx, remaining, ks, catchup_tokens, draft_model)
            if kp:
                return kp, "probe", costs
        return k, "argmin", costs

    def catchup_ms(self, catchup_tokens: int, draft_model: bool = True, ctx: float | None = None) -> float:
        """Predicted extra cost of a model draft's first forward when it reads the ``catchup_tokens``
        it is behind, over the one draft step a round already counts: 1 is a normal round, 2 (after
        a fully accepted round) its 2-token step, more a prefill of what it missed."""
        if not draft_model or catchup_tokens <= 1:
            return 0.0
        p = self.profile
        d, d2x = p.draft_terms(p.V_ctx if ctx is None else ctx)
        return d2x if catchup_tokens == 2 else max(0.0, p.D(catchup_tokens) - d)

    # ------------------------------------------------------------------ exploration
    def explore_holds(self, ctx: float, k: int, remaining: int) -> bool:
        """An explored request keeps drafting while the rule that explored it still holds, taken
        again with what is sunk left out (the draft's prompt prefill) and the request's trials folded
        into alpha: the expected cost of drafting the ``remaining`` tokens at k over plain steps (less
        the spec margin) is at most what the request still teaches (``explore_value``). Judged only
        from PRIOR_TRIALS trials on: two early rejections at a true 0.9 (1 in 100) had stopped it."""
        if self._explore is None or self._req_T < PRIOR_TRIALS:     # not judged on fewer trials than the prior's weight
            return True
        p = self.profile
        n0 = max(0.0, self.evidence - self._req_T) + PRIOR_TRIALS      # (evidence already counts them)
        n = n0 + self._req_T
        a = (self.alpha_req * n0 + self._req_S) / n
        nodes = gh_nodes(a, math.sqrt(max(a * (1 - a), 0.01) / n))
        d, d2x, v = p.round_terms(k, ctx)
        rest0 = remaining * p.step(ctx) * (1 - SPEC_MARGIN)
        restk = sum(w * ((remaining / E(k, al) + overshoot(k, al)) * (round_draft_ms(k, al, d, d2x) + v))
                    for al, w in nodes)
        fns, b0 = self._explore
        m = sum(w * remaining / E(k, al) * (E(k, al) - al ** k) for al, w in nodes)   # trials still to come
        learnt = gh_nodes(a, learnt_sd(a, n, m))
        return restk - rest0 <= EXPLORE_HORIZON * explore_value(fns, b0, learnt)

    @property
    def probe_due(self) -> bool:
        return self.rounds_since_draft >= self.probe_every

    @property
    def explore_balance(self) -> float:
        return self.earned_ms - self.spent_ms

    def earn(self, ms: float) -> None:
        """Every measured millisecond of the stream earns its share of exploration."""
        if ms > 0:
            self.earned_ms += self.explore_share * ms

    def pays_at_all(self, k: int, ctx: float) -> bool:
        """Could k beat plain steps at alpha = 1? If not, probing k can teach nothing useful."""
        p = self.profile
        return p.draft_round(k, ctx, 1.0) + p.verify(k, ctx) < (k + 1) * p.step(ctx)

    def probe_ks(self, ctx: float, ks) -> list[int]:
        """The k that could pay at all and whose crossover alpha's optimistic bound reaches: the
        candidates of a probe. Cached per 16 tokens of context and per acceptance estimate (it is
        asked every k = 0 round once a probe is due; recomputing it cost a share of a step)."""
        where = (int(ctx) // PROBE_CTX_BUCKET, tuple(ks))
        if where != self._can_key:
            self._can_key, self._can = where, [k for k in ks if k > 0 and self.pays_at_all(k, ctx)]
            self._pk_key = None
        if not self._can:                 # nothing pays even at alpha = 1 (a draft slower than the target)
            return self._can
        a, a_hi = self.alpha_req, self.alpha_upper()
        if (a, a_hi) != self._pk_key:
            stars = self.round_alpha_star(ctx, self._can)
            self._pk_key = (a, a_hi)
            self._pk = [k for k in self._can if stars.get(str(k)) is not None and stars[str(k)] <= a_hi]
        return self._pk

    def probe_plan(self, ctx: float, ks, catch_ms: float) -> tuple[int, float] | None:
        """The probe worth most (expected trials per ms of excess), or None if none is worth it."""
        p = self.profile
        t = p.step(ctx)
        a = self.alpha_req
        best = None
        for k in self.probe_ks(ctx, ks):
            excess = catch_ms + p.draft_round(k, ctx, 0.0) + p.verify(k, ctx) - E(k, a) * t
            info = E(k, a) - (a ** k)          # expected trials: accepted drafts + a rejection
            score = info / max(excess, 0.05 * t)
            if best is None or score > best[0]:
                best = (score, k, max(0.0, excess))
        return None if best is None else (best[1], best[2])

    def probe_possible(self, ctx: int, remaining: int, k_set=None) -> bool:
        """Cheap test before pricing a probe (the engine then measures the draft's catch-up)."""
        lo, hi, quiet_ks = self._quiet
        if lo <= ctx < hi and k_set is quiet_ks:
            return False
        if self._copy:      # a copied repeat: its rounds copy as priced; a probe measures nothing it can use
            return False
        if not self.probe_due or remaining <= 2 or self.explore_balance <= 0:
            return False
        ks = self.ks_below(k_set, remaining)
        found = self.probe_ks(ctx, ks)
        if not self._can and k_set is not None and ks and ks[-1] == max(k_set):
            self.quiet_until_next_bucket(ctx, k_set)
        return bool(found)

    def quiet_until_next_bucket(self, ctx: float, k_set) -> None:
        """No k of K pays even at alpha = 1 in this context bucket: until the next one, a k = 0
        round's probe check is one comparison (any Python after a forward runs cold: the full check
        cost a share of a step, docs/controller.md#constants)."""
        lo = int(ctx) // PROBE_CTX_BUCKET * PROBE_CTX_BUCKET
        self._quiet = (lo, lo + PROBE_CTX_BUCKET, k_set)

    def ks_below(self, k_set, remaining: int) -> tuple:
        """The k > 0 of K (default: the controller's) that fit in ``remaining - 1`` tokens, kept
        while K and the cut stay (a k = 0 round asks every round)."""
        ks = k_set if k_set is not None else self.k_set
        key = (ks, min(remaining - 1, max(ks, default=0)))
        if key != self._ksb_key:
            self._ksb_key, self._ksb = key, tuple(kk for kk in sorted(set(ks)) if 0 < kk <= remaining - 1)
        return self._ksb

    def maybe_probe(self, ctx: int, remaining: int, k_set=None, catchup_tokens: int = 0,
                    draft_model: bool = True) -> int:
        """For a round that will not draft although a draft is there: the k of a probe round if
        one is due, worth it and affordable (else 0). ``catchup_tokens`` matters only when due."""
        if not self.probe_possible(ctx, remaining, k_set):
            return 0
        ks = list(self.ks_below(k_set, remaining))
        plan = self.probe_plan(ctx, ks, self.catchup_ms(catchup_tokens, draft_model, ctx))
        if plan is None or plan[1] > self.explore_balance:
            return 0
        self._probe = plan
        return plan[0]

    @property
    def probe_predicted_ms(self) -> float:
        return self._probe[1] if self._probe else 0.0

    def round_alpha_star(self, ctx: int, k_set=None) -> dict:
        """Per-round crossover: smallest alpha with (draft(k) + V(k)) / E_k(alpha) <= t, per k."""
        p = self.profile
        t = p.step(ctx)
        out = {}
        for k in sorted(set(k_set if k_set is not None else self.k_set)):
            if k == 0:
                continue
            d, d2x, v = p.round_terms(k, ctx)
            a = round_crossover(k, t, v, d, d2x)
            out[str(k)] = None if a is None else round(a, 4)
        return out

    def observe_round(self, drafted: int, accepted: int, round_ms: float = 0.0, emitted: int = 0,
                      ctx: float = 0.0) -> float:
        """Fold one round in; returns the exploration it spent (ms; 0 unless it was a probe)."""
        if drafted <= 0:
            self.observe_plain(round_ms)
            return 0.0
        spent = 0.0
        self._learn_round(drafted, accepted)
        self.rounds_since_draft = 0
        if self._probe is not None and round_ms > 0:
            spent = round_ms - max(1, emitted) * self.profile.step(ctx)
            self.spent_ms += spent
        self.earn(round_ms)
        self._probe = None
        return spent

    def observe_plain(self, round_ms: float) -> None:
        """A round that verified no drafts: one more round since the last draft; its time earns
        exploration."""
        self.rounds_since_draft += 1
        self.earn(round_ms)
        self._probe = None


def choice_to_dict(c: Choice) -> dict:
    return {"candidates": [asdict(x) for x in c.candidates], "action": {"reuse": c.reuse, "k": c.k},
            "alpha": c.alpha, "alpha_star": c.alpha_star, "reason": c.reason}

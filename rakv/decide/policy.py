"""The decision's pure maths: no state, no profile object, no I/O (gpt-fast sized).

    E_k(alpha)        = (1 - alpha^(k+1)) / (1 - alpha)        expected tokens of a round of k drafts
    E'_k(alpha, s)    the same with acceptance by draft position (``E_shaped``)
    alpha*            the smallest alpha at which a drafting action costs no more than plain
                      steps (``crossover`` of its falling excess; ``alpha_star`` per round of k
                      from V(0..k), d and d2; ``root_falling`` finds the root)
    round_draft_ms    a round's expected draft ms (its 2-token opening step after a full accept)
    worth_more, best_verify_length   the confidence gate's stopping rule (``rakv.decide.gate``)
    copies_win, worth_starting      the model draft against free copies, and whether to start it

Used by the controller, the planner and gate, the regime and the vLLM proposer alike: each of
these rules is defined here once. The constants' evidence is in docs/controller.md#constants.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ..config import LOOKUP_K

if TYPE_CHECKING:
    from ..records import Candidate

REUSE_TIE = 0.01     # r = 1 takes a near-tie within this share of the best r = 0 action
SPEC_MARGIN = 0.02   # a drafting action must be predicted this much cheaper than the best k = 0 one
ROOT_TOL = 1e-5      # alpha* is shown and recorded, not optimised over: this close is enough

# alpha's uncertainty as a normal over 5 Gauss-Hermite nodes (probabilists'): nodes and weights
GH_NODES = ((-2.856970, 0.011257), (-1.355626, 0.222076), (0.0, 0.533333), (1.355626, 0.222076),
            (2.856970, 0.011257))


def gh_nodes(a: float, sd: float) -> list[tuple[float, float]]:
    """alpha ~ normal(a, sd) as GH_NODES' (alpha, weight), alpha clipped to [0, 1]."""
    return [(min(1.0, max(0.0, a + x * sd)), w) for x, w in GH_NODES]


def learnt_sd(a: float, n: float, m: float) -> float:
    """How far m more trials may move alpha's estimate ``a``, now resting on n trials (the
    preposterior sd of the knowledge gradient): sqrt(a (1 - a) (1/n - 1/(n + m)))."""
    return math.sqrt(max(a * (1 - a), 0.01) * max(0.0, 1.0 / n - 1.0 / (n + m)))


def explore_value(fns: dict, b0: float, nodes) -> float:
    """What knowing alpha is worth to a later request like this one: E[max(0, b0 - min_k C_k(alpha))]
    over alpha's ``nodes`` (once alpha is known, the request takes the better of k = 0 and drafting)."""
    return sum(w * max(0.0, b0 - min(f(al) for f in fns.values())) for al, w in nodes)


def spec_or_plain(best: Candidate, plain: list[Candidate]) -> Candidate:
    """Draft only when predicted SPEC_MARGIN cheaper than the best k = 0 action: a near-tie lost
    to k = 0 costs little, a wrong draft a whole draft prefill (docs/controller.md#constants)."""
    if not plain:
        return best
    b0 = min(plain, key=lambda c: c.predicted_ms)
    return best if best.predicted_ms < b0.predicted_ms * (1 - SPEC_MARGIN) else b0


def prefer_reuse(best: Candidate, feas: list[Candidate]) -> Candidate:
    """r = 1 wins a near-tie (within REUSE_TIE) with an r = 0 action of the same kind (drafting
    or not): it costs only the measured clone/store and seeds the cache for later requests (a
    plain r = 0 chosen by the spec margin once left a shared prefix unstored)."""
    if best.reuse == 1:
        return best
    alt = [c for c in feas if c.reuse == 1 and (c.k > 0) == (best.k > 0)
           and c.predicted_ms <= best.predicted_ms * (1 + REUSE_TIE)]
    return min(alt, key=lambda c: c.predicted_ms) if alt else best


def root_falling(f, f0: float, f1: float) -> float:
    """The x in [0, 1] where f, falling with f(0) = f0 > 0 >= f(1) = f1, crosses 0: regula falsi
    with the Illinois rule (a bracket end kept twice has its value halved), to within ROOT_TOL;
    a round's costs are smooth in alpha, so it takes ~5 evaluations where bisection took 9 and a
    chord (this runs for every k of every request's decision, before its first token)."""
    lo, hi, flo, fhi = 0.0, 1.0, f0, f1
    side = 0
    for _ in range(40):
        if flo == fhi:
            return hi
        x = lo + (hi - lo) * flo / (flo - fhi)
        if hi - lo < ROOT_TOL:
            return x
        fx = f(x)
        if fx <= 0:
            hi, fhi = x, fx
            if side == -1:
                flo /= 2
            side = -1
        else:
            lo, flo = x, fx
            if side == 1:
                fhi /= 2
            side = 1
        if abs(fx) < 1e-12:
            return x
    return lo + (hi - lo) * flo / (flo - fhi)


def E(k: int, alpha: float) -> float:
    """Expected tokens per round with k drafts at per-token acceptance alpha."""
    if k == 0:
        return 1.0
    alpha = min(max(alpha, 0.0), 1.0)
    if alpha >= 1.0 - 1e-12:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def shape_signal(reach: list[float], hold: list[float], a: float) -> float:
    """The share of the positions' spread around the pooled rate ``a`` that is signal, not
    sampling noise: 1 - (m - 1) / chi2 over the m positions drafted (empirical Bayes, by moments).
    A spread that noise alone explains is dropped (a short stream's noisy shape flipped k between
    lengths, docs/controller.md); n-gram's all-or-nothing copies stay."""
    if not 0.0 < a < 1.0:
        return 1.0
    z = [(h / r - a) ** 2 * r / (a * (1.0 - a)) for r, h in zip(reach, hold) if r >= 1.0]
    chi2 = sum(z)
    return 0.0 if len(z) < 2 or chi2 <= 0 else max(0.0, 1.0 - (len(z) - 1) / chi2)


def E_shaped(k: int, alpha: float, shape: list[float]) -> float:
    """Expected tokens per round with k drafts when draft j survives (given j - 1 did) at
    alpha * shape[j - 1] (capped below 1); shape all ones is E(k, alpha)."""
    e = p = 1.0
    a = min(max(alpha, 0.0), 1.0)
    for j in range(k):
        p *= min(1.0, a * (shape[j] if j < len(shape) else 1.0))
        e += p
    return e


def overshoot(k: int, alpha: float) -> float:
    """Expected rounds a request spends past n / E_k: its last round is cut (by EOS or the token
    budget) and costs a whole round. Renewal count of integer round sizes X in 1..k+1 (a truncated
    geometric): rounds(n) ~ n / E[X] + (E[X^2] - E[X]) / (2 E[X]^2); 0 at k = 0, ~0.5 at large k."""
    if k == 0:
        return 0.0
    a = min(max(alpha, 0.0), 1.0)
    m = E(k, a)
    x2, p = 0.0, 1.0 - a                   # p = a^(j - 1) (1 - a): P(X = j), j = 1..k
    for j in range(1, k + 1):
        x2 += j * j * p
        p *= a
    return (x2 + (k + 1) ** 2 * a ** k - m) / (2 * m * m)


BATCH_ROWS = (32, 64)       # a pass's rows measured past the verifies (the batch's W(n), docs/serve.md)


def batch_vs(k_max: int) -> list[int]:
    """Verify lengths whose k + 1 rows are what a batch's pass carries (W(n) = V(n - 1)): measured
    so a full batch's price is not an extrapolation."""
    return [n - 1 for n in BATCH_ROWS if n - 1 > k_max]


def lookup_vs(k_max: int) -> list[int]:
    """Verify lengths measured past k_max (no draft): a gated n-gram lookup may verify up to
    config.LOOKUP_K tokens, and V past the measured ones must not be a guess (V is not linear)."""
    return [k for k in sorted({(k_max + LOOKUP_K) // 2, LOOKUP_K}) if k > k_max]




def round_draft_ms(k: int, alpha: float, d: float, d2x: float) -> float:
    """Expected draft ms of a k-token round: k steps of d, the first one d2x dearer when the round
    before accepted all its k drafts (chance alpha^k at i.i.d. acceptance alpha)."""
    return 0.0 if k <= 0 else k * d + min(1.0, max(0.0, alpha)) ** k * d2x


def drafting_ks(ks: list[int]) -> list[int]:
    """The k a drafting policy may use: the measured ones up to k_max, without the lengths past
    it that calibration adds for n-gram lookups only (``costs.lookup_vs``)."""
    for m in ks:
        if [k for k in ks if k > m] == lookup_vs(m) and lookup_vs(m):
            return [k for k in ks if k <= m]
    return ks


def crossover(excess) -> float | None:
    """alpha*: the smallest alpha in [0, 1] at which ``excess(alpha)`` (a drafting action's cost
    over the plain one's, falling as alpha rises) reaches 0; None when even alpha = 1 loses, 0.0
    when alpha = 0 already pays. Not rounded."""
    f1 = excess(1.0)
    if f1 > 0:
        return None
    f0 = excess(0.0)
    if f0 <= 0:
        return 0.0
    return root_falling(excess, f0, f1)


def round_excess(k: int, t: float, v: float, d: float = 0.0, d2x: float = 0.0):
    """A round of k drafts' cost over what its tokens save in plain steps of t, as a function of
    alpha: round_draft_ms(k, alpha, d, d2x) + V(k) - E_k(alpha) t (falls with alpha)."""
    return lambda a: round_draft_ms(k, a, d, d2x) + v - E(k, a) * t


def round_crossover(k: int, t: float, v: float, d: float = 0.0, d2x: float = 0.0) -> float | None:
    """The per-round crossover of k: the smallest alpha with (k d + alpha^k d2x + V(k)) / E_k(alpha)
    <= t (None: never, even at alpha = 1, or no step time). Not rounded."""
    if t <= 0:
        return None
    return crossover(round_excess(k, t, v, d, d2x))


def alpha_star(V: list[float], d: float = 0.0, d2x: float = 0.0) -> dict[str, float | None]:
    """Per k >= 1 of V = [V(0) = t, V(1), ...]: the per-round crossover ``round_crossover`` at
    draft step d (0: free drafts, e.g. n-gram copies), rounded to 4 places (None: never pays)."""
    out: dict[str, float | None] = {}
    for k in range(1, len(V)):
        a = round_crossover(k, V[0], V[k], d, d2x)
        out[str(k)] = None if a is None else round(a, 4)
    return out


def copies_win(copy_rate: float, model_rate: float) -> bool:
    """A round takes free n-gram copies (nothing to draft: C_j = V(j)) over the model draft when
    their expected tokens per ms are at least what the model draft can expect (a tie: the copies).
    With no copies, ``copy_rate`` is a plain step's 1 / t: the model draft must beat it."""
    return copy_rate >= model_rate


def worth_starting(prefill_ms: float, ms_tok_model: float, ms_tok_other: float, remaining: int) -> bool:
    """Start a request's draft (prefill its prompt) only if the ms it saves over the remaining
    tokens pays for that prefill."""
    return remaining * (ms_tok_other - ms_tok_model) > prefill_ms


def worth_more(S: list[float], c: float, d: float, V: list[float], sunk: float, k_max: int, base: float = 1.0) -> bool:
    """Draft on only if some longer draft (its next tokens as likely as this one, c) has a better
    expected rate E/C than the best verify length now: one step ahead is myopic, V is not monotone.
    ``base``: the tokens the pass gives without any draft (1; in a batch, 1 + the others')."""
    j = len(S)
    spent = sunk + j * d
    b = best_verify_length(S, V, spent, base)
    best_e, best_c = base + sum(S[:b]), spent + V[b]
    e, s = base + sum(S), S[-1] if S else 1.0
    for jj in range(j + 1, k_max + 1):
        s *= c
        e += s
        C = sunk + jj * d + V[jj]
        if C <= 0 or e * best_c > best_e * C:      # (zero costs: a recording gate, never stops)
            return True
    return False


def best_verify_length(S: list[float], V: list[float], spent: float, base: float = 1.0) -> int:
    """The verify length j <= len(S) with the most expected tokens per ms (V is not monotone on CPU);
    ``base`` tokens come with the pass whatever j is (1 alone; in a batch, 1 + the others')."""
    best_j, best_e, best_c = 0, base, spent + V[0]
    e = base
    for j, s in enumerate(S, start=1):
        e += s
        if e * best_c > best_e * (spent + V[j]):
            best_j, best_e, best_c = j, e, spent + V[j]
    return best_j


# ----------------------------------------------------------------------------- the batch's price
def batch_rate(k: int, E_k: float, W, rows_o: int, tokens_o: float, draft_ms: float, fires: int = 0,
               drafting_o: float = 0.0) -> float:
    """Tokens per ms of the batch over one round of this request, beside others feeding rows_o rows
    a step for tokens_o tokens: its round takes ``fires`` steps of drafting (a model draft's forwards,
    each a step the others go on in: rows_o rows and this request's draft pass) and one verify of
    k + 1 rows among the others' (W(n): a pass of n rows, W(0) = 0). In lockstep (``fires`` 0) the
    round waits for the longest drafting, this request's or the others' (``drafting_o``: their
    draft passes are this one's). Alone (rows_o = 0) this is the single request's
    E_k / (drafting + V(k))."""
    others = W(rows_o) if rows_o else 0.0
    return ((fires + 1) * tokens_o + E_k) / (fires * others + max(draft_ms, drafting_o) + W(rows_o + k + 1))


def batch_k(ks, E_of, W, rows_o: int, tokens_o: float, draft_ms_of, fires_of=lambda k: 0,
            drafting_o: float = 0.0) -> int:
    """The k (0 allowed) at which the batch emits the most tokens per ms, the others' rows and
    tokens as they are: a row spent on a long shot in a full batch costs the others' tokens, and a
    model draft's forwards are steps its request emits nothing in (or, in lockstep, steps the
    others wait for unless they draft too). With no others this is the single request's rule."""
    best, best_rate = 0, -1.0
    for k in sorted(set(ks)):
        r = batch_rate(k, E_of(k), W, rows_o, tokens_o, draft_ms_of(k) if k else 0.0, fires_of(k) if k else 0,
                       drafting_o)
        if r > best_rate * (1 + 1e-9):
            best, best_rate = k, r
    return best


JOINT_MARGIN = 0.05     # the batch's joint K changes only for a rate this much better (docs/serve.md: why)


def joint_move(ks, alphas: dict[int, float], W, rows_n: int, tokens_n: float, draft_ms_of,
               keep: int | None = None, margin: float = JOINT_MARGIN,
               sunk: dict[int, float] | None = None) -> tuple[int, frozenset, float, float]:
    """The batch's best joint move in lockstep: the requests whose k is priced this way
    (``alphas``: each one's acceptance) draft a common K, the m most likely of them (the rest
    plain), at the most tokens per ms of the whole step, beside others feeding rows_n rows for
    tokens_n tokens. One request's best answer to the others' k = 0 is k = 0 (its drafting holds
    them for its passes) where all drafting together is faster, and in lockstep every round waits
    for the longest drafting, so a batch whose requests each pick their own k pays for the mix;
    one move for all does neither. ``draft_ms_of(K, m)``: K draft passes of m rows. ``keep``: the
    K in force, kept unless another K's rate beats its best by ``margin`` (no flapping between
    near-equal moves). ``sunk``: each request's one-off cost of starting to draft (its draft's
    catch-up, ms per token it has left), a round carrying its tokens' share. Returns (K, the
    requests that draft it, the step's predicted rate, its round's ms)."""
    order = sorted(alphas, key=lambda q: (-alphas[q], q))
    n = len(order)
    T0 = W(n + rows_n)
    best: dict[int, tuple[float, int, float]] = {0: ((n + tokens_n) / T0, 0, T0)}
    for K in sorted(k for k in set(ks) if k > 0):
        e, once, top = 0.0, 0.0, best[0]
        for m in range(1, n + 1):
            q = order[m - 1]
            e_q = E(K, alphas[q])
            e += e_q
            once += e_q * (sunk or {}).get(q, 0.0)
            T = draft_ms_of(K, m) + once + W(rows_n + m * (K + 1) + n - m)
            rate = (e + (n - m) + tokens_n) / T
            if rate > top[0] * (1 + 1e-9):
                top = (rate, m, T)
        best[K] = top
    K = max(best, key=lambda j: (best[j][0], -j))
    if keep in best and best[K][0] <= best[keep][0] * (1 + margin):
        K = keep
    rate, m, T = best[K]
    return (K, frozenset(order[:m]), rate, T) if m else (0, frozenset(), rate, T)

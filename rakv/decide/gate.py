"""The confidence gate (beyond the paper): inside a drafting round, stop the draft at the length
with the best expected tokens per millisecond, from the draft's own confidence and measured costs.

Each drafted token comes with a confidence in [0, 1] (a model draft: its softmax top probability;
n-gram lookup: from the length of the match it copies). ``AcceptMap`` turns a confidence into the
chance the target accepts the token, fitted online from verify outcomes (binned counts over a prior
from the calibration pass), one map per draft source. With c_i the calibrated chance of draft i and
S_j = c_1 ... c_j the chance that the first j drafts all survive:

    E_j = 1 + S_1 + ... + S_j          expected tokens of a round that verifies j drafts
    C_j = sunk_j + V(j)                its cost: drafting so far (catch-up + j d) plus the verify;
                                       V(0) = t: drop the drafts and take a plain step

The per-request (r, k) stays the controller's argmin; the gate decides how far each drafting round
goes, within k_max. In a k = 0 round (the model draft does not pay) the gate still looks up the
n-gram continuation, which costs microseconds, and verifies it when E_j / C_j beats a plain step:
the one way to gain where no model draft pays (``RoundPlanner._lookup``). In a drafting round the same
free lookup replaces the model draft when its E_j / C_j beats what the model draft can expect.
A request's own judged lookups scale the pooled lookup map (``request_trust``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..util.acceptance import judged
from .policy import best_verify_length, worth_more

BINS = 10             # confidence bins of width 0.1
PRIOR_WEIGHT = 2.0    # pseudo-trials per bin behind the prior (calibration or the confidence itself)
LOOKUP_ALPHA = 0.3    # the n-gram side draft's prior acceptance before any verify (learned online)
TRUST_WEIGHT = 2.0    # pseudo-tokens behind a request's own lookup trust (1 until its lookups are judged)


def conf_bin(c: float) -> int:
    return min(BINS - 1, max(0, int(c * BINS)))


class AcceptMap:
    """P(target accepts | draft confidence bin): (prior + observed accepts) / (prior + observed trials).

    A trial is a drafted token whose outcome the verify decided: the accepted ones, and the first
    rejected one (tokens after it were never judged on their own prefix)."""

    def __init__(self, alpha: float = 0.5, prior: dict | None = None):
        # prior: the calibration's per-bin counts, else the bin's confidence shrunk toward alpha
        self.hits = [0.0] * BINS
        self.n = [0.0] * BINS
        if prior and len(prior.get("hits", [])) == BINS and len(prior.get("n", [])) == BINS:
            for b in range(BINS):
                w = min(float(prior["n"][b]), 4 * PRIOR_WEIGHT)     # calibration counts are few: cap their weight
                rate = prior["hits"][b] / prior["n"][b] if prior["n"][b] > 0 else 0.5 * ((b + 0.5) / BINS + alpha)
                self.hits[b], self.n[b] = rate * max(w, PRIOR_WEIGHT), max(w, PRIOR_WEIGHT)
        else:
            for b in range(BINS):
                self.hits[b] = PRIOR_WEIGHT * 0.5 * ((b + 0.5) / BINS + alpha)
                self.n[b] = PRIOR_WEIGHT
        # observed only (the reliability diagram): trials, accepts, and the sum of what was predicted
        self.obs_n = [0] * BINS
        self.obs_hits = [0] * BINS
        self.obs_pred = [0.0] * BINS

    def p(self, conf: float) -> float:
        b = conf_bin(conf)
        return self.hits[b] / self.n[b]

    def observe(self, confs: list[float], preds: list[float], accepted: int) -> None:
        """Fold in one verify: drafts 1..accepted were accepted, draft accepted+1 (if any) rejected."""
        for i, (c, ok) in enumerate(judged(confs, len(confs), accepted)):
            b = conf_bin(c)
            self.hits[b] += ok
            self.n[b] += 1
            self.obs_n[b] += 1
            self.obs_hits[b] += ok
            self.obs_pred[b] += preds[i] if i < len(preds) else self.p(c)

    def counts(self) -> dict:
        """Observed counts (what a profile stores as the next session's prior)."""
        return {"hits": list(self.obs_hits), "n": list(self.obs_n)}

    def reliability(self) -> list[dict]:
        """Per bin with outcomes: mean predicted acceptance against the observed rate."""
        out = []
        for b in range(BINS):
            if self.obs_n[b]:
                out.append({"bin": [b / BINS, (b + 1) / BINS], "n": self.obs_n[b],
                            "predicted": round(self.obs_pred[b] / self.obs_n[b], 4),
                            "observed": round(self.obs_hits[b] / self.obs_n[b], 4)})
        return out


def request_trust(hits: float, predicted: float) -> float:
    """A request's own lookups correct the pooled map: (accepted + w) / (predicted + w) over its
    judged lookup tokens (a numbered list copies the last item's layout, not its words)."""
    return (hits + TRUST_WEIGHT) / (predicted + TRUST_WEIGHT)


class Trusted:
    """An accept map's chances scaled by a request's trust (capped at 1)."""

    def __init__(self, amap: AcceptMap, trust: float):
        self.amap, self.trust = amap, trust

    def p(self, conf: float) -> float:
        return min(1.0, self.amap.p(conf) * self.trust)


@dataclass
class RoundGate:
    """One drafting round's stopping rule. ``V[j]`` for j = 0..k_max (V[0] = t), ``d`` a draft
    step, ``sunk`` what the round has already cost before its first draft (a catch-up). In a batch
    (``batch_gate``) V[j] is the whole step's pass with j drafts and ``base`` the tokens that step
    gives without them (1 + the other requests'): a draft row must beat the batch's rate, not a
    lone step's."""

    amap: AcceptMap
    k_max: int
    d: float
    V: list[float]
    sunk: float = 0.0
    confs: list[float] = field(default_factory=list)
    preds: list[float] = field(default_factory=list)
    S: list[float] = field(default_factory=list)      # S_j, j = 1..drafted
    stop: str = ""
    base: float = 1.0                                  # tokens the pass gives without drafts

    def E(self, j: int) -> float:
        return self.base + sum(self.S[:j])

    def C(self, j: int) -> float:
        return self.sunk + len(self.S) * self.d + self.V[j]

    def keep_going(self, conf: float) -> bool:
        """Called after each drafted token: draft one more? (records why it stops)."""
        c = self.amap.p(conf)
        self.confs.append(conf)
        self.preds.append(c)
        self.S.append((self.S[-1] if self.S else 1.0) * c)
        j = len(self.S)
        if j >= self.k_max:
            self.stop = "k_max"
            return False
        if not worth_more(self.S, c, self.d, self.V, self.sunk, self.k_max, self.base):
            self.stop = "gate"
            return False
        return True

    def expected_rate(self, alpha: float) -> float:
        """Tokens per ms this round can expect before drafting, at i.i.d. acceptance alpha (its best j)."""
        best, e, s = self.base / self.V[0], self.base, 1.0
        for j in range(1, self.k_max + 1):
            s *= alpha
            e += s
            best = max(best, e / (self.sunk + j * self.d + self.V[j]))
        return best

    def rate(self, j: int) -> float:
        """E_j / C_j for the tokens drafted so far (j of them verified)."""
        return self.E(j) / self.C(j)

    def verify_length(self, drafted: int) -> int:
        """How many of the drafted tokens to verify (0: none, a plain step instead)."""
        if not self.stop:
            self.stop = "source"     # the source offered fewer than the gate would take
        j = best_verify_length(self.S[:drafted], self.V, self.sunk + drafted * self.d, self.base)
        if j < drafted:
            self.stop = "cut"
        return j


def recording_gate(amap: AcceptMap, k: int) -> RoundGate:
    """A gate that never stops a draft early (zero costs): it only records confidences (calibration)."""
    return RoundGate(amap, k, 0.0, [0.0] * (k + 1))


class Reliability:
    """The calibration check of the gate's predictions: drafted tokens binned by their predicted
    acceptance, the mean prediction against the observed rate per bin (a reliability diagram)."""

    def __init__(self):
        self.n = [0] * BINS
        self.hits = [0] * BINS
        self.pred = [0.0] * BINS

    def add(self, preds: list[float], drafted: int, accepted: int) -> None:
        """One verified round: drafts 1..accepted accepted, draft accepted+1 rejected, later ones unjudged."""
        for p, ok in judged(preds, drafted, accepted):
            self.add_one(p, ok)

    def add_one(self, p: float, ok: bool) -> None:
        b = conf_bin(p)
        self.n[b] += 1
        self.hits[b] += ok
        self.pred[b] += p

    def rows(self) -> list[dict]:
        return [{"bin": [b / BINS, (b + 1) / BINS], "n": self.n[b], "predicted": round(self.pred[b] / self.n[b], 4),
                 "observed": round(self.hits[b] / self.n[b], 4)} for b in range(BINS) if self.n[b]]

    def error(self) -> float | None:
        """Expected calibration error: |predicted - observed| averaged over tokens (None: no data)."""
        total = sum(self.n)
        if not total:
            return None
        return sum(abs(self.pred[b] - self.hits[b]) for b in range(BINS)) / total

"""rakv.decoding.sampling in distribution: the sampler and both speculative verification modes produce the
target's distribution, and acceptance rates match their theory.

Significance: every chi-square goodness-of-fit test here is at ALPHA = 1e-3 for the whole test
(Bonferroni: a test that checks m output positions compares each position's p-value with ALPHA / m).
The seeds are fixed, so every outcome is deterministic; a correct sampler fails a given test with
probability at most 1e-3 over the choice of seeds. p-values come from the chi-square survival
function below (regularised upper incomplete gamma via math.lgamma; scipy is not in the venv).
Cells with expected count below 5 are pooled; a token the filtered target gives probability 0 that
appears at all makes the p-value 0 (no sampling error explains it).

Power: each test also runs a deliberately wrong sampler (non-Gumbel noise; rejection sampling that
resamples from p instead of the residual, accepts with q/p, or ignores q; seeded noise not keyed by
position) and asserts that its p-value falls below the threshold.

Acceptance rates: two-sided binomial checks (normal approximation) at the same ALPHA, |rate - want|
< Z standard errors with Z = 3.29.
"""

from __future__ import annotations

import math

import pytest
import torch

from rakv.decoding import sampling
from rakv.config import Sampling
from rakv.decoding.sampling import accept_rejection, accept_seeded, logprobs, propose, sample, sample_rows

ALPHA = 1e-3
Z = 3.29                       # two-sided normal quantile at ALPHA


# ---------------------------------------------------------------------------------- chi-square

def upper_gamma_q(a: float, x: float) -> float:
    """Q(a, x) = Gamma(a, x) / Gamma(a): series for x < a + 1, else Lentz's continued fraction."""
    if x <= 0:
        return 1.0
    log_front = -x + a * math.log(x) - math.lgamma(a)
    if x < a + 1:
        term = total = 1.0 / a
        n = 0
        while abs(term) > abs(total) * 1e-16:
            n += 1
            term *= x / (a + n)
            total += term
        return max(0.0, 1.0 - total * math.exp(log_front))
    tiny = 1e-300
    b = x + 1 - a
    c, d = 1 / tiny, 1 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        h *= d * c
        if abs(d * c - 1) < 1e-16:
            break
    return math.exp(log_front) * h


def chi2_sf(stat: float, dof: int) -> float:
    return upper_gamma_q(dof / 2, stat / 2)


def chi_square_p(counts: list[int], probs: list[float]) -> float:
    """Goodness-of-fit p-value of counts against probs; cells with expected < 5 pooled; 0 when a
    cell of probability 0 has a count (no sampling error explains that)."""
    n = sum(counts)
    if any(c > 0 and p <= 0 for c, p in zip(counts, probs)):
        return 0.0                                   # a token of probability 0 was produced
    cells = [(c, n * p) for c, p in zip(counts, probs) if p > 0]
    big = [(c, e) for c, e in cells if e >= 5]
    small = [(c, e) for c, e in cells if e < 5]
    pooled = (sum(c for c, _ in small), sum(e for _, e in small))
    if pooled[1] >= 5:
        big.append(pooled)
    elif big and pooled[1] > 0:                      # too little even pooled: fold into the smallest cell
        k = min(range(len(big)), key=lambda i: big[i][1])
        big[k] = (big[k][0] + pooled[0], big[k][1] + pooled[1])
    if len(big) < 2:
        return 1.0
    stat = sum((c - e) ** 2 / e for c, e in big)
    return chi2_sf(stat, len(big) - 1)


@pytest.mark.fast
def test_chi2_sf_known_values():
    assert chi2_sf(0.0, 3) == 1.0
    for stat, dof, want in [(3.841458820694124, 1, 0.05), (10.827566170662733, 1, 0.001),
                            (18.307038053275146, 10, 0.05), (149.4492, 100, 0.001)]:   # tables
        assert chi2_sf(stat, dof) == pytest.approx(want, rel=1e-4)
    for dof in (2, 4, 10, 36, 60):                   # even dof: exp(-x/2) sum_{i < dof/2} (x/2)^i / i!
        for stat in (0.5, 3.0, 20.0, 55.0, 90.0, 200.0):
            want = math.exp(-stat / 2) * sum((stat / 2) ** i / math.factorial(i) for i in range(dof // 2))
            assert chi2_sf(stat, dof) == pytest.approx(want, rel=1e-9, abs=1e-300)


# --------------------------------------------------------------------------------- wrong samplers

EXP1 = sampling._exp1


def non_gumbel_exp1(h):
    """Exp(1) squared: the noise built from it is no longer Gumbel."""
    return EXP1(h) ** 2


WRONG_REJECTION = {
    "resample_from_p": ("_residual", lambda p, q: p.clone()),
    "accept_with_q_over_p": ("_accept_probability", lambda lp, lq: min(1.0, math.exp(lq - lp))),
    "accept_ignoring_q": ("_accept_probability", lambda lp, lq: math.exp(lp)),
}


def key_without_position(seed, position, stream="sample", level=0, _key=sampling.stream_key):
    return _key(seed, 0, stream, level)


# --------------------------------------------------------------------------------- plain sampler

PLAIN = [Sampling(1.0), Sampling(0.6, top_k=8), Sampling(1.3, top_p=0.85), Sampling(1.0, min_p=0.1),
         Sampling(0.8, top_k=10, top_p=0.9, min_p=0.02)]


def plain_p_value(logits: torch.Tensor, s: Sampling, seeds=(11, 12, 13), per_seed=700) -> float:
    V = logits.numel()
    counts = [0] * V
    rows = logits.expand(per_seed, V)
    for seed in seeds:
        for t in sample_rows(rows, Sampling(**{**s.to_dict(), "seed": seed}), list(range(per_seed))):
            counts[t] += 1
    return chi_square_p(counts, logprobs(logits, s).exp().tolist())


@pytest.mark.parametrize("s", PLAIN, ids=lambda s: s.key())
def test_plain_sampler_matches_the_filtered_softmax(s):
    logits = torch.randn(12, generator=torch.Generator().manual_seed(4)) * 1.5
    assert plain_p_value(logits, s) >= ALPHA


def test_plain_sampler_matches_at_a_vocabulary_the_pruning_works_on():
    """V = 3000 (47 blocks: the two-stage search, stage 2 included): twelve likely tokens spread
    over the blocks, the rest pooled."""
    g = torch.Generator().manual_seed(5)
    V = 3000
    logits = torch.randn(V, generator=g) - 4
    hot = torch.randperm(V, generator=g)[:12]
    logits[hot] = torch.randn(12, generator=g) + 1
    s = Sampling(1.0)
    p = logprobs(logits, s).exp()
    counts = {}
    for seed in (21, 22):
        for t in sample_rows(logits.expand(1500, V), Sampling(1.0, seed=seed), list(range(1500))):
            counts[t] = counts.get(t, 0) + 1
    hot_list = hot.tolist()
    cells = [counts.get(t, 0) for t in hot_list] + [sum(c for t, c in counts.items() if t not in hot_list)]
    probs = [float(p[t]) for t in hot_list] + [1 - float(p[hot].sum())]
    assert chi_square_p(cells, probs) >= ALPHA


def test_plain_test_has_power(monkeypatch):
    logits = torch.randn(12, generator=torch.Generator().manual_seed(4)) * 1.5
    monkeypatch.setenv("RAKV_C_SAMPLER", "0")       # the wrong noise is torch's ops' (the kernel's is
    monkeypatch.setattr(sampling, "_exp1", non_gumbel_exp1)   # their token, test_sampling.py)
    assert plain_p_value(logits, PLAIN[0]) < ALPHA


# ------------------------------------------------------------------ the speculative process

V = 6
N_OUT = 4                      # output positions checked
K_CYCLE = (1, 2, 3, 4)         # a run's rounds draft k = 1, 2, 3, 4, ... (offset per run)
START = 0                      # the token before position 0

_g = torch.Generator().manual_seed(1)
P_TABLE = torch.randn(2, V, V, generator=_g) * 1.5                   # target logits by (position % 2, previous token)
Q_TABLE = P_TABLE + torch.randn(2, V, V, generator=_g) * 1.5         # a draft model's logits, visibly off


def p_logits(position: int, prev: int) -> torch.Tensor:
    return P_TABLE[position % 2, prev]


def q_logits(position: int, prev: int) -> torch.Tensor:
    return Q_TABLE[position % 2, prev]


def ngram_draft(prev: int) -> int:
    return (2 * prev + 1) % V


def target_only(s: Sampling, n: int, base: int = 0) -> list[int]:
    """Plain sampled decoding of one request whose position i is keyed base + i."""
    out, prev = [], START
    for i in range(n):
        prev = sample(p_logits(i, prev), s, base + i)
        out.append(prev)
    return out


def rejection_request(s: Sampling, n: int, draft: str, k_offset: int) -> list[int]:
    """One request decoded by rejection-mode rounds until n tokens: draft k (cycling 1..4),
    verify with accept_rejection, keep the accepted drafts and the token after them."""
    out, prev, r = [], START, k_offset
    while len(out) < n:
        k = K_CYCLE[r % len(K_CYCLE)]
        r += 1
        pos = len(out)
        before = [prev]                                                  # the token before each draft
        for j in range(k):
            if draft == "ngram":
                before.append(ngram_draft(before[-1]))
            else:
                before.append(propose(q_logits(pos + j, before[-1]), s, pos + j, "rejection"))
        drafts = before[1:]
        p_rows = torch.stack([p_logits(pos + j, before[j]) for j in range(k + 1)])           # [k+1, V]
        q_rows = None if draft == "ngram" else torch.stack([q_logits(pos + j, before[j]) for j in range(k)])
        a, t = accept_rejection(p_rows, q_rows, drafts, s, pos)
        out += drafts[:a] + [t]
        prev = out[-1]
    return out[:n]


def seeded_requests(s: Sampling, runs: int, n: int) -> list[list[int]]:
    """``runs`` requests decoded by seeded rounds in lockstep (one sample_rows call per draft step
    and one per verify, over all requests): request r's position i is keyed r * STRIDE + i, so the
    requests are independent; request r drafts k = K_CYCLE[(round + r) % 4] in each round, the
    model draft proposing with the target's noise (propose(..., "seeded") = sample_rows' rows)."""
    outs: list[list[int]] = [[] for _ in range(runs)]
    rnd = 0
    while active := [r for r in range(runs) if len(outs[r]) < n]:
        k = {r: K_CYCLE[(rnd + r) % len(K_CYCLE)] for r in active}
        before = {r: [outs[r][-1] if outs[r] else START] for r in active}
        for j in range(max(k.values())):
            rows = [r for r in active if k[r] > j]
            q = torch.stack([q_logits(len(outs[r]) + j, before[r][-1]) for r in rows])
            for r, x in zip(rows, sample_rows(q, s, [r * STRIDE + len(outs[r]) + j for r in rows])):
                before[r].append(x)
        p_rows, positions = [], []
        for r in active:
            for j in range(k[r] + 1):
                p_rows.append(p_logits(len(outs[r]) + j, before[r][j]))
                positions.append(r * STRIDE + len(outs[r]) + j)
        targets = sample_rows(torch.stack(p_rows), s, positions)
        at = 0
        for r in active:
            t = targets[at:at + k[r] + 1]
            at += k[r] + 1
            drafts = before[r][1:]
            a = accept_seeded(drafts, t)
            outs[r] += drafts[:a] + [t[a]]
        rnd += 1
    return [o[:n] for o in outs]


def exact_pairs(s: Sampling, n: int) -> list[list[float]]:
    """Target-only process, exactly: position 0's distribution, then (x[i-1], x[i]) pairs."""
    P = [logprobs(P_TABLE[i % 2], s).exp().double() for i in range(2)]   # [V, V] rows: prev
    m = P[0][START]
    laws = [m.tolist()]
    for i in range(1, n):
        joint = m[:, None] * P[i % 2]                                   # [V, V]
        laws.append(joint.reshape(-1).tolist())
        m = joint.sum(0)
    return laws


def position_p_values(outputs: list[list[int]], s: Sampling) -> list[float]:
    laws = exact_pairs(s, N_OUT)
    ps = []
    for i, law in enumerate(laws):
        counts = [0] * len(law)
        for out in outputs:
            counts[out[0] if i == 0 else out[i - 1] * V + out[i]] += 1
        ps.append(chi_square_p(counts, law))
    return ps


def rejection_runs(s: Sampling, draft: str, runs: int, seed0: int) -> list[list[int]]:
    return [rejection_request(Sampling(**{**s.to_dict(), "seed": seed0 + r, "verify": "rejection"}), N_OUT,
                              draft, r) for r in range(runs)]


def seeded_runs(s: Sampling, seeds: range, per_seed: int) -> list[list[int]]:
    return [out for seed in seeds
            for out in seeded_requests(Sampling(**{**s.to_dict(), "seed": seed}), per_seed, N_OUT)]


STRIDE = 64                    # seeded runs: request r's positions start at r * STRIDE
SEEDED_S = Sampling(1.0, top_k=5)
REJECTION_S = Sampling(0.9, top_k=5, min_p=0.02)    # p and q are the filtered distributions
SEEDED_RUNS = (range(1000, 1008), 250)              # 8 seeds x 250 requests (batched: cheap)
REJECTION_RUNS = 200           # requests of each rejection test, the wrong samplers' included


def test_seeded_speculation_gives_the_target_only_tokens_and_distribution():
    outputs = seeded_runs(SEEDED_S, *SEEDED_RUNS)
    s = Sampling(**{**SEEDED_S.to_dict(), "seed": SEEDED_RUNS[0][0]})
    for r in range(0, SEEDED_RUNS[1], 10):                              # token for token, every 10th request
        assert outputs[r] == target_only(s, N_OUT, r * STRIDE)
    assert min(position_p_values(outputs, SEEDED_S)) >= ALPHA / N_OUT


def test_seeded_test_has_power(monkeypatch):
    monkeypatch.setattr(sampling, "stream_key", key_without_position)
    outputs = seeded_runs(SEEDED_S, *SEEDED_RUNS)
    assert min(position_p_values(outputs, SEEDED_S)) < ALPHA / N_OUT


@pytest.mark.parametrize("draft", ["model", "ngram"])
def test_rejection_speculation_has_the_target_distribution(draft):
    outputs = rejection_runs(REJECTION_S, draft, REJECTION_RUNS, 5000)
    assert min(position_p_values(outputs, REJECTION_S)) >= ALPHA / N_OUT


@pytest.mark.parametrize("wrong", sorted(WRONG_REJECTION))
def test_rejection_test_has_power(monkeypatch, wrong):
    name, fn = WRONG_REJECTION[wrong]
    monkeypatch.setattr(sampling, name, fn)
    outputs = rejection_runs(REJECTION_S, "model", REJECTION_RUNS, 5000)
    assert min(position_p_values(outputs, REJECTION_S)) < ALPHA / N_OUT


# --------------------------------------------------------------------------------- acceptance

def pq_pairs():
    g = torch.Generator().manual_seed(9)
    base = torch.randn(12, generator=g) * 1.5
    return [(base, base + torch.randn(12, generator=g) * sd) for sd in (0.3, 1.0, 2.5)]


def coupled_acceptance(p: torch.Tensor, q: torch.Tensor) -> float:
    """P(argmax(log p + G) == argmax(log q + G)) for shared Gumbel G: sum over x of
    1 / sum_y max(p_y / p_x, q_y / q_x) (x wins both races iff it wins the race of the tighter)."""
    total = 0.0
    for x in range(p.numel()):
        if p[x] > 0 and q[x] > 0:
            total += 1.0 / float(torch.maximum(p / p[x], q / q[x]).sum())
    return total


@pytest.mark.parametrize("pair", [0, 1, 2])
def test_seeded_acceptance_is_at_least_the_coupling_bound(pair):
    p_logits_, q_logits_ = pq_pairs()[pair]
    s = Sampling(1.0, top_k=10, seed=77)
    p, q = logprobs(p_logits_, s).exp().double(), logprobs(q_logits_, s).exp().double()
    tv = 0.5 * float((p - q).abs().sum())
    exact = coupled_acceptance(p, q)
    assert exact >= (1 - tv) / (1 + tv) - 1e-12
    n = 4000
    targets = sample_rows(p_logits_.expand(n, -1), s, list(range(n)))
    drafts = sample_rows(q_logits_.expand(n, -1), s, list(range(n)))       # = propose(..., "seeded")
    assert drafts[:20] == [propose(q_logits_, s, i, "seeded") for i in range(20)]
    rate = sum(d == t for d, t in zip(drafts, targets)) / n
    sd = math.sqrt(exact * (1 - exact) / n)
    assert abs(rate - exact) < Z * sd
    assert rate + Z * sd >= (1 - tv) / (1 + tv)


@pytest.mark.parametrize("pair", [0, 1, 2])
def test_rejection_acceptance_is_one_minus_tv(pair):
    p_logits_, q_logits_ = pq_pairs()[pair]
    s = Sampling(1.0, top_k=10, seed=78, verify="rejection")
    p, q = logprobs(p_logits_, s).exp().double(), logprobs(q_logits_, s).exp().double()
    want = 1 - 0.5 * float((p - q).abs().sum())
    n = 500
    accepted = 0
    p_rows, q_rows = torch.stack([p_logits_, p_logits_]), q_logits_[None]
    for pos in range(n):
        x = propose(q_logits_, s, pos)
        accepted += accept_rejection(p_rows, q_rows, [x], s, pos)[0]
    assert abs(accepted / n - want) < Z * math.sqrt(want * (1 - want) / n)

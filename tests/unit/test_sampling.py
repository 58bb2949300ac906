"""rakv.decoding.sampling without statistics: settings, seeded noise (determinism, the generator's arithmetic,
independence), the pruned sampler against the whole noise vector, greedy bit for bit, the filters
on hand-made distributions and against transformers' warpers, and the verification helpers.

The distribution tests (chi-square, acceptance rates) are in tests/unit/test_sampling_stats.py.
"""

from __future__ import annotations

import hashlib
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rakv.decoding import sampling
from rakv.config import Sampling, draw_seed, problem
from rakv.decoding.sampling import BLOCK, accept_rejection, accept_seeded, logprobs, noise, propose, sample, sample_rows, stream_key, stream_value, threshold, uniform

ROOT = Path(__file__).resolve().parents[2]
M64 = (1 << 64) - 1


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def full_argmax(logits: torch.Tensor, s: Sampling, position: int, stream: str = "sample") -> int:
    """The definition the pruned sampler must equal: argmax over kept tokens of z / T + noise."""
    z = logits.float() / s.temperature
    score = z + noise(s.seed, position, logits.numel(), stream)
    if sampling._filters_on(s):
        score = score.masked_fill(z < threshold(logits, s), -math.inf)
    return int(score.argmax())


# ------------------------------------------------------------------------------------- settings

@pytest.mark.fast
def test_defaults_are_greedy_and_key():
    s = Sampling()
    assert s.greedy and s.key() == "greedy" and s.seed is None and s.verify == "seeded"
    assert Sampling(top_k=5, top_p=0.5).key() == "greedy"            # filters do not matter at T = 0
    assert Sampling(0.7, 40, 0.95, 0.0, seed=3).key() == "T0.7/k40/p0.95/m0/seeded"
    assert Sampling(1.0, verify="rejection", seed=3).key() == "T1/k0/p1/m0/rejection"
    assert Sampling(0.7, seed=1).key() == Sampling(0.7, seed=2).key()   # the seed is not part of it


def test_for_request_and_to_dict():
    s = Sampling(0.8, seed=10)
    assert [s.for_request(i).seed for i in range(3)] == [10, 11, 12]
    assert s.for_request(2).temperature == 0.8
    assert Sampling(0.8, seed=2**63 - 1).for_request(2).seed == 1        # mod 2**63, still valid
    assert Sampling().for_request(5) == Sampling()                       # greedy without a seed stays so
    with pytest.raises(ValueError, match="seed"):
        Sampling(0.8).for_request(0)
    d = s.to_dict()
    assert d == {"temperature": 0.8, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": 10, "verify": "seeded"}
    assert Sampling(**d) == s


@pytest.mark.parametrize("kw, word", [
    ({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"), ({"top_k": -1}, "top-k"), ({"top_k": 2.5}, "top-k"),
    ({"top_p": 0.0}, "top-p"), ({"top_p": 1.5}, "top-p"), ({"top_p": float("nan")}, "top-p"),
    ({"min_p": 1.0}, "min-p"), ({"min_p": -0.1}, "min-p"), ({"seed": -1}, "seed"),
    ({"seed": 2**63}, "seed"), ({"seed": 1.5}, "seed"), ({"verify": "greedy"}, "verify"),
])
@pytest.mark.fast
def test_problem_names_the_bad_value(kw, word):
    msg = problem(Sampling(**kw))
    assert msg is not None and msg.startswith(word) and "\n" not in msg
    assert repr(next(iter(kw.values()))) in msg


def test_problem_accepts_good_values():
    for s in [Sampling(), Sampling(0.7, 40, 0.95, 0.05, seed=0), Sampling(2.0, top_p=1.0, seed=2**63 - 1),
              Sampling(1, verify="rejection", seed=5)]:
        assert problem(s) is None


def test_draw_seed():
    seeds = {draw_seed() for _ in range(20)}
    assert len(seeds) == 20 and all(0 <= x < 2**63 for x in seeds)
    assert problem(Sampling(0.7, seed=draw_seed())) is None


# ------------------------------------------------------------------------- the generator itself

def splitmix64_reference(state: int, count: int) -> list[int]:
    """The published splitmix64 (Steele et al. 2014), written independently of the module."""
    out = []
    for _ in range(count):
        state = (state + 0x9E3779B97F4A7C15) & M64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
        out.append(z ^ (z >> 31))
    return out


@pytest.mark.fast
@pytest.mark.parametrize("seed, position", [(0, 0), (1, 7), (2**63 - 1, 10**12), (123456789, 2**40)])
def test_torch_hash_is_splitmix64(seed, position):
    """The vectorised int64 arithmetic (wrap-around multiply, masked shifts) gives splitmix64's
    stream exactly: value j of key K is splitmix64's output j + 1 from state K."""
    key = stream_key(seed, position)
    want = splitmix64_reference(key, 300)
    assert [stream_value(key, j) for j in range(300)] == want
    got = sampling._words(torch.tensor([[sampling._signed(key)]]), torch.arange(300)[None])[0]
    assert [x & M64 for x in got.tolist()] == want


def test_noise_values_follow_the_construction():
    """Each block: its maximum M = log 64 - log(E_b) sits at slot J, every other slot is
    -log(E_b / 64 + E_i) <= M; recomputed here in Python floats from the reference words."""
    seed, position, V = 42, 5, 300
    g = noise(seed, position, V)
    kb = stream_key(seed, position, "sample", sampling._BLOCK_LEVEL)
    ks = stream_key(seed, position, "sample", sampling._SLOT)

    def exp1(h):
        return -math.log(sampling._uniform_of(h))

    for b in range(-(-V // BLOCK)):
        hb = stream_value(kb, b)
        m = math.log(BLOCK) - math.log(exp1(hb))
        j = hb & (BLOCK - 1)
        for i in range(b * BLOCK, min(V, (b + 1) * BLOCK)):
            if i - b * BLOCK == j:
                assert float(g[i]) == pytest.approx(m, rel=1e-6)
            else:
                want = -math.log(exp1(hb) / BLOCK + exp1(stream_value(ks, i)))
                assert float(g[i]) == pytest.approx(min(want, m), rel=1e-6, abs=1e-6)
                assert b * BLOCK + j >= V or float(g[i]) <= float(g[b * BLOCK + j])


def test_uniform_matches_the_vectorised_arithmetic():
    for seed, pos in [(1, 2), (2**62, 99), (7, 0)]:
        u = uniform(seed, pos, "accept")
        h = sampling._words(torch.tensor([[sampling._signed(stream_key(seed, pos, "accept"))]]),
                            torch.zeros(1, 1, dtype=torch.int64))
        assert 0 < u < 1 and math.exp(-float(sampling._exp1(h)[0, 0])) == pytest.approx(u, rel=1e-12)


# ------------------------------------------------------------------------------------ determinism

CASES = [(1, 0, 1000), (1, 1, 1000), (2, 0, 1000), (99, 7, 5003), (2**63 - 1, 123456, 49152)]  # 49152: ops split across threads


def fingerprint() -> str:
    """sha256 over noise vectors and samples (logits from a fixed torch generator) for CASES."""
    h = hashlib.sha256()
    for seed, pos, V in CASES:
        h.update(noise(seed, pos, V).numpy().tobytes())
        logits = torch.randn(V, generator=gen(seed % 1000 + pos)) * 3
        for s in [Sampling(0.7, seed=seed), Sampling(1.3, 20, 0.9, 0.01, seed=seed)]:
            h.update(repr(sample_rows(torch.stack([logits, logits * 0.5]), s, [pos, pos + 1])).encode())
        h.update(repr(accept_rejection(torch.stack([logits, logits]), logits[None] * 0.5, [3],
                                       Sampling(0.9, seed=seed), pos)).encode())
    return h.hexdigest()


def test_noise_same_on_every_call_whatever_ran_before():
    a = noise(5, 17, 4096)
    assert a.dtype == torch.float32 and a.shape == (4096,)
    for i in range(5):                                                   # other work in between
        sample(torch.randn(3000, generator=gen(i)), Sampling(0.9, seed=i), i)
        noise(i, 17, 999, "residual")
    assert torch.equal(a, noise(5, 17, 4096))
    assert torch.equal(noise(5, 17, 100), a[:100])                       # token j's value does not depend on V
    assert torch.equal(noise(5, 17, 5000)[:4096], a)


def test_same_fingerprint_in_another_process_at_1_and_2_threads():
    here = fingerprint()                                                # this process: 1 thread (conftest)
    code = ("import sys, torch; sys.path.insert(0, sys.argv[1]); from tests.unit.test_sampling import fingerprint\n"
            "for n in (1, 2):\n    torch.set_num_threads(n); print(n, fingerprint())")
    out = subprocess.run([sys.executable, "-c", code, str(ROOT)], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", here, "2", here]


def test_positions_seeds_and_streams_give_unrelated_noise():
    """Different (seed, position, stream) -> different noise with no visible correlation: every
    pairwise Pearson correlation within 5 standard errors of 0, and no value shared."""
    V = 8192
    vectors = [noise(1, p, V) for p in range(4)] + [noise(s, 0, V) for s in (2, 3, 2**40)] + \
              [noise(1, 0, V, st) for st in ("draft", "residual")]
    x = torch.stack(vectors).double()
    x = (x - x.mean(1, keepdim=True)) / x.std(1, keepdim=True)
    corr = x @ x.T / (V - 1)
    off = corr[~torch.eye(len(vectors), dtype=torch.bool)]
    assert float(off.abs().max()) < 5 / math.sqrt(V)
    for i in range(len(vectors)):
        for j in range(i + 1, len(vectors)):
            assert not bool((vectors[i] == vectors[j]).any())
    # neighbouring tokens and the block structure: lag-1 and lag-64 autocorrelation within a vector
    for lag in (1, BLOCK):
        a = x[0, :-lag] * x[0, lag:]
        assert abs(float(a.mean())) < 5 / math.sqrt(V - lag)


@pytest.mark.fast
def test_noise_is_standard_gumbel():
    """Mean (Euler's gamma) and variance (pi^2 / 6) within 5 standard errors; the CDF
    exp(-exp(-g)) within 5 binomial standard errors at seven points, pooled over 120 positions."""
    g = torch.cat([noise(11, p, 4096) for p in range(120)]).double()
    n = g.numel()
    assert abs(float(g.mean()) - 0.5772156649) < 5 * math.sqrt(math.pi**2 / 6 / n)
    assert abs(float(g.var()) - math.pi**2 / 6) < 5 * math.sqrt(4.4 / n) * math.pi**2 / 6   # kurtosis 5.4
    for x in (-1.5, -0.5, 0.0, 0.5, 1.5, 3.0, 6.0):
        f = math.exp(-math.exp(-x))
        assert abs(float((g <= x).double().mean()) - f) < 5 * math.sqrt(f * (1 - f) / n)


# --------------------------------------------------------------------------- the pruned sampler

@pytest.mark.parametrize("V", [1, 7, 64, 65, 1000, 1024, 1025, 5000, 49152])
def test_sample_equals_argmax_over_the_whole_noise(V):
    """The sampler computes noise only for blocks that can win; its token is always the argmax of
    the full vector (random and peaked logits, filters, temperatures, V around block edges)."""
    g = gen(V)
    for trial in range(12):
        scale = (0.5, 3.0, 12.0)[trial % 3]
        logits = torch.randn(V, generator=g) * scale
        s = Sampling((0.3, 0.7, 1.0, 1.7)[trial % 4], (0, 0, 5, 50)[trial % 4], (1.0, 0.9, 1.0, 0.6)[trial % 4],
                     (0.0, 0.0, 0.05, 0.0, 0.2)[trial % 5], seed=1000 * V + trial)
        assert sample(logits, s, trial) == full_argmax(logits, s, trial), (V, trial)


@pytest.mark.fast
def test_sample_rows_equals_sample_row_by_row():
    g = gen(3)
    logits = torch.randn(6, 5000, generator=g) * 4
    for s in [Sampling(0.8, seed=9), Sampling(1.2, 30, 0.8, 0.02, seed=9)]:
        positions = [40, 41, 42, 43, 44, 45]
        rows = sample_rows(logits, s, positions)
        assert rows == [sample(logits[j], s, p) for j, p in enumerate(positions)]
        assert rows == [full_argmax(logits[j], s, p) for j, p in enumerate(positions)]


def tie_case(first_low: bool):
    """Logits where token i (its block among the first 16 by logit) and token j (a block only the
    second stage reaches) both score exactly 0 = z + G and every other token scores below 0."""
    V, seed = 4096, 4
    g = noise(seed, 0, V)
    blocks = g.view(-1, BLOCK)
    j = int(blocks[40].argmax()) + 40 * BLOCK                           # a large G, in block 40
    i = int(blocks[2].argmin()) + 2 * BLOCK                             # a small G, in block 2
    z = torch.full((V,), -math.inf)
    for b in range(5, 30):                                              # decoys: higher logits, lower scores
        if b in (2, 40):
            continue
        d = int(blocks[b].argmin()) + b * BLOCK
        if g[d] < g[j] and g[d] < g[i]:
            z[d] = -(g[d] + g[j]) / 2
    if not first_low:                                                   # swap roles: the stage-2 token is lower
        i, j = j, i
    z[i], z[j] = -g[i], -g[j]
    return z, i, j, Sampling(1.0, seed=seed)


@pytest.mark.parametrize("first_low", [True, False])
def test_ties_go_to_the_lowest_token(first_low):
    z, i, j, s = tie_case(first_low)
    g = noise(s.seed, 0, z.numel())
    assert float(z[i] + g[i]) == 0.0 == float(z[j] + g[j])
    assert float((z + g).max()) == 0.0
    assert sample(z, s, 0) == min(i, j) == int((z + g).argmax())


def test_greedy_is_argmax_bit_for_bit():
    g = gen(0)
    logits = torch.randn(4, 49152, generator=g)
    logits[1, 10] = logits[1, 20] = logits[1].max() + 1                 # a tie: the first index
    greedy = Sampling(top_k=3, top_p=0.5, seed=7)                        # T = 0: filters and seed ignored
    want = logits.argmax(-1).tolist()
    assert want[1] == 10
    assert [sample(r, greedy, i) for i, r in enumerate(logits)] == want
    assert sample_rows(logits, greedy, [0, 1, 2, 3]) == want
    assert [propose(r, greedy, i, "rejection") for i, r in enumerate(logits)] == want
    lp = logprobs(logits, greedy)
    assert torch.equal(lp.argmax(-1), logits.argmax(-1)) and bool((lp.exp().sum(-1) == 1).all())
    assert accept_rejection(logits, logits[:3] * 2, [want[0], want[1], 5], greedy, 0) == (2, want[2])


def test_sampling_needs_a_seed():
    with pytest.raises(ValueError, match="seed"):
        sample(torch.randn(10), Sampling(0.5), 0)


def test_propose_streams():
    """Seeded: the draft's proposal uses the target's noise (so equal logits propose the target's
    sample); rejection: its own "draft" stream."""
    logits = torch.randn(2000, generator=gen(5))
    s = Sampling(0.9, seed=31)
    assert all(propose(logits, s, p, "seeded") == sample(logits, s, p) for p in range(20))
    assert all(propose(logits, s, p, "rejection") == full_argmax(logits, s, p, "draft") for p in range(20))
    assert [propose(logits, s, p, "rejection") for p in range(20)] != [sample(logits, s, p) for p in range(20)]
    assert propose(logits, Sampling(0.9, seed=31, verify="rejection"), 3) == propose(logits, s, 3, "rejection")


# ----------------------------------------------------------------------------------------- filters

def kept(logits, s) -> list[int]:
    return torch.isfinite(logprobs(torch.tensor(logits), s)).nonzero()[:, 0].tolist()


def logs(*p):
    return [math.log(x) for x in p]


def test_top_k_keeps_ties_and_ignores_k_past_v():
    assert kept([3.0, 2.0, 2.0, 1.0], Sampling(1.0, top_k=2, seed=1)) == [0, 1, 2]   # tie with the k-th kept
    assert kept([3.0, 2.0, 2.0, 1.0], Sampling(1.0, top_k=1, seed=1)) == [0]
    assert kept([3.0, 2.0, 2.0, 1.0], Sampling(1.0, top_k=4, seed=1)) == [0, 1, 2, 3]
    assert kept([3.0, 2.0, 2.0, 1.0], Sampling(1.0, top_k=99, seed=1)) == [0, 1, 2, 3]
    v = torch.randn(5000, generator=gen(1))                              # the block-based k-th value
    for k in (1, 7, 40, 300):
        assert sorted(kept(v.tolist(), Sampling(0.7, top_k=k, seed=1))) == sorted(v.topk(k).indices.tolist())


@pytest.mark.fast
def test_top_p_keeps_the_token_that_crosses():
    p = logs(0.5, 0.3, 0.2)
    assert kept(p, Sampling(1.0, top_p=0.5, seed=1)) == [0]              # mass ahead of token 1 is 0.5 >= 0.5
    assert kept(p, Sampling(1.0, top_p=0.55, seed=1)) == [0, 1]
    assert kept(p, Sampling(1.0, top_p=0.81, seed=1)) == [0, 1, 2]
    assert kept(p, Sampling(1.0, top_p=1e-9, seed=1)) == [0]             # at least one
    assert kept(p, Sampling(1.0, top_p=1.0, seed=1)) == [0, 1, 2]        # off
    # a tie straddling the boundary is kept whole (transformers keeps part of it, by sort order)
    assert kept(logs(0.4, 0.2, 0.2, 0.2), Sampling(1.0, top_p=0.5, seed=1)) == [0, 1, 2, 3]
    # temperature first: T = 0.5 sharpens it to (0.53, 0.30, 0.13, 0.03), T = 0.2 to (0.79, 0.19, ...)
    assert kept(logs(0.4, 0.3, 0.2, 0.1), Sampling(1.0, top_p=0.65, seed=1)) == [0, 1]
    assert kept(logs(0.4, 0.3, 0.2, 0.1), Sampling(0.5, top_p=0.65, seed=1)) == [0, 1]
    assert kept(logs(0.4, 0.3, 0.2, 0.1), Sampling(0.2, top_p=0.65, seed=1)) == [0]


def test_top_p_applies_to_what_top_k_kept():
    p = logs(0.4, 0.3, 0.2, 0.1)
    assert kept(p, Sampling(1.0, top_p=0.5, seed=1)) == [0, 1]           # alone: 0.4 < 0.5, keep token 1
    assert kept(p, Sampling(1.0, top_k=2, top_p=0.5, seed=1)) == [0]     # on (4/7, 3/7): 4/7 >= 0.5


def test_min_p_is_relative_to_the_top_token():
    half = math.log(0.5)
    z = [0.0, half + 1e-3, half - 1e-3, -5.0]
    assert kept(z, Sampling(1.0, min_p=0.5, seed=1)) == [0, 1]
    assert kept(z, Sampling(1.0, min_p=0.0, seed=1)) == [0, 1, 2, 3]
    assert kept(z, Sampling(1.0, min_p=0.999, seed=1)) == [0]
    assert kept(z, Sampling(2.0, min_p=0.5, seed=1)) == [0, 1, 2]        # after temperature: ratios sqrt'ed
    assert kept([1.0, 1.0, 0.0], Sampling(1.0, min_p=0.9, seed=1)) == [0, 1]


def test_logprobs_normalise_over_kept_tokens():
    z = torch.randn(3, 700, generator=gen(2)) * 2
    s = Sampling(0.8, 50, 0.9, 0.01, seed=1)
    lp = logprobs(z, s)
    assert lp.shape == z.shape and lp.dtype == torch.float32
    assert torch.allclose(lp.exp().sum(-1), torch.ones(3))
    for r in range(3):
        k = torch.isfinite(lp[r])
        t = threshold(z[r], s)
        assert torch.equal(k, z[r] / 0.8 >= t)
        assert torch.allclose(lp[r][k], torch.log_softmax(z[r][k] / 0.8, -1), atol=1e-5)


def hf_filtered(z: torch.Tensor, s: Sampling) -> torch.Tensor:
    """transformers' warpers in generate()'s order on one row of scores."""
    from transformers.generation.logits_process import (
        MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
    )
    scores = TemperatureLogitsWarper(s.temperature)(None, z[None].clone())
    if s.top_k:
        scores = TopKLogitsWarper(s.top_k)(None, scores)
    if s.top_p < 1:
        scores = TopPLogitsWarper(s.top_p)(None, scores)
    if s.min_p:
        scores = MinPLogitsWarper(s.min_p)(None, scores)
    return scores[0]


@pytest.mark.fast
def test_filters_agree_with_transformers():
    """Kept sets identical and log-probabilities equal to 1e-5 on random logits (no exact ties,
    so the documented tie and rounding differences do not arise)."""
    g = gen(8)
    settings = [Sampling(t, k, p, m, seed=1) for t, k, p, m in [
        (1.0, 10, 1.0, 0.0), (0.7, 0, 0.9, 0.0), (1.3, 0, 1.0, 0.05), (0.7, 40, 0.95, 0.0),
        (1.0, 100, 0.8, 0.1), (0.5, 0, 0.5, 0.02), (2.0, 5000, 0.99, 0.0), (0.9, 3, 0.3, 0.3)]]
    for trial in range(6):
        V = (1000, 3000, 5000)[trial % 3]
        z = torch.randn(V, generator=g) * (1.0, 4.0)[trial % 2]
        for s in settings:
            ours = logprobs(z, s)
            hf = torch.log_softmax(hf_filtered(z, s), -1)
            assert torch.equal(torch.isfinite(ours), torch.isfinite(hf)), (trial, s.key())
            k = torch.isfinite(ours)
            assert torch.allclose(ours[k], hf[k], atol=1e-5)


# ------------------------------------------------------------------------------------ verification

def test_accept_seeded_is_the_longest_equal_prefix():
    assert accept_seeded([], [5]) == 0
    assert accept_seeded([1, 2, 3], [1, 2, 3, 9]) == 3
    assert accept_seeded([1, 2, 3], [1, 7, 3, 9]) == 1
    assert accept_seeded([4], [1, 2]) == 0


@pytest.mark.fast
def test_accept_rejection_edges():
    V = 6
    p = torch.tensor([0.5, 0.3, 0.1, 0.1, 0.0, 0.0]).log()
    s = Sampling(1.0, seed=3)
    # identical p and q: every draft accepted, the bonus is the target's sample at position0 + k
    a, t = accept_rejection(torch.stack([p, p, p]), torch.stack([p, p]), [0, 1], s, 10)
    assert (a, t) == (2, sample(p, s, 12))
    # a draft p gives no mass to is always rejected, and the replacement is one p allows
    for pos in range(30):
        a, t = accept_rejection(torch.stack([p, p]), None, [5], s, pos)
        assert a == 0 and t in (0, 1, 2, 3)
    # q a point mass on the draft: rejected tokens come from p without the draft
    for pos in range(30):
        a, t = accept_rejection(torch.stack([p, p]), None, [0], s, pos)
        assert (a == 1) or (t != 0)
    # same inputs, same answer; shapes checked
    args = (torch.randn(4, V, generator=gen(1)), torch.randn(3, V, generator=gen(2)), [1, 2, 3], s, 7)
    assert accept_rejection(*args) == accept_rejection(*args)
    with pytest.raises(ValueError):
        accept_rejection(torch.randn(3, V), None, [1, 2, 3], s, 0)


@pytest.mark.fast
def test_the_kernel_sampler_gives_the_torch_ops_token(monkeypatch):
    """The kernel library's one-call sampler (RAKV_C_SAMPLER=1, the default on CPU) and torch's ops
    give the same token for every row: random, peaked and flat logits, -inf entries, V around block
    edges, temperatures, filters, several rows at once, and the rejection mode's residual stream."""
    from rakv.kernels import blockq
    from rakv.decoding.sampling import _residual_sample

    if blockq.library() is None:
        pytest.skip(f"no kernel library here: {blockq.reason()}")
    g = gen(11)
    cases = []
    for trial in range(240):
        V = (1, 5, 63, 64, 65, 700, 1024, 1025, 4097, 49152)[trial % 10]
        n = 1 + trial % 3
        z = torch.randn(n, V, generator=g) * (0.3, 2.0, 8.0, 30.0)[trial % 4]
        if trial % 7 == 0 and V > 2:
            z[:, : V // 2] = -math.inf
        s = Sampling((0.2, 0.7, 1.0, 1.5, 3.0)[trial % 5], (0, 0, 3, 40)[trial % 4],
                     (1.0, 0.95, 1.0, 0.5)[trial % 4], (0.0, 0.0, 0.1)[trial % 3], seed=977 * trial + 1)
        cases.append((z, s, list(range(trial, trial + n))))
    resid = [torch.rand(V, generator=g) * (torch.rand(V, generator=g) < 0.3) for V in (10, 999, 49152)]

    def run():
        rows = [sample_rows(z, s, pos) for z, s, pos in cases]
        return rows, [_residual_sample(r, 5, 17) for r in resid]

    monkeypatch.setenv("RAKV_C_SAMPLER", "1")
    fast = run()
    monkeypatch.setenv("RAKV_C_SAMPLER", "0")
    assert run() == fast


def test_a_verify_samples_its_rows_up_to_the_first_miss(monkeypatch):
    """Given a verify's drafts, the sampler stops after the first row whose token differs from its
    draft: the rows it gives are the full call's up to and including that one, on both samplers,
    for drafts that all match, miss at the first row, and miss in between."""
    from rakv.kernels import blockq

    g = gen(12)
    ways = ["0"] + (["1"] if blockq.library() is not None else [])
    for trial in range(60):
        n = 2 + trial % 5
        z = torch.randn(n, 1000, generator=g) * (0.5, 3.0, 12.0)[trial % 3]
        s = Sampling((0.3, 0.7, 1.0)[trial % 3], (0, 5)[trial % 2], seed=31 * trial + 2)
        pos = list(range(trial, trial + n))
        for way in ways:
            monkeypatch.setenv("RAKV_C_SAMPLER", way)
            full = sample_rows(z, s, pos)
            miss = trial % (n + 1)                    # the first row whose draft differs (n: none)
            drafts = [full[j] if j != miss else (full[j] + 1) % 1000 for j in range(n - 1)]
            rows = sample_rows(z, s, pos, drafts)
            a = min(miss, n - 1)
            assert rows == full[: a + 1], (trial, way)
            assert accept_seeded(drafts, rows) == accept_seeded(drafts, full) == a
    with pytest.raises(ValueError, match="verify"):
        sample_rows(torch.zeros(3, 10), Sampling(1.0, seed=1), [0, 1, 2], [1])
